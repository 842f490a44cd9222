"""Read a foreign ``.pt`` file without running anything it says: ``torch.load(weights_only=True)``
with an allow-list.

A ``.pt`` file is a pickle: loading it with ``weights_only=False`` (what DeepSpeed's own loader
does) calls whatever functions and classes the file names, so a checkpoint from an untrusted
source can run code. torch's ``weights_only`` unpickler builds only tensors, containers and
numbers, and refuses any other global *before* calling it. DeepSpeed 0.14-0.19 files hold a few
classes of their own besides (found by writing real checkpoints: ZeRO 0-3, fp32 and bf16, one and
two ranks); each is mapped here to an inert stand-in of this module, which only stores the
values the file gives it:

    deepspeed.runtime.fp16.loss_scaler.LossScaler           ScalerState (cur_scale, dynamic)
    deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler    ScalerState (cur_scale, cur_iter, ...)
    deepspeed.utils.tensor_fragment.fragment_address        FragmentAddress (numel, start)
    deepspeed.runtime.zero.config.ZeroStageEnum             zero_stage(value) -> int
    deepspeed.runtime.zero.offload_config.OffloadDeviceEnum offload_device(value) -> str

Any other class or function named by the file is refused with a ``CheckpointError`` naming it;
torch raises before the global is looked up, so nothing of it runs.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any

import torch

from shardwise.checkpoint.manifest import CheckpointError


class ScalerState:
    """The attributes of a pickled DeepSpeed loss scaler (static or dynamic), nothing else."""

    def __getattr__(self, name: str) -> Any:  # an attribute the file did not set
        raise AttributeError(f"the saved loss scaler has no {name!r}")


class FragmentAddress:
    """DeepSpeed's ``fragment_address``: ``numel`` elements from ``start`` of a flat partition."""

    numel: int
    start: int


def zero_stage(value: int) -> int:
    """``ZeroStageEnum(value)`` as the plain stage number."""
    return int(value)


def offload_device(value: str) -> str:
    """``OffloadDeviceEnum(value)`` as its plain string ("cpu", "nvme", "none")."""
    return str(value)


ALLOWED: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": ScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": ScalerState,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.zero.config.ZeroStageEnum": zero_stage,
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum": offload_device,
}
# One stand-in may serve two names (both scalers): torch keys its allow-list by object, so
# each name gets its own subclass.
_STAND_INS = [
    (type(name.rsplit(".", 1)[1], (obj,), {}) if isinstance(obj, type) else obj, name)
    for name, obj in ALLOWED.items()
]
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|global ([\w.]+)|unrecognized function ([^ ]+)")


def load_pt(path: str) -> Any:
    """The object saved in ``path``, built by torch's weights-only unpickler (module docstring);
    tensors memory-mapped where the file allows it, so only the bytes read are read."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    mmap = zipfile.is_zipfile(path)  # the legacy (non-zip) format cannot be memory-mapped
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_refusal(path, str(e))) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _refusal(path: str, message: str) -> str:
    """The refusal naming the global torch stopped at (its message, when it names none)."""
    found = _GLOBAL.search(message)
    name = next((g for g in found.groups() if g), None) if found else None
    what = f"a pickled {name!r}" if name else f"something torch refused ({message.splitlines()[0]})"
    return (
        f"{path}: refused: the file holds {what}, which is not on the allow-list of the "
        f"DeepSpeed classes shardwise maps ({', '.join(sorted(ALLOWED))}); nothing of the file "
        "was run (a file from an untrusted source can run code when unpickled)"
    )


def stand_in_name(obj: object) -> str | None:
    """The DeepSpeed name a loaded stand-in object replaced (None for anything else)."""
    for name, stand in ALLOWED.items():
        if isinstance(stand, type) and isinstance(obj, stand):
            return name
    return None
