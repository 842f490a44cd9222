"""DeepSpeed's ``deepspeed.accelerator``: ``get_accelerator()`` and the device calls scripts make
(the devices themselves: ``shardwise.devices``).

from shardwise.accelerator import get_accelerator      # deepspeed.accelerator
torch.cuda.set_device(...)  ->  get_accelerator().set_device(local_rank)
"""

from shardwise.accelerator.real_accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
