"""Two real hosts (network namespaces, tests/netns_hosts.py) train like one process.

Each host runs ``shardwise run --nnodes 2 --node-rank I --master-addr 10.77.0.1`` of the example
GPT (examples/gpt/train.py), so the ranks talk over the veth link between the namespaces; the
result is compared with the one-process run of the same global batch, with the tolerance of
tests/test_example_gpt.py (fp32, six Adam steps: reduction order only, < 1e-4; a wrong
micro-batch, scale or reduction is >= 1e-2 off). Layouts: DP4 (2 ranks per host), ZeRO-2 x 4
(gradient shards reduced across the link, the whole model saved by the two hosts and loaded
by one process), DP2 x TP2
(the tensor axis inside a host, data across: the mesh's innermost axis is the local ranks),
PP2 (one stage per host), and DP4 again with Debian's default hosts file, where the host name
resolves to 127.0.1.1: gloo used to listen on loopback and the job failed with "Connection
refused" unless GLOO_SOCKET_IFNAME was set by hand; shardwise now picks the interface that
reaches the master and says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_hosts import ADDRESSES, LINKS, set_link
from test_example_gpt import GPT_DIR, SMALL_RUN, _train, assert_trains_like
from waits import scaled, scaled_int

ZERO2 = Path(__file__).parent / "scripts" / "zero2.json"  # {"zero_optimization": {"stage": 2}}
# name: (processes per host, train.py flags, hosts-file flavour)
# Plain DP4 over the two hosts is test_slurm_two_nodes.py's job; here ZeRO-2 over four data
# ranks carries it, with the host name on 127.0.1.1 (a row of its own cost 22 s of the suite).
ROWS = {
    "dp2xtp2": (2, ("--dp", "2", "--tp", "2", "--micro-batch", "2", "--grad-accum", "2"), "own address"),
    "zero2x4, host name on 127.0.1.1": (2, ("--dp", "4", "--micro-batch", "2", "--grad-accum", "1", "--config", str(ZERO2)), "debian 127.0.1.1"),
    "pp2": (1, ("--pp", "2", "--micro-batch", "2", "--grad-accum", "4"), "own address"),
}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


def _run_two_hosts(hosts, out, nproc: int, extra: tuple, flavour: str) -> list[str]:
    env = hosts.environment(SHARDWISE_TIMEOUT_S=str(scaled_int(120)))
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "shardwise", "run", "--nnodes", "2", "--node-rank", str(i),
                "--nproc-per-node", str(nproc), "--master-addr", ADDRESSES[0],
                "--master-port", "29611", str(GPT_DIR / "train.py"), "--out", str(out),
                *SMALL_RUN, *extra]  # fmt: skip
        cmd = hosts.command(i, argv, flavour)
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=scaled(150))[0])
        except subprocess.TimeoutExpired:
            hosts.kill_all()
            raise
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n---\n".join(x[-3000:] for x in logs)
    return logs


@pytest.mark.parametrize("name", list(ROWS))
def test_two_hosts_train_like_one_process(two_hosts, one_process, tmp_path, name):
    nproc, extra, flavour = ROWS[name]
    logs = _run_two_hosts(two_hosts, tmp_path / "run", nproc, extra, flavour)
    if flavour == "debian 127.0.1.1":
        for i, log in enumerate(logs):
            assert f"gloo uses {LINKS[i]}" in log, f"{name}: host {i} did not say: {log[-2000:]}"
    if ZERO2 in map(Path, extra):  # the layout the row names is the one that ran
        ran = json.loads((tmp_path / "run" / "config.json").read_text())["shardwise"]
        assert ran["zero_optimization"]["stage"] == 2, f"{name}: ran {ran.get('zero_optimization')}"
    assert_trains_like(tmp_path / "run", one_process, name)


LOST_AFTER_S = scaled_int(10)  # the default is 60 s; the same code path, shortened for speed
# How long an elastic agent alone waits for more hosts (torch's 30 s is no point here). Only
# the first rendezvous needs it: both hosts start at once and host 1 must join within it. It is
# read when the suite starts, not when the test runs: a cost paid on every run, which the load
# average the suite's own earlier tests leave behind (3x in a quiet run) must not stretch.
LAST_CALL_S = scaled_int(5)


def _start_dp4(hosts, marker: Path, port: str, env: dict, *script_args: str) -> list:
    """DP4 of tests/scripts/long_dp.py on both hosts; returns once its first step is done."""
    script = str(Path(__file__).parent / "scripts" / "long_dp.py")
    procs = []
    for i in range(2):
        argv = [sys.executable, "-m", "shardwise", "run", "--nnodes", "2", "--node-rank", str(i),
                "--nproc-per-node", "2", "--master-addr", ADDRESSES[0], "--master-port", port,
                script, str(marker), *script_args]  # fmt: skip
        procs.append(subprocess.Popen(hosts.command(i, argv), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + scaled(120)
    while not marker.exists():
        assert time.monotonic() < deadline, "training never started"
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.2)
    return procs


def test_a_host_that_loses_its_link_is_named_on_both_sides(two_hosts, tmp_path):
    """DP4 on two hosts; host 1's link goes down mid-training. With the collective timeout at
    10 minutes, each host must still stop within the heartbeat limit plus the launcher's
    teardown, exit non-zero, and say which host (or the store's host) it lost."""
    env = two_hosts.environment(
        SHARDWISE_TIMEOUT_S=str(scaled_int(600)), SHARDWISE_HOST_TIMEOUT_S=str(LOST_AFTER_S)
    )
    try:
        procs = _start_dp4(two_hosts, tmp_path / "started", "29612", env)
        time.sleep(1)
        set_link(1, up=False)
        cut = time.monotonic()
        logs, took = [], []
        for p in procs:
            logs.append(p.communicate(timeout=LOST_AFTER_S + scaled(60))[0])
            took.append(time.monotonic() - cut)
    finally:
        set_link(1, up=True)
        two_hosts.kill_all()
    codes = [p.returncode for p in procs]
    assert all(c != 0 for c in codes), f"exit codes {codes}"
    assert "[shardwise] lost host host1 (node 1), ranks 2-3" in logs[0], logs[0][-3000:]
    # Host 1 sees host 0's counter stop, or its store (on host 0) go silent: either names host 0.
    assert re.search(
        r"\[shardwise\] lost (host host0 \(node 0\), ranks 0-1|the job's store at 10\.77\.0\.1)",
        logs[1],
    ), logs[1][-3000:]
    assert max(took) < LOST_AFTER_S + scaled(30), f"hosts stopped {took} s after the cut"


FLAP_S, FLAP_STEPS = 2.0, 80  # the cut comes ~1 s after step 1, some 20 steps in


def test_a_two_second_link_flap_is_ridden_out_with_default_settings(two_hosts, tmp_path):
    """DP4 on two hosts, default timeouts (collectives 30 min, heartbeat 60 s); host 1's link
    goes down for 2 s mid-training and comes back. TCP retransmits what was in flight and gloo
    never sees an error: both hosts finish their 80 steps and exit 0, and no host is reported
    lost. (A flap longer than the heartbeat limit is a lost host, above.)"""
    env = two_hosts.environment()
    for var in ("SHARDWISE_TIMEOUT_S", "SHARDWISE_HOST_TIMEOUT_S"):
        env.pop(var, None)
    try:
        procs = _start_dp4(two_hosts, tmp_path / "started", "29613", env, str(FLAP_STEPS))
        time.sleep(1)
        set_link(1, up=False)
        time.sleep(FLAP_S)
        set_link(1, up=True)
        logs = [p.communicate(timeout=scaled(120))[0] for p in procs]
    finally:
        set_link(1, up=True)
        two_hosts.kill_all()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes} after a {FLAP_S} s flap:\n" + "\n---\n".join(
        x[-2000:] for x in logs
    )
    assert not any("lost" in x for x in logs), "a 2 s flap must not count as a lost host"


