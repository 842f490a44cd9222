"""DeepSpeed's printed memory report (``see_memory_usage``), read from this process's accelerator
(``shardwise.runtime.utils`` gives it DeepSpeed's import path)."""

from __future__ import annotations

import gc

from shardwise import comm
from shardwise.devices.accelerators import CpuAccelerator
from shardwise.devices.current import get_accelerator


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print DeepSpeed's memory report on rank 0 when ``force`` is true (nothing otherwise):
    ``message``, then ``MA`` (allocated), ``Max_MA`` (its peak), ``CA`` (reserved), ``Max_CA``
    in GiB, then the host's used virtual memory; then restart the peak from now, so that the
    next report's ``Max_MA`` is the peak in between (DeepSpeed resets it too)."""
    if not force or comm.get_rank() != 0:
        return
    gc.collect()  # garbage Python has not freed yet is not memory the script holds
    acc, gib = get_accelerator(), 2**30
    print(message)
    print(
        f"MA {round(acc.memory_allocated() / gib, 2)} GB "
        f"Max_MA {round(acc.max_memory_allocated() / gib, 2)} GB "
        f"CA {round(acc.memory_reserved() / gib, 2)} GB "
        f"Max_CA {round(acc.max_memory_reserved() / gib, 2)} GB"
    )
    host = CpuAccelerator()  # the host's memory, whatever the accelerator
    total, used = host.total_memory(), host.total_memory() - host.available_memory()
    print(
        f"CPU Virtual Memory:  used = {round(used / gib, 2)} GB, percent = {100 * used / total:.1f}%"
    )
    acc.reset_peak_memory_stats()
