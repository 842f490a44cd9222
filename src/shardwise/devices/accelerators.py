"""The devices a process computes on, ``CudaAccelerator`` and ``CpuAccelerator``, with
DeepSpeed's method names and return values (``shardwise.accelerator`` gives them DeepSpeed's
import path).

Names and results follow DeepSpeed's ``abstract_accelerator.py`` / ``cuda_accelerator.py`` /
``cpu_accelerator.py`` for the calls training scripts make: ``device_name(i)`` is "cuda:i" or
"cuda" (CPU: always "cpu"), ``communication_backend_name()`` "nccl" or "gloo", memory queries in
bytes (on the CPU, this process's resident memory, as DeepSpeed's CPU accelerator reports).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from typing import Any

import torch


class Accelerator:
    """What both devices share; subclasses set ``_name`` and ``_backend``."""

    _name = ""
    _backend = ""

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        return self._backend

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def random(self) -> Any:
        return torch.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if tensor.device.type == "cpu" else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        """Profiler ranges (NVTX on CUDA): nothing to mark on the CPU."""

    def range_pop(self) -> None:
        """See range_push."""

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def empty_cache(self) -> None:
        """Nothing cached on the CPU."""

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def amp(self) -> Any:
        return torch.amp


class CpuAccelerator(Accelerator):
    """Processes on CPU cores, talking over gloo."""

    _name = "cpu"
    _backend = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed's CPU accelerator names no index

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        """One CPU device: nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        with open("/proc/self/statm") as f:  # resident pages
            return int(f.read().split()[1]) * resource.getpagesize()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The peak resident memory since the start or the last reset (VmHWM, in KiB)."""
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak from the current resident memory, as DeepSpeed's CPU accelerator
        does: writing 5 to clear_refs resets the kernel's VmHWM (Linux >= 4.0; elsewhere the
        peak stays the process's)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    reset_peak_memory_stats = reset_max_memory_allocated

    def total_memory(self, device_index: int | None = None) -> int:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024

    def available_memory(self, device_index: int | None = None) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return self.total_memory()


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs, talking over NCCL: each call is torch.cuda's."""

    _name = "cuda"
    _backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_allocated

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()
