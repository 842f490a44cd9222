"""Hangs and mismatched collectives, explained (docs/reliability.md, "Hangs").

``recorder``     the flight recorder: every collective and p2p call of this process
``calls``        what it records (``Call``, ``GroupInfo``) and what its readers ask of it
``watchdog``     the thread that notices a hang and makes every rank write its record
``dump``         one rank's record (``<run dir>/diagnose/rank<N>.json``)
``report``       the merged report: who never entered which call, where each rank waits
``fingerprint``  the debug check that compares each collective across its group first
``cli``          ``shardwise diagnose RUN_DIR``
"""

from shardwise.diagnose.calls import Call, GroupInfo
from shardwise.diagnose.fingerprint import CollectiveMismatchError
from shardwise.diagnose.recorder import FlightRecorder

__all__ = ["Call", "CollectiveMismatchError", "FlightRecorder", "GroupInfo"]
