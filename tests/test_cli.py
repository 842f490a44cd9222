"""``shardwise run`` and ``shardwise topo``.

The torchrun command line is a pure function of our flags and is tested as a table; two real
launches check what the table cannot: two ranks that all-reduce, and a failed worker group
that torchrun's elastic agent restarts. DeepSpeed's hostfile and include/exclude filters are
checked against the cases transcribed from DeepSpeed's own tests.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waits import scaled

from shardwise.launch import run as run_mod
from shardwise.launch.cli import main, make_parser
from shardwise.launch.hostfile import parse_hostfile, parse_resource_filter
from shardwise.launch.run import build_torchrun_argv, launch_env, resolve_hosts

REPO = Path(__file__).resolve().parents[1]
CASES = REPO.parent / "shared" / "reference" / "deepspeed-cases" / "launcher_cases.json"
needs_reference = pytest.mark.skipif(
    not CASES.is_file(), reason=f"{CASES} missing (shared/ beside the repo)"
)
HELLO = str(REPO / "tests" / "scripts" / "hello.py")
ONE_NODE = "--standalone --local-addr=127.0.0.1"


def _run_args(*flags):
    return make_parser().parse_args(["run", *flags])


def _argv(*flags):
    return " ".join(build_torchrun_argv(_run_args(*flags)))


ARGV = [
    # (case, `shardwise run` flags, torchrun argv)
    ("one node: standalone, loopback", "t.py", f"--nnodes=1 --nproc-per-node=1 {ONE_NODE} --max-restarts=0 t.py"),
    ("torchrun spelling", "--nproc-per-node 2 t.py", f"--nnodes=1 --nproc-per-node=2 {ONE_NODE} --max-restarts=0 t.py"),
    ("underscore alias", "--nproc_per_node=2 t.py", f"--nnodes=1 --nproc-per-node=2 {ONE_NODE} --max-restarts=0 t.py"),
    ("DeepSpeed --num_gpus", "--num_gpus 4 t.py", f"--nnodes=1 --nproc-per-node=4 {ONE_NODE} --max-restarts=0 t.py"),
    ("DeepSpeed --num_accelerators", "--num_accelerators 3 t.py", f"--nnodes=1 --nproc-per-node=3 {ONE_NODE} --max-restarts=0 t.py"),
    ("torchrun word 'cpu'", "--nproc-per-node cpu t.py", f"--nnodes=1 --nproc-per-node=cpu {ONE_NODE} --max-restarts=0 t.py"),
    ("an explicit port on one node: static rendezvous there", "--master-port 29700 t.py",
     "--nnodes=1 --nproc-per-node=1 --node-rank=0 --master-addr=127.0.0.1 --master-port=29700 --local-addr=127.0.0.1 --max-restarts=0 t.py"),
    ("several nodes, DeepSpeed spellings", "--num_nodes 2 --num_gpus 4 --master_addr n0 --node_rank 1 --master_port 6000 t.py",
     "--nnodes=2 --nproc-per-node=4 --node-rank=1 --master-addr=n0 --master-port=6000 --max-restarts=0 t.py"),
    ("several nodes: default port 29500", "--nnodes 2 --node-rank 0 --master-addr n0 t.py",
     "--nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=n0 --master-port=29500 --max-restarts=0 t.py"),
    ("restarts on one node", "--max-restarts 1 t.py", f"--nnodes=1 --nproc-per-node=1 {ONE_NODE} --max-restarts=1 t.py"),
    ("restarts on several nodes: c10d", "--nnodes 2 --master-addr n0 --max_restarts 3 --rdzv-id j7 t.py",
     "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=n0:29500 --rdzv-id=j7 --max-restarts=3 t.py"),
    ("elastic MIN:MAX: c10d, no node rank", "--nnodes 1:2 --nproc-per-node 2 --master-addr n0 t.py",
     "--nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=n0:29500 --rdzv-id=shardwise-29500 --max-restarts=0 t.py"),
    ("rendezvous options pass to c10d", "--nnodes 1:2 --master-addr n0 --rdzv-conf last_call_timeout=5 t.py",
     "--nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=n0:29500 --rdzv-id=shardwise-29500 --rdzv-conf=last_call_timeout=5 --max-restarts=0 t.py"),
    ("MIN:MAX with MIN = MAX is not elastic", "--nnodes 2:2 --master-addr n0 t.py",
     "--nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=n0 --master-port=29500 --max-restarts=0 t.py"),
    ("module", "-m pkg.train --lr 1", f"--nnodes=1 --nproc-per-node=1 {ONE_NODE} --max-restarts=0 --module pkg.train --lr 1"),
    ("script flags stay the script's", "t.py --nproc-per-node 9 --deepspeed",
     f"--nnodes=1 --nproc-per-node=1 {ONE_NODE} --max-restarts=0 t.py --nproc-per-node 9 --deepspeed"),
    ("--local-rank-arg: before the user's arguments, as DeepSpeed", "--local-rank-arg t.py --x",
     f"--nnodes=1 --nproc-per-node=1 {ONE_NODE} --max-restarts=0 t.py --local_rank=${{local_rank}} --x"),
]  # fmt: skip


@pytest.mark.parametrize("case, flags, expected", ARGV, ids=[c[0] for c in ARGV])
def test_build_torchrun_argv(case, flags, expected, monkeypatch):
    monkeypatch.setattr(run_mod, "default_nproc", lambda: 1)  # the same table with or without GPUs
    if "--local-addr" not in run_mod._torchrun_flags():
        expected = expected.replace(" --local-addr=127.0.0.1", "")
    assert _argv(*flags.split()) == expected, case


def test_the_torchrun_argv_parses_with_torchrun_itself():
    from torch.distributed import run as torchrun

    argv = build_torchrun_argv(
        _run_args("--nproc-per-node", "2", "--local-rank-arg", "t.py", "--x")
    )
    parsed = torchrun.parse_args(argv)
    assert (parsed.nproc_per_node, parsed.standalone, parsed.training_script) == ("2", True, "t.py")
    assert parsed.training_script_args == ["--local_rank=${local_rank}", "--x"]


@pytest.mark.parametrize(
    "case, flags, named",
    [
        ("several nodes need an address", ["--nnodes", "2", "t.py"], "--master-addr is required"),
        (
            "node rank beyond nnodes",
            ["--nnodes", "2", "--master-addr", "h", "--node-rank", "2", "t.py"],
            "--node-rank=2",
        ),
        ("nproc not a number", ["--nproc-per-node", "two", "t.py"], "--nproc-per-node='two'"),
        ("nproc zero", ["--nproc-per-node", "0", "t.py"], "--nproc-per-node='0'"),
        ("negative restarts", ["--max-restarts", "-1", "t.py"], "--max-restarts=-1"),
        ("zero timeout", ["--timeout", "0", "t.py"], "--timeout=0 must be > 0 seconds"),
        (
            "rendezvous options without a value",
            ["--max-restarts", "1", "--rdzv-conf", "x", "t.py"],
            "--rdzv-conf='x'",
        ),
        (
            "rendezvous options of a static rendezvous",
            ["--nnodes", "2", "--master-addr", "h", "--rdzv-conf", "a=1", "t.py"],
            "--rdzv-conf=a=1 configures the c10d rendezvous",
        ),
    ],
)
def test_build_torchrun_argv_errors_name_the_flag(case, flags, named):
    with pytest.raises(ValueError) as info:
        args = _run_args(*flags)
        build_torchrun_argv(args)
        launch_env(args, {})
    assert named in str(info.value), f"{case}: {info.value}"


@pytest.mark.parametrize("value", ["2:1", "0:2", "one", "1:x"])
def test_a_bad_node_range_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        _run_args("--nnodes", value, "t.py")
    err = capsys.readouterr().err
    assert f"--nnodes={value}" in err and ("MIN:MAX" in err or "MIN <= MAX" in err), err


@pytest.mark.parametrize(
    "flags, environ, expected",
    [
        (["t.py"], {}, {"OMP_NUM_THREADS": "1"}),
        (["t.py"], {"OMP_NUM_THREADS": "4"}, {}),
        (["--omp-num-threads", "2", "t.py"], {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "2"}),
        (
            ["--max-restarts", "1", "t.py"],
            {},
            {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        ),
        (
            ["--timeout", "90", "--run-dir", "/runs/exp1", "t.py"],
            {"OMP_NUM_THREADS": "1"},
            {"SHARDWISE_TIMEOUT_S": "90", "SHARDWISE_RUN_DIR": "/runs/exp1"},
        ),
    ],
)
def test_launch_env(flags, environ, expected):
    assert launch_env(_run_args(*flags), environ) == expected, (flags, environ)


def test_dry_run_prints_the_command(capsys):
    assert main(["run", "--dry-run", "--nproc-per-node", "2", "t.py", "--x"]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nnodes=1 --nproc-per-node=2 --standalone" in out and out.strip().endswith(
        "t.py --x"
    ), out


def test_a_missing_script_is_named_before_launching(capsys):
    assert main(["run", "--nproc-per-node", "2", "no_such_script.py"]) == 2
    assert "script 'no_such_script.py' not found" in capsys.readouterr().err


# --- DeepSpeed's hostfile and include/exclude -------------------------------------------------


def _cases():
    return json.loads(CASES.read_text()) if CASES.is_file() else {}


@needs_reference
def test_resource_filters_match_deepspeed():
    for case in _cases()["resource_filter"]:
        hosts, inc, exc = case["hosts"], case.get("include", ""), case.get("exclude", "")
        if "expect_error" in case:
            with pytest.raises(ValueError):
                parse_resource_filter(hosts, inc, exc)
                pytest.fail(f"include={inc!r} exclude={exc!r} must fail: {case['expect_error']}")
        else:
            got = parse_resource_filter(hosts, inc, exc)
            assert got == case["expect"], f"include={inc!r} exclude={exc!r}"


@needs_reference
def test_hostfiles_match_deepspeed():
    good = _cases()["hostfile_good"]
    assert parse_hostfile(good["text"]) == good["expect"]
    for bad in _cases()["hostfile_bad"]:
        message = bad["expect_error"].removeprefix("ValueError: ")
        with pytest.raises(ValueError, match=message):
            parse_hostfile(bad["text"])


@needs_reference
@pytest.mark.parametrize("line", _cases().get("cli_mutual_exclusion_errors", []))
def test_counts_and_filters_are_mutually_exclusive(line, capsys):
    assert main(["run", *line.split()]) == 2, line
    assert "cannot be combined with --include/--exclude" in capsys.readouterr().err, line


def test_hostfile_places_this_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    args = resolve_hosts(
        _run_args("-H", str(hostfile), "-i", "worker-0:0,1@worker-1:2,3", "t.py"),
        hostname="worker-1",
    )
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr) == (
        2,
        1,
        "2",
        "worker-0",
    )
    assert args.visible_devices == "2,3", "slots 2,3 of worker-1 become its visible devices"
    first = resolve_hosts(
        _run_args("-H", str(hostfile), "--num_nodes", "1", "--num_gpus", "2", "t.py"),
        hostname="worker-0",
    )
    assert (first.nnodes, first.node_rank, first.nproc_per_node, first.master_addr) == (
        1,
        0,
        "2",
        None,
    ), "first host, 2 slots"
    with pytest.raises(ValueError, match="not among the hosts"):
        resolve_hosts(_run_args("-H", str(hostfile), "t.py"), hostname="elsewhere")
    with pytest.raises(ValueError, match="--hostfile"):
        resolve_hosts(_run_args("-H", str(tmp_path / "missing"), "t.py"))


# --- shardwise topo ---------------------------------------------------------------------------

TOPO_2x4 = """\
Topology: data 2 x pipeline 2 x tensor 2 = 8 processes
rank   host  local_rank  pp  dp  tp
   0  node0           0   0   0   0
   1  node0           1   0   0   1
   2  node0           2   0   1   0
   3  node0           3   0   1   1
   4  node1           0   1   0   0
   5  node1           1   1   0   1
   6  node1           2   1   1   0
   7  node1           3   1   1   1

