"""Activation checkpointing: the recompute mechanism behind DeepSpeed's ``checkpointing`` API
(recompute.py; ``shardwise.checkpointing`` re-exports it) and the engine's
``activation_checkpointing.checkpoint_layers`` rewrite of chosen blocks (selective.py)."""
