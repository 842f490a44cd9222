"""Hugging Face ``transformers`` models under context parallelism.

A model of the library calls the attention function its config names, through transformers'
``AttentionInterface``, and builds its mask through ``AttentionMaskInterface``. Under
``context_parallel`` the model is switched to the implementation ``"shardwise"``:

- attention: ``shardwise.attention`` on the (batch, heads, tokens, head dim) q/k/v the layer
  made, causal as the layer says (``module.is_causal``), grouped-query heads repeated; the
  result (batch, tokens, heads, head dim) as transformers' SDPA path returns it;
- mask: none. Causality is ``is_causal``; a padding mask (a 0 anywhere in ``attention_mask``)
  is refused, since the keys of a padded position live on another rank.

Every batch (a mapping, as Hugging Face datasets yield) is prepared before it is cut along the
sequence (``prepare_batch``):

- ``position_ids`` are added: the global positions (RoPE and learned position embeddings index
  by them);
- ``labels`` are taken out, and the loss is computed here (``token_loss``), not by the model.
  For a causal LM they are first shifted by one over the whole sequence; the model would
  shift them within each rank's tokens and pair tokens that are not neighbours. Each rank's
  loss is its sum of token losses over (labelled tokens of the whole micro-batch) / cp, so the
  average over the context ranks is the mean over every labelled token, as one process
  computes it, however the labelled tokens fall on the ranks. The rank holding the last
  position, which has no next token, and a masked LM's few labels both make the counts
  unequal; the model's own ``num_items_in_batch`` is not honoured by every model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import EngineError
from shardwise.parallel.context.scope import attention

NAME = "shardwise"
IGNORE = -100  # Hugging Face's ignore_index


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "set_attn_implementation")


def refuse_built_in_attention(model: nn.Module) -> None:
    """EngineError for a Hugging Face model whose attention no registered implementation
    reaches: transformers calls the attention its config names only in models built on
    ``AttentionInterface`` (the class's ``_supports_attention_backend``); the others build
    their own attention classes at construction (transformers 4.57's BERT), and their
    attention would see only this rank's tokens."""
    if not is_hf_model(model) or getattr(model, "_supports_attention_backend", True):
        return
    import transformers  # noqa: PLC0415 - an optional dependency; a HF model brought it

    raise EngineError(
        f"context_parallel with {type(model).__name__}: under transformers "
        f"{transformers.__version__} its attention is built into the model, not called "
        "through transformers' AttentionInterface (its class sets _supports_attention_backend "
        "= False), so shardwise cannot spread it over the context ranks. Upgrade transformers "
        "to a release whose model calls that interface (BERT's does in transformers 5), or "
        "set context_parallel.size to 1"
    )


def use_context_attention(model: nn.Module) -> None:
    """Register the ``"shardwise"`` attention and mask with transformers (once per process:
    they are transformers' own registries) and switch ``model`` to them."""
    from transformers import AttentionInterface  # noqa: PLC0415 - an optional dependency
    from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415 - the same

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    model.set_attn_implementation(NAME)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    gqa = key.shape[1] != query.shape[1]
    out = attention(query, key, value, dropout_p=dropout, is_causal=causal, scale=scaling,
                    enable_gqa=gqa)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _refuse_padding(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise EngineError(
            "context_parallel with a padding attention_mask (zeros in it): a rank cannot mask "
            "keys that live on another rank. Pack or trim sequences to one length without "
            "padding, or set context_parallel.size to 1"
        )


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    _refuse_padding(attention_mask)  # a hand-cut batch: this rank's part of the mask
    return None


def prepare_batch(model: nn.Module, batch: Mapping) -> tuple[dict, torch.Tensor | None]:
    """``(model inputs, targets)`` of a whole-sequence batch: the inputs gain ``position_ids``
    and lose ``labels``; the targets are the labels, shifted by one over the whole sequence
    for a causal LM (module docstring). Other losses are refused: their labels are not one
    per token."""
    _refuse_padding(batch.get("attention_mask"))  # the whole mask: every rank refuses alike
    out = dict(batch)
    ids = out.get("input_ids")
    if ids is not None and "position_ids" not in out:
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    labels = out.pop("labels", None)
    if labels is None:
        return out, None
    kind = getattr(model, "loss_type", None)
    if kind not in (None, "ForCausalLM", "ForMaskedLM"):
        raise EngineError(
            f"context_parallel with a {type(model).__name__} (loss {kind}): only token losses "
            "(causal and masked language models) are split over the sequence; set "
            "context_parallel.size to 1"
        )
    if kind != "ForMaskedLM":  # a causal LM: position t predicts token t + 1
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return out, labels


def token_loss(out: Any, targets: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Hugging Face's token cross-entropy (fp32, ``-100`` ignored) of this rank's tokens,
    summed and divided by ``items``: the labelled tokens of the whole micro-batch over cp."""
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    logits = logits.float().reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss / items