data groups (dp=2, 4 groups): [0, 2] [1, 3] [4, 6] [5, 7]
pipeline groups (pp=2, 4 groups): [0, 4] [1, 5] [2, 6] [3, 7]
tensor groups (tp=2, 4 groups): [0, 1] [2, 3] [4, 5] [6, 7]
"""


def test_topo_prints_the_rank_table_and_groups(capsys):
    assert (
        main(
            [
                "topo",
                "--dp",
                "2",
                "--pp",
                "2",
                "--tp",
                "2",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "4",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == TOPO_2x4


@pytest.mark.parametrize(
    "flags, first_line",
    [
        (
            ["--pp", "2", "--world-size", "8"],
            "Topology: data 4 x pipeline 2 x tensor 1 = 8 processes",
        ),
        (["--tp", "4"], "Topology: data 1 x pipeline 1 x tensor 4 = 4 processes"),
        (["--subgroup", "even", "--world-size", "8"], "Subgroup of 4 of 8 processes: [0, 2, 4, 6]"),
        (["--subgroup", "odd", "--world-size", "4"], "Subgroup of 2 of 4 processes: [1, 3]"),
        (["--subgroup", "6,0,2", "--world-size", "8"], "Subgroup of 3 of 8 processes: [0, 2, 6]"),
    ],
)
def test_topo_variants(flags, first_line, capsys):
    assert main(["topo", *flags]) == 0, flags
    assert capsys.readouterr().out.splitlines()[0] == first_line, flags


def test_topo_subgroup_table(capsys):
    main(["topo", "--subgroup", "even", "--world-size", "4", "--nproc-per-node", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [
        ["0", "node0", "0", "yes", "0"],
        ["1", "node0", "1", "no", "-"],
        ["2", "node1", "0", "yes", "1"],
        ["3", "node1", "1", "no", "-"],
    ]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--dp", "3", "--pp", "2", "--world-size", "8"], "data 3 x pipeline 2 x tensor 1 = 6"),
        (["--pp", "3", "--world-size", "8"], "not divisible by pipeline 3"),
        (["--world-size", "8", "--nnodes", "2", "--nproc-per-node", "2"], "--world-size=8"),
        (["--nnodes", "2"], "--nnodes needs --nproc-per-node"),
        (["--subgroup", "0,9", "--world-size", "8"], "[9] are outside"),
        (["--subgroup", "evens", "--world-size", "8"], "--subgroup='evens'"),
    ],
)
def test_topo_errors(flags, named, capsys):
    assert main(["topo", *flags]) == 2, flags
    assert named in capsys.readouterr().err, flags


# --- real launches ------------------------------------------------------------------------------


def _shardwise_cmd():
    script = Path(sys.executable).parent / "shardwise"  # the console script, as a user types it
    return [str(script)] if script.is_file() else [sys.executable, "-m", "shardwise"]


def _launch(*flags, timeout=scaled(180)):
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.pop("OMP_NUM_THREADS", None)  # shardwise run sets it
    return subprocess.run(
        [*_shardwise_cmd(), "run", *flags], env=env, capture_output=True, text=True, timeout=timeout
    )


def _hello_lines(stdout):
    return sorted(line for line in stdout.splitlines() if line.startswith("hello "))


def test_run_two_processes_all_reduce():
    out = _launch("--nproc-per-node", "2", HELLO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _hello_lines(out.stdout) == [
        "hello rank=0 world=2 local_rank=0 launcher=torchrun sum=3 restart=0 local_rank_arg=None omp=1",
        "hello rank=1 world=2 local_rank=1 launcher=torchrun sum=3 restart=0 local_rank_arg=None omp=1",
    ], out.stdout


def test_run_restarts_a_failed_worker_group(tmp_path):
    marker = tmp_path / "failed-once"
    out = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--local-rank-arg",
        HELLO,
        "--fail-once",
        str(marker),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failing on purpose rank=0 restart=0" in out.stdout, "the first attempt fails"
    assert "worker group restarted: attempt 1 of 1" in out.stderr, f"silent: {out.stderr[-2000:]}"
    assert _hello_lines(out.stdout) == [
        "hello rank=0 world=2 local_rank=0 launcher=torchrun sum=3 restart=1 local_rank_arg=0 omp=1",
        "hello rank=1 world=2 local_rank=1 launcher=torchrun sum=3 restart=1 local_rank_arg=1 omp=1",
    ], out.stdout


def test_run_without_restarts_reports_the_failure(tmp_path):
    out = _launch("--nproc-per-node", "1", HELLO, "--fail-once", str(tmp_path / "marker"))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "shardwise run: workers failed" in out.stderr and "exitcode" in out.stderr, out.stderr[
        -3000:
    ]


def test_console_script_is_installed():
    assert shutil.which("shardwise", path=str(Path(sys.executable).parent)), (
        "pip install -e . creates it"
    )


@pytest.mark.parametrize(
    "text, want",
    [("0,1", [0, 1]), ("0-3", [0, 1, 2, 3]), ("4,0-1", [4, 0, 1]), (" 2 , 5-6", [2, 5, 6])],
)
def test_bind_core_list_reads_deepspeeds_syntax(text, want):
    from shardwise.launch.bound import parse_core_list

    assert parse_core_list(text) == want, text


@pytest.mark.parametrize("text", ["", "a", "3-1", "0,0", "1-"])
def test_a_bad_bind_core_list_is_refused_naming_it(text):
    from shardwise.launch.bound import parse_core_list

    with pytest.raises(ValueError, match="--bind_core_list"):
        parse_core_list(text)


def test_cores_are_shared_out_in_equal_consecutive_parts():
    from shardwise.launch.bound import split_cores

    assert split_cores(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cores([0, 1, 2], 2) == [[0], [1]], "DeepSpeed leaves the remainder unused"
    with pytest.raises(ValueError, match="1 cores for 2 processes"):
        split_cores([0], 2)


AFFINITY = """
import os, sys
import shardwise
shardwise.init_distributed()
cores = sorted(os.sched_getaffinity(0))
print(f"rank {os.environ['LOCAL_RANK']} cores {cores} omp {os.environ['OMP_NUM_THREADS']} "
      f"args {sys.argv[1:]} main {__name__ == '__main__'}", flush=True)
"""


def test_bind_cores_to_rank_pins_each_rank_to_its_share(tmp_path):
    """DeepSpeed's exact flags (CIFAR and HelloDeepSpeed run scripts use them) are accepted, and
    each rank runs on its own core with OMP_NUM_THREADS equal to its share."""
    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY)
    flags = ["--nproc-per-node", "2", "--bind_cores_to_rank", "--bind_core_list", "0,1"]
    cmd = [sys.executable, "-m", "shardwise", "run", *flags, "--no_local_rank"]
    out = subprocess.run(
        [*cmd, str(script), "--x", "1"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        line = f"rank {rank} cores [{rank}] omp 1 args ['--x', '1'] main True"
        assert line in out.stdout, out.stdout
