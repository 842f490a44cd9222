"""The device a process computes on (DeepSpeed calls it the accelerator).

    accelerators.py   ``CudaAccelerator`` / ``CpuAccelerator``: device names, memory queries,
                      seeds and streams, with DeepSpeed's method names and return values
    current.py        this process's one accelerator (``get_accelerator``, ``set_accelerator``)
    memory_report.py  ``see_memory_usage``: DeepSpeed's printed memory report

``shardwise.accelerator`` and ``shardwise.runtime.utils`` give them DeepSpeed's import paths.
"""
