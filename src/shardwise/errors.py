"""shardwise's exceptions, in one leaf module that imports nothing of shardwise, so that any
module can raise them without an import cycle. Each message says what to do.

    ConfigError      a config key or an argument is wrong (names the key)      config/errors.py
    EngineError      a call the engine cannot honour in its current state
    CheckpointError  a checkpoint is damaged, incomplete or from another model  checkpoint/manifest.py
    TopologyError    sizes that do not fit the world                            topology.py
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """A call the engine cannot honour in its current state; the message says what to do."""
