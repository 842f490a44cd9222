"""Lightning's Trainer on shardwise (integrations/lightning): a small LightningModule
(tests/scripts/lightning_fit.py: MLP, SGD with momentum, a per-step StepLR, 2 epochs of 4
steps) fitted on 2 processes with ``ShardwiseStrategy`` equals the same module fitted in one
process by plain Lightning (no shardwise) on the same global batches.

Tolerance 1e-5 on every step's loss and every final parameter (fp32: the two runs differ by
the order of one all-reduce's additions, about 1e-7 here; a wrong scale, a missed reduction or
a lost accumulation step is >= 1e-2 off). SGD, not Adam, so that rounding noise is not
amplified (docs design notes). The layouts (ROWS): DP by the registered name ``"shardwise"``,
ZeRO-1 to 3 by name or ``ShardwiseStrategy(config=...)``, ZeRO-1 and ZeRO-2 with
``accumulate_grad_batches=2``, ZeRO-3 with optimizer and parameters offloaded to the CPU (on a
CPU run the same arithmetic: the same bound), tensor parallelism of the MLP (tp=2 on 2
devices: one data rank reading the whole global batch). ``trainer.save_checkpoint`` after epoch
1 on 2 processes (ZeRO-3) and ``fit(ckpt_path=...)`` on 1 process (ZeRO-2) continue like the
uninterrupted run. bf16 (``precision="bf16-mixed"`` -> the config's bf16 block) trains within
bf16's error.

The cost is Lightning's import in each process, not the 8 steps: one launch of 2 processes
fits every 2-process run one after the other (each a new Trainer, strategy and model), one
launch of 1 process the plain references and the resumed half.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from waits import scaled

pytest.importorskip(
    "lightning", reason="lightning is not installed (pip install shardwise[lightning])"
)

SCRIPT = Path(__file__).parent / "scripts" / "lightning_fit.py"
ZERO1, ZERO2 = ({"zero_optimization": {"stage": s}} for s in (1, 2))
OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}  # fmt: skip
TP2 = {"tensor_parallel": {"size": 2, "plan": {"net.0": "colwise", "net.2": "rowwise"}}}
TP2_ROW = "tp2, tensor_parallel.plan colwise/rowwise MLP"
TOL = 1e-5  # module docstring
ROWS = {  # name: a 2-process run (lightning_fit.py's keys), against plain Lightning alike
    "dp, strategy='shardwise'": {"strategy": "shardwise"},
    "zero1, strategy='shardwise_zero1'": {"strategy": "shardwise_zero1"},
    "zero2, ShardwiseStrategy(config)": {"strategy": "shardwise", "config": ZERO2},
    "zero3, strategy='shardwise_zero3'": {"strategy": "shardwise_zero3"},
    "zero1, accumulate_grad_batches=2": {"strategy": "shardwise", "config": ZERO1, "accumulate": 2},
    "zero2, accumulate_grad_batches=2": {"strategy": "shardwise", "config": ZERO2, "accumulate": 2},
    "zero3, offload_optimizer + offload_param to cpu": {"strategy": "shardwise", "config": OFFLOAD},
    TP2_ROW: {"strategy": "shardwise", "config": TP2},
}
RUN = {name: f"row{i}" for i, name in enumerate(ROWS)}  # output folder of each row


def _launch(out: Path, devices: int, runs: dict[str, dict]) -> Path:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank: repeatable to the bit
    cmd = [sys.executable, str(SCRIPT), str(out), "--devices", str(devices)]
    for name, run in runs.items():
        cmd += ["--run", name, json.dumps(run)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out


def _run(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Every step's global-batch loss (the mean of the ranks' equal batches) and the weights."""
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("losses-rank*.json"))]
    losses = [sum(step) / len(step) for step in zip(*ranks, strict=True)]
    return losses, torch.load(out / "params.pt")


def _assert_same(got: tuple, ref: tuple, case: str, tol: float = TOL) -> float:
    (losses, params), (ref_losses, ref_params) = got, ref
    assert len(losses) == len(ref_losses), f"{case}: {len(losses)} steps vs {len(ref_losses)}"
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    assert diff < tol, f"{case}: losses {losses} vs one process {ref_losses}"
    assert params.keys() == ref_params.keys(), f"{case}: {sorted(params)} vs {sorted(ref_params)}"
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=tol, msg=f"{case} {name}")
    return diff


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """One launch of 2 processes: every row, bf16, and epoch 1 of the resume (saved)."""
    out = tmp_path_factory.mktemp("two")
    runs = {RUN[name]: run for name, run in ROWS.items()}
    runs["bf16"] = {"strategy": "shardwise", "config": ZERO2, "precision": "bf16-mixed"}
    runs["first"] = {"strategy": "shardwise_zero3", "epochs": 1, "save": str(out / "epoch1.ckpt")}
    return _launch(out, 2, runs)


@pytest.fixture(scope="module")
def one(tmp_path_factory, two) -> Path:
    """One launch of 1 process: plain Lightning per accumulation (the references), then epoch
    2 of the resume from ``two``'s checkpoint (ZeRO-2)."""
    second = {"strategy": "shardwise", "config": ZERO2, "resume": str(two / "epoch1.ckpt")}
    runs = {"plain-acc1": {}, "plain-acc2": {"accumulate": 2}, "second": second}
    return _launch(tmp_path_factory.mktemp("one"), 1, runs)


@pytest.mark.parametrize("name", list(ROWS))
def test_two_processes_train_like_plain_lightning_in_one(two, one, name):
    accumulate = ROWS[name].get("accumulate", 1)
    _assert_same(_run(two / RUN[name]), _run(one / f"plain-acc{accumulate}"), name)


def test_tensor_parallelism_split_the_mlp(two):
    """The tp2 row ran split, not replicated: rank 0's module holds half of the first layer's
    output features and half of the second's input features (the biases of a row split stay
    whole), while the saved weights are whole."""
    local = json.loads((two / RUN[TP2_ROW] / "local-shapes.json").read_text())
    whole = {k: list(v.shape) for k, v in _run(two / RUN[TP2_ROW])[1].items()}
    split = {"net.0.weight": [8, 8], "net.0.bias": [8], "net.2.weight": [4, 8], "net.2.bias": [4]}
    assert local == split, f"{TP2_ROW}: rank 0 holds {local}, whole {whole}"
    assert whole["net.0.weight"] == [16, 8], f"{TP2_ROW}: params.pt holds {whole}"


def test_resume_at_another_world_size_and_layout_is_exact(two, one):
    """Epoch 1 on 2 processes (ZeRO-3), saved by trainer.save_checkpoint; epoch 2 resumed by
    fit(ckpt_path=...) on 1 process (ZeRO-2): the two runs joined are the uninterrupted one."""
    assert (two / "epoch1.ckpt" / "latest").is_file(), "a shardwise checkpoint directory"
    (losses1, _), (losses2, params) = _run(two / "first"), _run(one / "second")
    _assert_same((losses1 + losses2, params), _run(one / "plain-acc1"), "zero3 x 2 -> zero2 x 1")


def test_bf16_trains_within_bf16_error(two, one):
    """precision='bf16-mixed' turns the config's bf16 on: the model computes in bf16 with fp32
    masters. Its losses follow the fp32 run within bf16's error (8 bits of mantissa; measured
    1.1e-3 over the 8 steps), and do differ from it (bf16 really ran)."""
    (losses, _), (ref_losses, _) = _run(two / "bf16"), _run(one / "plain-acc1")
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    assert 0 < diff < 1e-2, f"bf16 losses {losses} vs fp32 {ref_losses}"
