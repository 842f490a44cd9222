"""``deepspeed.runtime.pipe``: the pipeline names (``shardwise.pipe``)."""

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.runtime.pipe import module, topology
from shardwise.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "module",
    "topology",
]
