"""Checkpoints written by other frameworks, read as shardwise checkpoints (detect.py finds
which): DeepSpeed (deepspeed.py). Each reader offers what ``reshard.plan`` and the engine's load
use (``names``, ``pieces``, ``read``, ``meta``, ``rank_state``), so one all-or-nothing load path
serves every format."""
