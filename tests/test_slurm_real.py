"""A real Slurm (tests/slurm_cluster.py: slurmctld + slurmd on this machine) trains like one
process, the three ways users launch under it.

1. ``srun -N1 -n2 python train.py``: one task per process; ``initialize`` reads rank, world
   size, local rank and the master address from Slurm's variables and ``scontrol``.
2. ``srun -N1 -n1 python -m shardwise run --slurm --nproc-per-node 2 train.py``: one launcher
   per node, which starts the workers.
3. ``sbatch --wait examples/slurm/train.sbatch``: the batch script users copy.
4. ``scancel`` of a job that saves every step leaves no process behind and a whole checkpoint.

Each runs the example GPT (examples/gpt/train.py) on the same global batch as the one-process
run and is compared with it, with the tolerance of tests/test_example_gpt.py (fp32, six Adam
steps: reduction order only, < 1e-4).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401 - the session fixture
from test_example_gpt import GPT_DIR, SMALL_RUN, _train, assert_trains_like
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
DP2 = ("--micro-batch", "2", "--grad-accum", "2")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


def _train_args(out: Path) -> list[str]:
    return [str(GPT_DIR / "train.py"), "--out", str(out), *SMALL_RUN, *DP2]


def _commands(out: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "srun, one task per process": ["srun", "-N1", "-n2", py, *_train_args(out)],
        "srun, one launcher per node": [
            "srun", "-N1", "-n1", py, "-m", "shardwise", "run", "--slurm",
            "--nproc-per-node", "2", *_train_args(out),
        ],
        "sbatch --wait, the example batch script": [
            "sbatch", "--wait", f"--output={out.parent / 'slurm-%j.out'}",
            str(REPO / "examples" / "slurm" / "train.sbatch"), *SMALL_RUN, *DP2,
        ],
    }  # fmt: skip


@pytest.mark.parametrize("way", list(_commands(Path("x"))))
def test_slurm_jobs_train_like_one_process(slurm, one_process, tmp_path, way):  # noqa: F811
    out = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "OUT": str(out)}
    env["SHARDWISE_EXAMPLES"] = str(REPO / "examples")
    proc = slurm.run(*_commands(out)[way], cwd=str(tmp_path), env=env)
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, (
        f"{way}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-3000:]}"
    )
    assert_trains_like(out, one_process, way)


def _job_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_scancel_mid_save_leaves_no_process_and_no_half_checkpoint(slurm, tmp_path):  # noqa: F811
    """A job cancelled while it saves every step: no worker, launcher or step survives, and
    the checkpoint ``latest`` names is whole (every tensor's checksum verified)."""
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    script = str(Path(__file__).parent / "scripts" / "slurm_saver.py")
    cmd = [
        "sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", "--wrap",
        f"srun {sys.executable} -m shardwise run --slurm --nproc-per-node 2 {script} {save_dir}",
    ]  # fmt: skip
    job = slurm.run(*cmd, env={"OMP_NUM_THREADS": "1"}).stdout.strip().split(";")[0]
    assert job.isdigit(), f"sbatch said {job!r}"
    deadline = time.monotonic() + scaled(120)
    while not (save_dir / "started").exists():
        assert time.monotonic() < deadline, f"the job never saved:\n{slurm.logs()}"
        time.sleep(0.2)
    time.sleep(1.5)  # a few more saves: the cancel lands at an arbitrary point of one
    slurm.run("scancel", job)
    deadline = time.monotonic() + scaled(60)
    while slurm.run("squeue", "-h", "-j", job).stdout.strip():
        assert time.monotonic() < deadline, "the cancelled job is still in the queue"
        time.sleep(0.5)
    deadline = time.monotonic() + scaled(30)
    while _job_processes(str(save_dir)):
        assert time.monotonic() < deadline, f"stray processes: {_job_processes(str(save_dir))}"
        time.sleep(0.5)
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "inspect", str(save_dir), "--verify"],
        capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert out.returncode == 0, f"the checkpoint latest names is not whole:\n{out.stderr}"
    assert "checksum" in out.stdout, out.stdout
