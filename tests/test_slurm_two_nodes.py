"""Two real Slurm nodes (tests/slurm_two_nodes.py: one slurmd per network namespace) train
like one process: ``srun -N2 --ntasks-per-node=1 shardwise run --slurm --nproc-per-node 2``,
one launcher per node, DP4 of the example GPT across the veth link. Compared with the
one-process run of the same global batch, with the tolerance of tests/test_example_gpt.py
(fp32, six Adam steps: reduction order only, < 1e-4).
"""

from __future__ import annotations

import re
import sys

import pytest
from slurm_two_nodes import slurm_two_nodes  # noqa: F401 - the module fixture
from test_example_gpt import GPT_DIR, SMALL_RUN, _train, assert_trains_like
from waits import scaled

_CAUSE = re.compile(r"terminate called|what\(\)|Traceback|Error|Exception|Signal 6|core dumped")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


def test_two_slurm_nodes_train_like_one_process(slurm_two_nodes, one_process, tmp_path):  # noqa: F811
    cluster, out = slurm_two_nodes, tmp_path / "run"
    argv = ["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "shardwise", "run",
            "--slurm", "--nproc-per-node", "2", str(GPT_DIR / "train.py"), "--out", str(out),
            *SMALL_RUN, "--dp", "4", "--micro-batch", "2", "--grad-accum", "1"]  # fmt: skip
    job = cluster.run(*argv, timeout=scaled(240))
    # The cause of a failed rank is printed first; torchrun's 300 s exit-barrier traceback of
    # the other node comes last and would push it out of a tail alone.
    causes = [ln for ln in job.stderr.splitlines() if _CAUSE.search(ln)][:20]
    assert job.returncode == 0, (
        f"{job.stdout[-2000:]}\nfirst error lines:\n"
        + "\n".join(causes)
        + f"\n{job.stderr[-3000:]}\n{cluster.logs()}"
    )
    assert "2 nodes x 2 processes = world 4, master slhost0:" in job.stderr, job.stderr[-2000:]
    assert_trains_like(out, one_process, "two Slurm nodes")
