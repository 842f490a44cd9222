"""A Hugging Face decoder as a pipeline: ``causal_lm_pipeline(model, num_stages)``.

Two families of ``*ForCausalLM`` structure are understood (integrations/hf_layers.py has one
adapter for each): Llama-style (Llama, Mistral, Qwen2, ...) and GPT-2 style
(``GPT2LMHeadModel``). The model becomes a ``PipelineModule`` whose layers are its own modules,
in order:

    Llama-style: input_ids (B, T) -> embed_tokens -> layers[i] -> norm -> lm_head -> logits
    GPT-2:       input_ids (B, T) -> wte -> (+ wpe positions) -> drop -> h[i] -> ln_f -> lm_head

Each decoder layer is called as the model calls it, with what the model computes once for the
whole stack and no stage boundary can carry, recomputed on each stage: positions 0..T-1, the
rotary cos/sin (Llama-style) and the causal mask, made by transformers' own mask functions for
the attention the model uses (no KV cache: training). The loss is Hugging Face's causal-LM loss
(labels shifted by one inside, ``-100`` ignored, the mean over labelled tokens), the value of
``model(input_ids, labels=labels).loss``. Every layer keeps its name (``layer_names``), so
checkpoints, ``consolidated_state_dict()`` and tensor-parallel plans use the model's own keys:
the result loads back with ``model.load_state_dict`` / ``from_pretrained``.

Batches for ``engine.train_batch``: ``(input_ids, labels)`` pairs.

Tied input and output embeddings (``tie_word_embeddings``: ``lm_head.weight`` is the input
embedding's weight; always so for GPT-2) are DeepSpeed's ``TiedLayerSpec``: the first and the
last layer share the key ``"embed"``, the first runs the embedding, the last
``hidden @ weight.T`` (what the bias-free ``lm_head`` computes). Each stage holding the key
keeps a copy of the weight; their gradients are summed over those stages before the update
(pipeline/tied.py), so the copies stay equal to the one weight of one process. The copy sits
under the embedding's name on the first stage (``model.embed_tokens``, ``transformer.wte``) and
``lm_head`` on the last, so the gathered state dict has both Hugging Face names, as
``model.state_dict()`` does; with one stage it is one weight under both names.

Masked LMs (BERT) are refused: see ``_refuse_masked_lm`` and docs/huggingface.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.integrations.hf_layers import ADAPTERS, Layers
from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.parallel.pipeline.specs import TiedLayerSpec

__all__ = ["causal_lm_loss", "causal_lm_pipeline"]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts label t+1; -100 is ignored."""
    shifted = labels[..., 1:].contiguous()
    return F.cross_entropy(
        logits[..., :-1, :].float().reshape(-1, logits.size(-1)),
        shifted.reshape(-1),
        ignore_index=-100,
    )


def causal_lm_pipeline(
    model: nn.Module,
    num_stages: int,
    *,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
    **pipeline_kwargs: Any,
) -> PipelineModule:
    """``model`` cut into ``num_stages`` stages (see the module doc); its modules are reused,
    not copied, so the pipeline starts from exactly its weights."""
    layers = _layers_of(model)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # training: a KV cache would only grow
    (_, embed), *middle, (_, head) = layers
    if _tied(embed, head):
        embed, head = _OwnTiedModule(embed), _OwnTiedModule(embed, forward_fn=_tied_head)
    pipe = PipelineModule(
        [embed, *[module for _, module in middle], head],
        num_stages=num_stages,
        loss_fn=causal_lm_loss,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        layer_names=[name for name, _ in layers],
        **pipeline_kwargs,
    )
    # save_16bit_model writes it as config.json, so from_pretrained loads the saved weights.
    # Not ``pipe.config``: tensor parallelism would read the model's plan off it, whose
    # patterns are relative to a model the pipeline is not.
    pipe.hf_config = model.config
    return pipe


def _layers_of(model: nn.Module) -> Layers:
    """The model's layers from the first adapter that knows its structure."""
    _refuse_masked_lm(model)
    for adapter, _ in ADAPTERS.values():
        layers = adapter(model)
        if layers is not None:
            return layers
    needs = "; ".join(f"{family}: {needed}" for family, (_, needed) in ADAPTERS.items())
    raise ValueError(
        f"causal_lm_pipeline: {type(model).__name__} is neither a Llama-style nor a GPT-2 "
        f"style causal LM (it needs the modules of one: {needs}); build its PipelineModule "
        "from a layer list by hand (docs/pipeline.md)"
    )


def _refuse_masked_lm(model: nn.Module) -> None:
    """A masked LM (BERT) is no causal LM, and its head does not fit TiedLayerSpec (why: the
    error below and docs/huggingface.md)."""
    if "MaskedLM" not in type(model).__name__:
        return
    raise ValueError(
        f"causal_lm_pipeline: {type(model).__name__} is a masked LM, not a causal LM, and "
        "shardwise has no pipeline builder for it: its MLM head is tied twice, the decoder's "
        "weight to the word embeddings and the decoder's bias to a parameter of the head's "
        "parent module (cls.predictions.bias), which a TiedLayerSpec (one shared module per "
        "key, under each layer's name) cannot hold under the model's names; and its padding "
        "attention mask would have to travel with the hidden states between stages. Train it "
        "with data parallelism or ZeRO (every layout of docs/huggingface.md), or build its "
        "PipelineModule by hand (docs/pipeline.md)"
    )


class _OwnTiedModule(TiedLayerSpec):
    """A ``TiedLayerSpec`` (key ``"embed"``, tied ``weight``) whose module is the model's own
    embedding rather than a new one: the pipeline starts from the model's weights."""

    def __init__(self, module: nn.Module, forward_fn: Any = None) -> None:
        super().__init__("embed", type(module), forward_fn=forward_fn, tied_weight_attr="weight")
        self.module = module

    def build(self) -> nn.Module:
        return self.module


def _tied_head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The tied ``lm_head``: logits (B, T, V) = hidden (B, T, H) @ weight (V, H).T."""
    return F.linear(hidden, embedding.weight)


def _tied(embed: nn.Module, head: nn.Module) -> bool:
    """Does ``head`` reuse the embedding's weight (``tie_word_embeddings``)? Only a bias-free
    linear head can be rebuilt from the embedding's weight alone."""
    if getattr(head, "weight", None) is not getattr(embed, "weight", False):
        return False
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"causal_lm_pipeline: lm_head ({type(head).__name__}) is tied to the input "
            "embedding but is not a bias-free nn.Linear, so the last stage cannot compute it "
            "from the tied weight; build the PipelineModule by hand (docs/pipeline.md)"
        )
    return True
