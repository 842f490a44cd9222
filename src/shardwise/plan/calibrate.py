"""``shardwise plan --calibrate``: measure this machine (compute, collectives) as a preset."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def measure(procs: list[int]) -> dict[str, Any]:
    raise NotImplementedError("--calibrate is not available yet")


def save(data: dict[str, Any], path: str | None) -> Path:
    raise NotImplementedError
