"""The ``comms`` block, shardwise's own (DeepSpeed has none): timeouts and hang diagnosis.

    "comms": {"timeout_s": 600, "flight_recorder": 256, "watchdog": true,
              "fingerprint": false, "run_dir": null}

``timeout_s``: the collective timeout of every process group, in seconds, when ``initialize``
sets up the world (a world already set up keeps its own, with a warning); null: what
``init_distributed`` chooses (``$SHARDWISE_TIMEOUT_S``, ``shardwise run --timeout``, else 30
minutes). ``flight_recorder``: calls each rank keeps in its record (0 turns the recorder and the
watchdog off). ``watchdog``: a hang makes every rank write its record and rank 0 print the
merged report. ``fingerprint``: debug mode, every collective is compared across its group
before it runs (one small all-gather each) and a mismatch raises naming both sides.
``run_dir``: the records go to ``run_dir/diagnose/`` (null: ``$SHARDWISE_RUN_DIR``, else
``./shardwise-diagnose/``). docs/reliability.md, "Hangs", tells the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardwise.config.schema import spec


@dataclass(frozen=True)
class CommsConfig:
    """``"comms"``: the module docstring gives each key."""

    EXAMPLE: ClassVar[str] = '{"timeout_s": 600, "fingerprint": true}'

    timeout_s: float | None = spec(None, gt=0)
    flight_recorder: int = spec(256, ge=0)
    watchdog: bool = True
    fingerprint: bool = False
    run_dir: str | None = None
