"""``deepspeed.runtime.pipe``: the pipeline names (``shardwise.pipe``)."""

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.runtime.pipe import module

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "module"]
