"""A real Slurm for the tests: Debian's slurm-wlm, one node (this machine), started and stopped
by a session fixture.

``slurm`` installs ``slurm-wlm`` with apt when it is missing (root only), writes a minimal
``slurm.conf`` in a temporary directory (``AuthType=auth/none`` and ``CredType=cred/none``, so
no munge; ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres``, no accounting; the node
declared with 8 CPUs and ``OverSubscribe=FORCE:4`` so four tasks fit on two cores), starts
``slurmctld -D`` and ``slurmd -D`` as its own children on ports of its own, waits until
``sinfo`` shows the node idle, and at the end cancels what is left and stops both (also on
failure). Tests get the environment (``SLURM_CONF``) to run ``srun``/``sbatch`` with.
docs/launch.md gives the same recipe for a laptop.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from waits import scaled

CONF = """\
ClusterName=shardwise
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass
class Slurm:
    """The running cluster: ``env`` has ``SLURM_CONF``; ``dir`` holds its state and logs."""

    dir: Path
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
            timeout=timeout, **kw,
        )  # fmt: skip

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.dir.glob("*.log"))
        )


def _install() -> None:
    if shutil.which("slurmctld") and shutil.which("srun"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("real Slurm tests need Debian's slurm-wlm: install it (root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(600))
    if out.returncode != 0 or not shutil.which("slurmctld"):
        pytest.skip(f"real Slurm tests: apt-get install slurm-wlm failed: {out.stderr[-500:]}")


def _wait_idle(slurm: Slurm, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out = slurm.run("sinfo", "-h", "-o", "%T", timeout=scaled(10))
        if out.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Slurm node never became idle:\n{slurm.logs()}")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    if os.geteuid() != 0:
        pytest.skip("real Slurm tests need root (slurmd runs jobs as any user)")
    _install()
    home = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (home / sub).mkdir()
    conf = home / "slurm.conf"
    host = socket.gethostname()
    conf.write_text(CONF.format(host=host, dir=home))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(k)  # a Slurm job's own variables must not leak into the tests' jobs
    cluster = Slurm(home, env)
    daemons = [
        subprocess.Popen([d, "-D", *extra], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
        for d, extra in (("slurmctld", ["-i"]), ("slurmd", ["-N", host]))
    ]  # fmt: skip
    try:
        _wait_idle(cluster)
        yield cluster
    finally:
        cluster.run("scancel", "--full", "-u", "root", timeout=scaled(30))
        for d in daemons:
            os.killpg(d.pid, signal.SIGTERM)
        for d in daemons:
            try:
                d.wait(timeout=scaled(20))
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