def test_the_dp2xtp2_row_keeps_tensor_groups_inside_a_host():
    """`shardwise topo` of the row's layout: each tensor group is one host's two ranks, so only
    the data-parallel traffic crosses the link (the row above checks the training)."""
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "topo", "--dp", "2", "--tp", "2", "--nnodes", "2",
         "--nproc-per-node", "2"],
        capture_output=True, text=True, timeout=scaled(60), check=True,
    ).stdout  # fmt: skip
    assert "tensor groups (tp=2, 2 groups): [0, 1] [2, 3]" in out, out
    hosts = dict(re.findall(r"^\s+(\d)\s+(node\d)", out, re.M))
    assert hosts == {"0": "node0", "1": "node0", "2": "node1", "3": "node1"}, out


def test_an_elastic_job_goes_on_without_a_lost_host_and_takes_it_back(two_hosts, tmp_path):
    """``--nnodes 1:2 --max-restarts 3`` (c10d rendezvous) of tests/scripts/elastic_dp.py,
    which saves every 5 steps with ``auto_resume``. Host 1 is killed (launcher and workers)
    mid-run: host 0's agent restarts its group alone, and training goes on in a world of 2
    from the last save. Host 1's launcher is started again: host 0's agent stops its group
    (SIGTERM: the workers save that step, launch/preempt.py) and both hosts go on in a world
    of 4 from it, to the end, exit 0."""
    out, env = tmp_path / "out", two_hosts.environment()
    out.mkdir()
    script = str(Path(__file__).parent / "scripts" / "elastic_dp.py")
    argv = [sys.executable, "-m", "shardwise", "run", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--max-restarts", "3", "--master-addr", ADDRESSES[0], "--master-port", "29615",
            "--rdzv-conf", f"last_call_timeout={LAST_CALL_S}",
            script, str(out), "120"]  # fmt: skip
    logs = [tmp_path / "host0.log", tmp_path / "host1.log", tmp_path / "host1-again.log"]

    def start(i: int, log: Path) -> subprocess.Popen:
        return subprocess.Popen(two_hosts.command(i, argv), env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def step() -> int:
        text = (out / "progress").read_text() if (out / "progress").exists() else ""
        return int(text) if text else 0

    def wait_for(what: str, seconds: float) -> None:
        deadline = time.monotonic() + scaled(seconds)
        while what not in logs[0].read_text():
            assert time.monotonic() < deadline, (
                f"no {what!r} within {seconds} s:\n"
                + "\n---\n".join(x.read_text()[-2500:] for x in logs if x.exists())
            )
            time.sleep(0.2)

    try:
        host0, _ = start(0, logs[0]), start(1, logs[1])
        wait_for("[elastic] world 4 starts at step 0", 120)
        while step() < 12:
            assert host0.poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        two_hosts.kill_all(hosts=(1,))
        wait_for("[elastic] world 2 starts at step 10", 150)
        host1 = start(1, logs[2])
        host0.wait(timeout=scaled(240))
        host1.wait(timeout=scaled(60))
    finally:
        two_hosts.kill_all()
    text = logs[0].read_text()
    codes = [host0.returncode, host1.returncode]
    assert codes == [0, 0], f"exit codes {codes}:\n{text[-3000:]}"
    regrown = re.search(
        r"\[elastic\] world 4 starts at step (\d+)", text.split("world 2 starts")[1]
    )
    assert regrown and int(regrown.group(1)) > 10, f"host 1 never rejoined:\n{text[-3000:]}"
    assert (out / "done").read_text() == "4", "the job must end in the world of 4"
