"""Optimizers: the one a config names, and the Adam update DeepSpeed's kernels compute.

from_config.py  ``build_optimizer``: a config's ``optimizer`` block -> a torch optimizer
adam.py         ``FusedAdam`` / ``DeepSpeedCPUAdam`` with DeepSpeed's signatures and
                defaults, in plain tensor ops (any device; ``shardwise.ops.adam`` gives
                them DeepSpeed's import path)
"""

from shardwise.optim.from_config import build_optimizer, optimizer_class

__all__ = ["build_optimizer", "optimizer_class"]
