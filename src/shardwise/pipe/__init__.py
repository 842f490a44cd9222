"""``shardwise.pipe``: DeepSpeed's ``deepspeed.pipe`` names, so pipeline scripts port by the import.

from shardwise.pipe import PipelineModule, LayerSpec, TiedLayerSpec
"""

from shardwise.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
