"""integrations/deepspeed-shim: the ``deepspeed`` distribution and import name, answered by
shardwise, for the Hugging Face Trainer and Accelerate (issue 27, first part).

- In an environment with a real DeepSpeed, ``pip install`` of the shim stops before anything is
  installed, naming it (pip would otherwise uninstall DeepSpeed to put the shim in its place).
- In a fresh environment it installs, and then: transformers' ``is_deepspeed_available()`` is
  true (it reads ``importlib.metadata``), ``deepspeed.__version__`` says shardwise, and
  ``deepspeed``, ``deepspeed.zero``, ``deepspeed.utils.groups`` are shardwise's own objects.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shim_env import make_shim_env
from waits import scaled

SHIM = Path(__file__).resolve().parents[1] / "integrations" / "deepspeed-shim"


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(600), **kw)


def _copy(tmp_path: Path) -> str:
    """A copy of the shim: pip builds a directory in place (build/, *.egg-info)."""
    return str(shutil.copytree(SHIM, tmp_path / "deepspeed-shim"))


def test_the_shim_refuses_to_install_over_a_real_deepspeed(tmp_path):
    try:
        before = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no DeepSpeed installed here (make dev installs it with the bench extra)")
    if "+shardwise" in before:
        pytest.skip("this environment has the shim, not DeepSpeed")
    # --dry-run: pip builds the metadata (where the refusal is) and installs nothing anyway.
    proc = _run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", _copy(tmp_path)])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "refusing to install over a real DeepSpeed: deepspeed " + before in out, out[-3000:]
    assert importlib.metadata.version("deepspeed") == before


CHECK = """
import importlib, json
import importlib.metadata as md
import deepspeed, shardwise
from transformers.integrations.deepspeed import is_deepspeed_available
print(json.dumps({
    "available": is_deepspeed_available(),
    "version": deepspeed.__version__,
    "metadata": md.version("deepspeed"),
    "initialize": deepspeed.initialize is shardwise.initialize,
    "zero": importlib.import_module("deepspeed.zero") is shardwise.zero,
    "groups": importlib.import_module("deepspeed.utils.groups")
    is importlib.import_module("shardwise.utils.groups"),
    "comm": importlib.import_module("deepspeed.comm") is shardwise.comm,
}))
"""


def test_the_shim_gives_transformers_a_deepspeed_that_is_shardwise(tmp_path):
    python = make_shim_env(tmp_path)  # pip-installed into a fresh venv (shim_env.py)
    proc = _run([python, "-c", CHECK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "available": True,
        "version": "0.19.8+shardwise",
        "metadata": "0.19.8+shardwise",
        "initialize": True,
        "zero": True,
        "groups": True,
        "comm": True,
    }, got
