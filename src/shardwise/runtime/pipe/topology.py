"""``deepspeed.runtime.pipe.topology`` (``shardwise.parallel.pipeline.process_topology``)."""

from shardwise.parallel.pipeline.process_topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
