"""``deepspeed.launcher``: the DeepSpeed launcher's import path; ``shardwise run`` is the launcher."""
