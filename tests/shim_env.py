"""A Python environment as a user's ``pip install ./integrations/deepspeed-shim`` leaves it,
for tests that run the Hugging Face Trainer and Accelerate through the shim.

The dev environment holds a real DeepSpeed (the ``bench`` extra), over which the shim refuses
to install; so a fresh venv (without pip of its own: this environment's pip installs into it
with ``--python``) gets the shim by pip, from a copy of its directory (pip builds in place),
while it sees nothing else. Then a ``.pth`` file adds this environment's packages
(torch, transformers, accelerate) *behind* its own: ``import deepspeed`` and
``importlib.metadata.version("deepspeed")`` find the shim first, as the Trainer's availability
check does, and the real DeepSpeed further down the path is never reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from waits import scaled

SHIM = Path(__file__).resolve().parents[1] / "integrations" / "deepspeed-shim"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(600))


def make_shim_env(where: Path) -> str:
    """The python of a new venv under ``where`` holding the pip-installed shim."""
    venv = where / "venv"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = str(venv / "bin" / "python")
    copy = shutil.copytree(SHIM, where / "deepspeed-shim")
    # this environment's pip, working on the new one (`--python`): the build backend's check
    # for a real DeepSpeed reads the new environment, as in a user's own venv
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps"]
    proc = _run([*install, str(copy)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib.stdout.strip(), "zz-shardwise-env.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n"
    )
    return python


def run_script(name: str, cmd: list[str], cwd: Path) -> None:
    """One launch of a Hugging Face script in the shim's venv (``cmd`` starts with its python),
    importing the shardwise under test, offline, one thread per rank; fails naming ``name``."""
    import shardwise

    src = str(Path(shardwise.__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(300), env=env, cwd=cwd
    )
    assert proc.returncode == 0, f"{name}: " + proc.stdout[-3000:] + proc.stderr[-5000:]
