"""What the flight recorder records, and what its readers may ask of it.

``GroupInfo`` and ``Call`` are the records (recorder.py's docstring says what a call holds);
``CallLog`` is the part of the recorder the watchdog and the rank record (``dump.py``) read.
They live here, below the recorder, so that the modules the recorder uses (``fingerprint``,
``watchdog``, ``dump``) name them without importing the recorder back.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Protocol

import torch


@dataclasses.dataclass(eq=False, slots=True)
class GroupInfo:
    """A group as errors and reports name it; ``entered`` / ``completed`` count this rank's
    calls on it (the last sequence number entered, and the highest completed)."""

    name: str
    ranks: tuple[int, ...]
    timeout: float
    entered: int = 0
    completed: int = 0

    def describe(self) -> str:
        return f"group '{self.name}' (ranks {list(self.ranks)})"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False, slots=True)
class Call:
    """One recorded call; ``end`` is None while it is in flight."""

    seq: int
    op: str
    group: GroupInfo
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    site: tuple[str, int, str]
    thread: int
    start: float
    end: float | None = None
    work: Any = None  # an async call's handle, until it completes
    error: str | None = None

    def describe(self) -> str:
        return f"{self.op} #{self.seq} on {self.group.describe()}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group.name,
            "ranks": list(self.group.ranks),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
            "bytes": self.nbytes,
            "start": self.start,
            "end": self.end,
            "site": list(self.site),
            "thread": self.thread,
            "error": self.error,
        }


class CallLog(Protocol):
    """What the watchdog and ``dump.record`` read from a recorder (``FlightRecorder`` is one)."""

    sites: collections.Counter  # (group, op, site) -> calls

    def recent(self) -> list[Call]:
        """The ring of recent calls, oldest first."""

    def in_flight(self) -> list[Call]:
        """The calls entered and not yet completed."""

    def groups(self) -> list[GroupInfo]:
        """Every group (and p2p channel) with a call entered."""

    def end(self, call: Call | None, error: str | None = None) -> None:
        """Close ``call`` (``error``: it failed)."""
