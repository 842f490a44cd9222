"""Auxiliary losses of a pipeline's layers: an MoE layer's load-balancing loss on any stage.

In one process a model adds its layers' auxiliary terms to its loss itself (the example GPT:
``loss = ce + moe_aux * sum_b l_aux_b``). In a pipeline the last stage's ``loss_fn`` sees only
the last layer's output, so ``PipelineModule(aux_loss_fn=f)`` names them instead: the loss of
micro-batch i is

    L_i = loss_fn(output_i, labels_i) + sum over the layers l of the model of f(l)

where f(l) is read just after the stage ran l's chunk on micro-batch i (a layer run twice in a
chunk, a tied one, reports its last call) and may be None (no term). Each stage differentiates
its own terms: its backward of micro-batch i starts from its output with the received gradient
*and* from a_i = sum of its f(l), with gradient S / m (m micro-batches, S the fp16 loss scale),
what the last stage gives its loss: dL/d(a_i) = 1, so every parameter gets the one-process
gradient of L = mean_i L_i. The reported loss is mean_i L_i too: each stage adds sum_i a_i / m
and the stages' sums are added over the pipeline group. DeepSpeed reports the same number for
its MoE pipelines (Megatron-DeepSpeed's GPTModelPipe carries sum_l l_aux with the activations
into the last stage's loss_fn, whose mean train_batch returns); we add instead of carrying.

``moe_aux_loss(w)`` is f for DeepSpeed's MoE layers: w times the sum of the ``l_aux`` of every
MoE layer (``MOELayer``) inside l.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.parallel.moe.layer import MOELayer

AuxLossFn = Callable[[nn.Module], Any]


def moe_aux_loss(weight: float) -> AuxLossFn:
    """f(layer) = ``weight`` * sum of the l_aux of the MoE layers inside ``layer`` (None when it
    holds none): DeepSpeed's load-balancing loss with the weight of one's script (0.01 in
    DeepSpeed's examples)."""

    def aux(layer: nn.Module) -> torch.Tensor | None:
        found = [m.l_aux for m in layer.modules() if isinstance(m, MOELayer)]
        found = [t for t in found if t is not None]
        return weight * sum(found) if found else None

    return aux


def chunk_aux_loss(module: nn.Module, chunk: int | None) -> torch.Tensor | None:
    """a = sum of ``module.aux_loss_fn(l)`` over the layers of this stage's ``chunk`` (all of
    the stage's with None), in layer order; None when no layer gives a term."""
    fn = getattr(module, "aux_loss_fn", None)
    if fn is None:
        return None
    total = None
    for _, layer in module.stage_modules(chunk):
        term = fn(layer)
        if term is not None:
            total = term if total is None else total + term
    return total
