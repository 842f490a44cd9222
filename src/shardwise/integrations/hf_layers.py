"""The layers of a Hugging Face causal LM, in order, each callable as ``layer(x)``: one adapter
per family of model structure (``causal_lm_pipeline`` builds the pipeline from what it returns).

Llama-style (Llama, Mistral, Qwen2, ...)::

    input_ids (B, T) -> model.embed_tokens -> model.layers[i] -> model.norm -> lm_head

GPT-2 style (``GPT2LMHeadModel``)::

    input_ids (B, T) -> transformer.wte -> transformer.wpe -> transformer.drop
                     -> transformer.h[i] -> transformer.ln_f -> lm_head

Each adapter returns ``[(Hugging Face name, module)]``, first the input embedding, last the
head, or None when the model is not of its family. Layers that need what the model computes
once for the whole stack (and no stage boundary carries) compute it again, exactly as the model
does, from the hidden state (B, T, C) alone: positions 0..T-1 (no KV cache: training), a
decoder layer's rotary cos/sin and its attention mask, built by transformers' own mask
functions for the attention the model uses (``config._attn_implementation``: an additive
float mask for "eager", possibly none for "sdpa" where ``is_causal`` does it) and the layer's
attention type (full or sliding window). GPT-2 adds its learned positions in ``wpe``:
``hidden + wpe(0..T-1)``, as ``GPT2Model`` adds them to the token embeddings.

Such a layer keeps its module (names, hooks and tensor-parallel plans see the module itself);
only the instance's ``forward`` is replaced, and a call from the model itself (which passes
more arguments, or position ids to ``wpe``) still runs the original forward.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ADAPTERS", "gpt2_style", "llama_style"]

Layers = list[tuple[str, nn.Module]]

_INNER = "_shardwise_hf_layer_forward"  # the module's own forward
_CONTEXT = "_shardwise_hf_layer_context"  # what it needs besides x: kept off the module tree


def llama_style(model: nn.Module) -> Layers | None:
    """``model.{embed_tokens, layers, norm, rotary_emb}`` and ``lm_head``."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not _has(base, "embed_tokens", "layers", "norm", "rotary_emb") or not _has(model, "lm_head"):
        return None
    for i, layer in enumerate(base.layers):
        context = {"config": model.config, "rotary": base.rotary_emb, "mask": _mask_fn(model, i)}
        _replace_forward(layer, _llama_decoder_forward, context)
    return [
        (f"{prefix}.embed_tokens", base.embed_tokens),
        *[(f"{prefix}.layers.{i}", layer) for i, layer in enumerate(base.layers)],
        (f"{prefix}.norm", base.norm),
        ("lm_head", model.lm_head),
    ]


def gpt2_style(model: nn.Module) -> Layers | None:
    """``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``."""
    base = getattr(model, "transformer", None)
    if not _has(base, "wte", "wpe", "drop", "h", "ln_f") or not _has(model, "lm_head"):
        return None
    _replace_forward(base.wpe, _positions_forward, {})
    for i, block in enumerate(base.h):
        _replace_forward(block, _gpt2_block_forward, {"mask": _mask_fn(model, i)})
    return [
        ("transformer.wte", base.wte),
        ("transformer.wpe", base.wpe),
        ("transformer.drop", base.drop),
        *[(f"transformer.h.{i}", block) for i, block in enumerate(base.h)],
        ("transformer.ln_f", base.ln_f),
        ("lm_head", model.lm_head),
    ]


# family name: (adapter, what it needs), tried in this order
ADAPTERS: dict[str, tuple[Callable[[nn.Module], Layers | None], str]] = {
    "Llama-style": (llama_style, "model.{embed_tokens, layers, norm, rotary_emb} and lm_head"),
    "GPT-2 style": (gpt2_style, "transformer.{wte, wpe, drop, h, ln_f} and lm_head"),
}


def _has(obj: object, *names: str) -> bool:
    return obj is not None and all(hasattr(obj, n) for n in names)


def _mask_fn(model: nn.Module, layer_idx: int) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """hidden (B, T, C), positions (1, T) -> the attention mask the model gives layer
    ``layer_idx``: transformers' causal mask, or its sliding-window one for a layer whose
    attention type says so (``config.layer_types``, Qwen2) or whose model has a window
    throughout (``config.sliding_window`` without layer types, Mistral). The functions'
    argument names differ between releases (4.57: ``input_embeds``, ``cache_position``,
    ``past_key_values``; 5.x: ``inputs_embeds``, ``cache``): read once off their signature."""
    from transformers import masking_utils as mu  # noqa: PLC0415 - transformers is an optional dependency

    config = model.config
    kinds = getattr(config, "layer_types", None)
    sliding = (
        kinds[layer_idx] == "sliding_attention"
        if kinds
        else getattr(config, "sliding_window", None) is not None
    )
    make = mu.create_sliding_window_causal_mask if sliding else mu.create_causal_mask
    names = set(inspect.signature(make).parameters)
    embeds = "inputs_embeds" if "inputs_embeds" in names else "input_embeds"  # 5.x / 4.57
    cache = "cache" if "cache" in names else "past_key_values"  # 5.x / 4.57 (deprecated in 5)

    def mask(hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        kwargs = {
            "config": config,
            embeds: hidden,
            "attention_mask": None,  # no padding mask: the batch is (input_ids, labels)
            cache: None,
            "position_ids": positions,
        }
        if "cache_position" in names:  # 4.57 requires it: without a cache, the positions
            kwargs["cache_position"] = positions[0]
        return make(**kwargs)

    return mask


def _replace_forward(module: nn.Module, forward: Callable, context: dict) -> None:
    """``module.forward`` becomes ``forward`` (bound to the module), its own kept (module doc)."""
    if _INNER in module.__dict__:  # a second pipeline of the same model: already done
        return
    module.__dict__[_INNER] = module.forward
    module.__dict__[_CONTEXT] = context
    module.forward = types.MethodType(forward, module)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """(1, T): 0..T-1, the position ids the model makes without a cache."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _llama_decoder_forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kw: Any) -> Any:
    if args or kw:  # called by the Hugging Face model itself: as before
        return self.__dict__[_INNER](hidden, *args, **kw)
    context = self.__dict__[_CONTEXT]
    positions = _positions(hidden)
    out = self.__dict__[_INNER](
        hidden,
        attention_mask=context["mask"](hidden, positions),
        position_ids=positions,
        position_embeddings=context["rotary"](hidden, positions),  # cos, sin: (1, T, head dim)
        use_cache=False,
    )
    return out[0] if isinstance(out, tuple) else out


def _gpt2_block_forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kw: Any) -> Any:
    if args or kw:
        return self.__dict__[_INNER](hidden, *args, **kw)
    positions = _positions(hidden)
    mask = self.__dict__[_CONTEXT]["mask"](hidden, positions)
    out = self.__dict__[_INNER](
        hidden, attention_mask=mask, position_ids=positions, use_cache=False
    )
    return out[0] if isinstance(out, tuple) else out


def _positions_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``wpe(hidden)``: hidden (B, T, C) + wpe(0..T-1) (1, T, C); ``wpe(position_ids)``, the
    model's own call (integer ids), looks the positions up as before."""
    if not x.is_floating_point():
        return self.__dict__[_INNER](x)
    return x + self.__dict__[_INNER](_positions(x))
