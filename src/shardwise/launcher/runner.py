"""``deepspeed.launcher.runner``: the one name Accelerate imports from it (``accelerate launch``
with DeepSpeed): the file of extra environment variables DeepSpeed's launcher exports to every
rank, which ``shardwise run`` exports too (launch/deepspeed_env.py, docs/launch.md)."""

import os

from shardwise.launch.deepspeed_env import file_name

DEEPSPEED_ENVIRONMENT_NAME = file_name(os.environ)
