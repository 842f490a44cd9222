"""Small helpers DeepSpeed scripts import from ``deepspeed.utils`` (each lives where it works:
rank_log.py, seeding.py, repeating.py), and ``groups`` (mesh_groups.py)."""

from shardwise.errors import refuse_missing
from shardwise.rank_log import log_dist, logger
from shardwise.seeding import set_random_seed
from shardwise.training.repeating import RepeatingLoader
from shardwise.utils import groups

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "set_random_seed"]
__getattr__ = refuse_missing(__name__, ("zero_to_fp32",))  # utils/zero_to_fp32.py says why
