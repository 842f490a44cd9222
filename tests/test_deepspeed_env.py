"""DeepSpeed's ``.deepspeed_env`` under ``shardwise run`` (launch/deepspeed_env.py, docs/launch.md):
the NAME=VALUE lines of ``~/.deepspeed_env`` and ``./.deepspeed_env`` (``$DS_ENV_FILE`` renames
them) reach every rank, the current directory's value of a name winning over the home
directory's, as DeepSpeed's launcher/runner.py reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waits import scaled

import shardwise
from shardwise.launch import cli, deepspeed_env

# (case, file text, variables or the words of the error)
PARSE = [
    ("two lines", "A=1\nB=two\n", {"A": "1", "B": "two"}),
    ("white space around name and value", "  A =  x y \n", {"A": "x y"}),
    ("split at the first =", "URL=http://h/?a=b\n", {"URL": "http://h/?a=b"}),
    ("empty value", "EMPTY=\n", {"EMPTY": ""}),
    ("quotes kept as written", 'Q="a b"\n', {"Q": '"a b"'}),
    ("no expansion", "P=$HOME/x\n", {"P": "$HOME/x"}),
    ("blank lines and comments skipped", "\n# NCCL\n  # x=1\nA=1\n\n", {"A": "1"}),
    ("a later line wins", "A=1\nA=2\n", {"A": "2"}),
    ("no =", "A=1\nNCCL_DEBUG\n", "line 2: 'NCCL_DEBUG' is not NAME=VALUE"),
    ("shell export", "export A=1\n", "line 1: 'export A=1' is not NAME=VALUE"),
    ("not a name", "1A=2\n", "line 1: '1A=2' is not NAME=VALUE"),
    ("no name", "=2\n", "line 1: '=2' is not NAME=VALUE"),
]


@pytest.mark.parametrize(("case", "text", "want"), PARSE, ids=[c[0] for c in PARSE])
def test_each_line_is_name_equals_value(case, text, want):
    if isinstance(want, dict):
        assert deepspeed_env.parse(text, "F") == want, case
    else:
        with pytest.raises(ValueError, match="F, " + want) as e:
            deepspeed_env.parse(text, "F")
        assert "without `export`" in str(e.value), case


# (case, home file, current directory's file, DS_ENV_FILE, variables exported)
LOOKUP = [
    ("home only", "A=home\n", None, None, {"A": "home"}),
    ("here only", None, "A=here\n", None, {"A": "here"}),
    ("here wins over home", "A=home\nB=home\n", "A=here\n", None, {"A": "here", "B": "home"}),
    ("neither", None, None, None, {}),
    ("DS_ENV_FILE renames both", "A=home\n", "A=here\n", "my_env", {"A": "here"}),
]


@pytest.mark.parametrize(
    ("case", "home", "here", "name", "want"), LOOKUP, ids=[c[0] for c in LOOKUP]
)
def test_home_then_current_directory(tmp_path, case, home, here, name, want):
    (tmp_path / "home").mkdir()
    (tmp_path / "here").mkdir()
    for where, text in (("home", home), ("here", here)):
        if text is not None:
            (tmp_path / where / (name or ".deepspeed_env")).write_text(text)
    if name:  # the default name beside the renamed file is not read
        (tmp_path / "here" / ".deepspeed_env").write_text("DECOY=1\n")
    environ = {"DS_ENV_FILE": name} if name else {}
    got, files = deepspeed_env.exports(environ, str(tmp_path / "home"), str(tmp_path / "here"))
    assert got == want, case
    assert len(files) == (home is not None) + (here is not None), f"{case}: {files}"


def test_run_in_the_home_directory_reads_its_file_once(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("A=1\n")
    got, files = deepspeed_env.exports({}, str(tmp_path), str(tmp_path))
    assert got == {"A": "1"} and files == [tmp_path / ".deepspeed_env"], files


# (case, .deepspeed_env text, shardwise run flags, what the dry run's command sets)
DRY = [
    ("exported", "NCCL_IB_DISABLE=1\n", [], ["NCCL_IB_DISABLE=1", "OMP_NUM_THREADS=1"]),
    ("the file's OMP_NUM_THREADS over the default", "OMP_NUM_THREADS=3\n", [], ["OMP_NUM_THREADS=3"]),
    ("a flag over the file", "OMP_NUM_THREADS=3\n", ["--omp-num-threads", "2"], ["OMP_NUM_THREADS=2"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "text", "flags", "want"), DRY, ids=[c[0] for c in DRY])
def test_shardwise_run_exports_the_file(tmp_path, monkeypatch, capsys, case, text, flags, want):
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text(text)
    assert cli.main(["run", "--dry-run", *flags, "--nproc-per-node", "2", "train.py"]) == 0
    words = capsys.readouterr().out.split()
    assert words[len(want)] == "torchrun" and words[: len(want)] == want, f"{case}: {words}"


def test_a_bad_line_stops_shardwise_run_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("A=1\nexport B=2\n")
    assert cli.main(["run", "--dry-run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / '.deepspeed_env'}, line 2: 'export B=2' is not NAME=VALUE" in err, err


PRINT_ENV = """
import json, os, sys
names = ["FROM_HOME", "FROM_HERE", "BOTH"]
out = {n: os.environ.get(n) for n in names}
open(f"rank{os.environ['RANK']}.json", "w").write(json.dumps(out))
"""


def test_every_rank_gets_the_variables(tmp_path):
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=h\nBOTH=home\n")
    (here / ".deepspeed_env").write_text("# here\nFROM_HERE=x y\nBOTH=here\n")
    (here / "print_env.py").write_text(PRINT_ENV)
    src = str(Path(shardwise.__file__).parents[1])
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": src}
    env = {k: v for k, v in env.items() if k not in ("FROM_HOME", "FROM_HERE", "BOTH")}
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2", "print_env.py"]
    proc = subprocess.run(
        cmd, cwd=here, env=env, capture_output=True, text=True, timeout=scaled(120)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shardwise run: exporting BOTH, FROM_HERE, FROM_HOME" in proc.stderr, proc.stderr
    want = {"FROM_HOME": "h", "FROM_HERE": "x y", "BOTH": "here"}
    for rank in (0, 1):
        got = json.loads((here / f"rank{rank}.json").read_text())
        assert got == want, f"rank {rank}: {got}"
