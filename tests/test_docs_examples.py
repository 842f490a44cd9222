"""The examples of docs/ run, and print what the pages say they print.

Each example runs as a reader runs it, ``python docs/examples/NAME.py`` in a subprocess, once per
session: groups.py and collectives.py start 4 processes with ``shardwise.spawn``, memory.py 2,
quickstart.py is one process (each about 10 s on 2 idle cores: the time goes into importing
torch in every process). Then, over README.md and docs/*.md:

- a fenced block whose first line is ``$ python docs/examples/...`` must show that command's
  real output (a line ``...`` in the block skips any number of lines);
- so must a block right after ``<!-- output of: python docs/examples/... -->``;
- a block ``$ shardwise topo ...`` must equal what ``shardwise topo`` prints (pure, no process);
- every relative link must name a file that exists.

And a few facts are checked on the outputs themselves, so that a page and a broken example
cannot agree by being pasted together.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.launch.cli import make_parser, topo_command

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT = 300  # seconds per example: generous, for a loaded 2-core CI machine
# A launcher's variables would make an example believe it is one rank of a bigger job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
LAUNCHER_VARS += ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")

FENCE = re.compile(r"(?:<!-- output of: (?P<cmd>[^>]*?) -->\n)?```[^\n]*\n(?P<body>.*?)```", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)]*)?\)")


@functools.cache
def run_example(command: str) -> str:
    """stdout of ``python docs/examples/...`` run from the repository root."""
    argv = shlex.split(command)
    assert argv[0] == "python" and argv[1].startswith("docs/examples/"), command
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert proc.returncode == 0, f"`{command}` failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _segments(body: str) -> list[tuple[str, str]]:
    """A block of ``$ command`` lines, each followed by its output: [(command, output)]."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return [(cmd, "\n".join(lines)) for cmd, lines in out]


def checked_blocks() -> list[tuple[str, str, str]]:
    """(where, command, expected output) of every block the pages show as real output."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("body"))
            where = f"{page.relative_to(REPO)}:{line}"
            if m["cmd"]:
                found.append((where, m["cmd"], m["body"].rstrip("\n")))
                continue
            for cmd, output in _segments(m["body"]):
                if cmd.startswith(("python docs/examples/", "shardwise topo")):
                    found.append((where, cmd, output))
    return found


BLOCKS = checked_blocks()


def test_the_pages_show_checked_output():
    commands = {cmd.split()[1] for _, cmd, _ in BLOCKS}
    for name in ("topo", "docs/examples/groups.py", "docs/examples/collectives.py"):
        assert name in commands, f"no checked block runs {name}: did the page markers change?"
    assert "docs/examples/memory.py" in commands


def _assert_shows(expected: str, actual: str, tag: str) -> None:
    """Every chunk of ``expected`` (split at '...' lines) appears in ``actual``, in order."""
    pos = 0
    for chunk in re.split(r"^\.\.\.$", expected, flags=re.M):
        chunk = chunk.strip("\n")
        found = actual.find(chunk, pos)
        assert found >= 0, f"{tag}: the page shows\n{chunk}\n\nbut the command printed\n{actual}"
        pos = found + len(chunk)


@pytest.mark.parametrize("where,command,expected", BLOCKS, ids=[f"{w} {c}" for w, c, _ in BLOCKS])
def test_block_shows_the_real_output(where, command, expected):
    if command.startswith("shardwise topo"):
        actual = topo_command(make_parser().parse_args(shlex.split(command)[1:]))
        assert actual == expected.rstrip("\n"), f"{where}: `{command}` prints\n{actual}"
    else:
        _assert_shows(expected, run_example(command), f"{where}: `{command}`")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_name_existing_files(page):
    for m in LINK.finditer(page.read_text()):
        target = m["target"]
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: broken link {target}"


def test_collectives_example_matches_the_ring_model():
    out = run_example("python docs/examples/collectives.py")
    assert "(differs" not in out, out  # every count equals comm.py's ring model
    sums = re.findall(r"^\s+\d\s+\[\d+ \d+\]\s+\[100 104\]$", out, flags=re.M)
    assert len(sums) == 4 + 1, out  # all_reduce on all 4 ranks, reduce on the root


def test_memory_example_meets_the_zero_formulas():
    out = run_example("python docs/examples/memory.py")
    pairs = re.findall(r"([\d,]+) / ([\d,]+)", out)
    assert len(pairs) == 3 * 4, out  # stages 0-2 x (params, grads, optimizer, total)
    for measured, formula in pairs:
        assert measured == formula, out


def test_quickstart_trains_on_one_process():
    out = run_example("python docs/examples/quickstart.py")
    assert "1 process(es): micro-batch 32 x 2 accumulation steps x 1 ranks" in out, out
    last = re.search(r"train_batch: loss ([\d.]+) after 84 optimizer steps", out)
    assert last, out
    # y = sum of 8 standard normals has variance 8: the loss must have fallen by > 100x.
    assert float(last[1]) < 0.05, out
