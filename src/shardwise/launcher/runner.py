"""``deepspeed.launcher.runner``: the one name Accelerate imports from it (``accelerate launch``
with DeepSpeed). It names the file of extra environment variables DeepSpeed's multi-node
launcher exports to every node; ``shardwise run`` does not read it (docs/hf-trainer.md)."""

import os

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
