"""Launching: environment detection (torchrun, Slurm, one process) and the ``shardwise`` CLI.

Kept empty of imports so that ``import shardwise.launch.slurm`` stays cheap.
"""
