"""Two tiers of tests: ``make test-fast`` runs those that start no process (under 3 minutes),
``make test`` runs all. tests/tiers.txt lists what starts processes, a test file or one
``file::function`` a line; every test of a listed file, and every listed function, is marked
``procs``. The list cannot go stale unseen: in every run a test outside it that starts a process
(``subprocess``, ``multiprocessing``, torch's spawn, or the harness's worlds, even ones started
earlier) fails, naming the line to add.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import harness
import pytest

LIST = Path(__file__).with_name("tiers.txt")


def listed() -> set[str]:
    lines = (s.split("#", 1)[0].strip() for s in LIST.read_text().splitlines())
    return {s for s in lines if s}


def mark(items: list[pytest.Item]) -> None:
    """Mark ``procs`` what tiers.txt lists."""
    names = listed()
    for item in items:
        file = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        if file in names or f"{file}::{getattr(item, 'originalname', item.name)}" in names:
            item.add_marker(pytest.mark.procs)


@contextmanager
def watch() -> Iterator[list[str]]:
    """The processes started inside the block (what started them), by any of the ways above."""
    started: list[str] = []
    popen, start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen_init(self, args, *a, **kw):  # noqa: ANN001 - subprocess's own signature
        started.append(f"subprocess {str(args)[:80]}")
        popen(self, args, *a, **kw)

    def process_start(self):  # noqa: ANN001
        started.append(f"multiprocessing {self.name}")
        start(self)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start
    runs = len(harness.WORLD_RUNS)
    try:
        yield started
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen, start
        if len(harness.WORLD_RUNS) > runs:
            started.append(f"the harness's world of {harness.WORLD_RUNS[-1]} ranks")


def check(item: pytest.Item, started: list[str]) -> None:
    """Fail a test that started a process without being listed."""
    if started and item.get_closest_marker("procs") is None:
        file = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        pytest.fail(
            f"{item.nodeid} starts a process ({started[0]}) but tests/tiers.txt does not list "
            f"it: add the line '{file}::{getattr(item, 'originalname', item.name)}' (or "
            f"'{file}'), so that make test-fast leaves it out",
            pytrace=False,
        )
