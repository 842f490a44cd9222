"""``shardwise plan --simulate RANK``: the real setup of one rank of a large world, in one process."""

from __future__ import annotations

import argparse
from typing import Any


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    raise NotImplementedError("--simulate is not available yet")
