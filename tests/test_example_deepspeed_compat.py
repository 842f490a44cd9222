"""A DeepSpeed script runs with only its import changed (examples/deepspeed_compat)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from waits import scaled

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "deepspeed_compat"


def test_the_script_mentions_shardwise_only_in_its_import():
    tree = ast.parse((EXAMPLE / "train.py").read_text())
    imports = [
        (alias.name, alias.asname)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert ("shardwise", "deepspeed") in imports, imports
    assert not [i for i in imports if "shardwise" in i[0] and i[1] != "deepspeed"], imports
    assert "shardwise" not in names, "the body must call deepspeed.*, as the original does"


def test_it_trains_on_two_processes_with_deepspeed_flags():
    cmd = [
        sys.executable,
        "-m",
        "shardwise",
        "run",
        "--nproc-per-node",
        "2",
        str(EXAMPLE / "train.py"),
        "--deepspeed",
        "--deepspeed_config",
        str(EXAMPLE / "ds_config.json"),
        "--epochs",
        "3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(240), env=env, cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"epoch \d+ rank 0 loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3, out.stdout
    assert losses[-1] < losses[0] * 0.5, f"the loss must fall: {losses}"
    # 512 samples / train_batch_size 32 = 16 optimizer steps per epoch, on 2 processes.
    assert "done global_steps=48 world=2" in out.stdout, out.stdout
