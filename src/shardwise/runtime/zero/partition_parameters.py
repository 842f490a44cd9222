"""``deepspeed.runtime.zero.partition_parameters``: what ZeRO-3 users import from it, and the
two names transformers reads around ``zero.Init`` (``prevent_arange_dtype_change``)."""

import torch

from shardwise.parallel.zero.partition import zero_wrapper_for_fp_tensor_constructor
from shardwise.zero import GatheredParameters, Init

# DeepSpeed keeps the constructors it wraps under zero.Init; transformers compares with this one.
_orig_torch_arange = torch.arange

__all__ = [
    "GatheredParameters",
    "Init",
    "_orig_torch_arange",
    "zero_wrapper_for_fp_tensor_constructor",
]
