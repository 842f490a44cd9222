"""examples/classify: the digits CNN trains on one process and on two, and both agree.

Two short end-to-end runs of train.py (2 epochs each). Accuracy: the CNN passes 93% of the
359 validation digits after one epoch and 96% after two, so > 90% leaves a margin.

Layout parity: the global batch is fixed and SyncBatchNorm normalizes over it, so the two runs
differ by fp32 reduction order only (~1e-6 on a loss of order 0.1-1). The printed losses have 4
decimals: they agree within one unit of the last digit (a value on a rounding boundary may
print either way); accuracies within 2 of the 359 validation samples (a sample whose two top
logits nearly tie may flip).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "classify" / "train.py"
EPOCHS = 2
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) train_loss (\S+) val_acc (\S+)$", re.M)
FINAL_LINE = re.compile(r"^final val_acc (\S+) \((\d+) samples", re.M)


def _launch(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(SCRIPT)]
    if (REPO / "src" / "shardwise" / "launch" / "cli.py").exists():
        return [
            sys.executable,
            "-m",
            "shardwise",
            "run",
            "--nproc-per-node",
            str(nproc),
            str(SCRIPT),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(SCRIPT),
    ]


def _train(nproc: int) -> tuple[list[tuple[float, float]], float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*_launch(nproc), "--epochs", str(EPOCHS)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (
        f"nproc={nproc}: exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    )
    epochs = EPOCH_LINE.findall(out)
    assert [(int(e), int(n)) for e, n, _, _ in epochs] == [
        (i + 1, EPOCHS) for i in range(EPOCHS)
    ], f"nproc={nproc}: one line per epoch, printed by rank 0 only\n{out}"
    final = FINAL_LINE.findall(out)
    assert len(final) == 1, f"nproc={nproc}: exactly one final line\n{out}"
    assert f"{nproc} data-parallel rank(s)" in out, f"nproc={nproc}\n{out}"
    return [(float(loss), float(acc)) for _, _, loss, acc in epochs], float(final[0][0]), out


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple]:
    return {n: _train(n) for n in (1, 2)}


@pytest.mark.parametrize("nproc", [1, 2])
def test_reaches_accuracy(runs, nproc):
    epochs, final, out = runs[nproc]
    assert final > 0.90, f"nproc={nproc}: final val accuracy {final}\n{out}"
    assert epochs[-1][0] < epochs[0][0], f"nproc={nproc}: loss did not fall\n{out}"


def test_layouts_agree(runs):
    (single, final1, _), (double, final2, _) = runs[1], runs[2]
    for e, ((l1, a1), (l2, a2)) in enumerate(zip(single, double, strict=True)):
        tag = f"epoch {e + 1}: nproc=1 vs nproc=2 (dp=2)"
        assert abs(l1 - l2) <= 1.5e-4, f"{tag}: train_loss {l1} vs {l2}"
        assert abs(a1 - a2) <= 2 / 359 + 1e-4, f"{tag}: val_acc {a1} vs {a2}"
    assert abs(final1 - final2) <= 2 / 359 + 1e-4
