"""``shardwise.pipe``: DeepSpeed's ``deepspeed.pipe`` names, so pipeline scripts port by the import.

from shardwise.pipe import PipelineModule, LayerSpec, TiedLayerSpec

and ``moe_aux_loss(weight)``, the ``aux_loss_fn`` that adds MoE load-balancing losses on every
stage (parallel/pipeline/aux_loss.py).
"""

from shardwise.parallel.pipeline.aux_loss import moe_aux_loss
from shardwise.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "moe_aux_loss"]
