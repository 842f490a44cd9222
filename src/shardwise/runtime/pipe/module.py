"""``deepspeed.runtime.pipe.module``."""

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
