"""A Hugging Face decoder as a pipeline: ``causal_lm_pipeline(model, num_stages)``.

A Llama-style ``*ForCausalLM`` (Llama, Mistral, Qwen2, ...: ``model.embed_tokens``,
``model.layers[i]``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) becomes a
``PipelineModule`` whose layers are its own modules, in order:

    input_ids (B, T) -> embed_tokens -> layers[0] ... layers[L-1] -> norm -> lm_head -> logits

Each decoder layer is called as the model calls it, with what the model computes once for the
whole stack and no stage boundary can carry: the rotary cos/sin of positions 0..T-1 (from the
model's ``rotary_emb``, recomputed on each stage) and the causal mask, built for the attention
the model uses (no KV cache: training). The loss is Hugging Face's causal-LM loss (labels
shifted by one inside, ``-100`` ignored, the mean over labelled tokens), the value of
``model(input_ids, labels=labels).loss``. Every layer keeps its name (``layer_names``), so
checkpoints, ``consolidated_state_dict()`` and tensor-parallel plans use the model's own keys:
the result loads back with ``model.load_state_dict`` / ``from_pretrained``.

Batches for ``engine.train_batch``: ``(input_ids, labels)`` pairs.

Tied input and output embeddings (``tie_word_embeddings``: ``lm_head.weight`` is
``embed_tokens.weight``) are DeepSpeed's ``TiedLayerSpec``: the first and the last layer share
the key ``"embed"``, the first runs the embedding, the last ``hidden @ weight.T`` (what the
bias-free ``lm_head`` computes). Each stage holding the key keeps a copy of the weight; their
gradients are summed over those stages before the update (pipeline/tied.py), so the copies
stay equal to the one weight of one process. The copy sits under ``model.embed_tokens`` on the
first stage and ``lm_head`` on the last, so the gathered state dict has both Hugging Face
names, as ``model.state_dict()`` does; with one stage it is one weight under both names.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.parallel.pipeline.specs import TiedLayerSpec

__all__ = ["causal_lm_loss", "causal_lm_pipeline"]

_INNER = "_shardwise_hf_layer_forward"


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
    base = _base_of(model)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # training: a KV cache would only grow
    prefix = model.base_model_prefix
    for layer in base.layers:
        _call_as_the_model_does(layer, base.rotary_emb)
    embed, head = base.embed_tokens, model.lm_head
    if _tied(embed, head):
        embed, head = _OwnTiedModule(embed), _OwnTiedModule(embed, forward_fn=_tied_head)
    names = [f"{prefix}.embed_tokens"]
    names += [f"{prefix}.layers.{i}" for i in range(len(base.layers))]
    names += [f"{prefix}.norm", "lm_head"]
    pipe = PipelineModule(
        [embed, *base.layers, base.norm, head],
        num_stages=num_stages,
        loss_fn=causal_lm_loss,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        layer_names=names,
        **pipeline_kwargs,
    )
    # save_16bit_model writes it as config.json, so from_pretrained loads the saved weights.
    # Not ``pipe.config``: tensor parallelism would read the model's plan off it, whose
    # patterns are relative to a model the pipeline is not.
    pipe.hf_config = model.config
    return pipe


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


def _base_of(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"causal_lm_pipeline: {type(model).__name__} is not a Llama-style causal LM (it "
            f"needs {prefix or 'model'}.{{{', '.join(needed)}}} and lm_head); build its "
            "PipelineModule from a layer list by hand (docs/pipeline.md)"
        )
    return base


def _call_as_the_model_does(layer: nn.Module, rotary: nn.Module) -> None:
    """``layer(hidden)`` -> the layer's forward with the positions, rotary cos/sin and causal
    mask of a whole sequence starting at 0 (the instance's forward is replaced: names, hooks
    and tensor-parallel plans keep seeing the layer itself)."""
    if _INNER in layer.__dict__:
        return
    layer.__dict__[_INNER] = layer.forward
    # The rotary module is shared by every layer and holds no parameter: keep it off the tree.
    layer.__dict__["_shardwise_rotary"] = rotary
    layer.forward = types.MethodType(_decoder_forward, layer)


def _decoder_forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:  # called by the Hugging Face model itself: as before
        return self.__dict__[_INNER](hidden, *args, **kwargs)
    b, t = hidden.shape[:2]
    positions = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, -1)
    cos_sin = self.__dict__["_shardwise_rotary"](hidden, positions)
    blocked = torch.full((t, t), float("-inf"), device=hidden.device, dtype=hidden.dtype)
    mask = blocked.triu(1)[None, None]  # (1, 1, T, T): 0 on and below the diagonal
    out = self.__dict__[_INNER](
        hidden,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=cos_sin,
        use_cache=False,
    )
    return out[0] if isinstance(out, tuple) else out
