"""The accelerator of this process, chosen as the communication backend is.

``DS_ACCELERATOR`` ("cuda" or "cpu", DeepSpeed's variable) decides when set; otherwise CUDA
when torch sees a GPU, else the CPU, the same rule that picks NCCL or gloo
(``shardwise.launch.env``). The choice is made once per process, on the first call, as in
DeepSpeed, so every later call returns the same object.
"""

from __future__ import annotations

import os

import torch

from shardwise.devices.accelerators import Accelerator, CpuAccelerator, CudaAccelerator

_CHOICE: list[Accelerator] = []  # the process's one accelerator (DeepSpeed keeps a global too)
_KINDS = {"cuda": CudaAccelerator, "cpu": CpuAccelerator}


def get_accelerator() -> Accelerator:
    """This process's accelerator (see the module doc)."""
    if not _CHOICE:
        name = os.environ.get("DS_ACCELERATOR", "").lower()
        if name and name not in _KINDS:
            raise ValueError(f"DS_ACCELERATOR={name!r}: shardwise knows {sorted(_KINDS)}")
        if not name:
            name = "cuda" if torch.cuda.is_available() else "cpu"
        _CHOICE.append(_KINDS[name]())
    return _CHOICE[0]


def set_accelerator(accelerator: Accelerator) -> None:
    """Use ``accelerator`` from now on (DeepSpeed's ``set_accelerator``, which also refuses
    an object that is not an accelerator)."""
    if not isinstance(accelerator, Accelerator):
        raise ValueError(
            f"set_accelerator({type(accelerator).__name__}): pass an accelerator, such as "
            "get_accelerator() or a subclass of shardwise.devices.accelerators.Accelerator"
        )
    _CHOICE[:] = [accelerator]
