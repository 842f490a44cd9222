"""``deepspeed.checkpoint.utils``: the one helper Accelerate calls when it saves a model."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor inside it (nested in dicts, lists, tuples) replaced by a clone
    on ``device``: a view saved by ``torch.save`` would write the whole storage behind it."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
