"""Where a tensor-parallel plan comes from, and how its patterns match module names.

A plan maps module-name patterns to styles (tensor/parallelize.py). It is the config's
``tensor_parallel.plan``, else the model's own: ``model.tp_plan`` (transformers 5 gives the whole
model's patterns; 4.x gave the base model's), else ``config.base_model_tp_plan`` (relative to
the base model, ``base_model_prefix``), else shardwise's plan for a Hugging Face model type
that publishes none (``KNOWN_PLANS``, by ``config.model_type``).
"""

from __future__ import annotations

import re

from torch import nn

# Plans for Hugging Face model types that publish none, in Hugging Face's style names; patterns
# are relative to the base model where it has one, and those matching no module are dropped
# (GPT2Model has no lm_head). GPT-2: the fused q|k|v Conv1D is split part by part; the head,
# tied to the embedding, is split by vocabulary like it and gathers the logits for HF's loss.
KNOWN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    },
}


def pattern_regex(pattern: str) -> re.Pattern:
    """A plan pattern as a regex: ``*`` is exactly one name component."""
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def resolve_plan(model: nn.Module, config_plan: dict[str, str] | None = None) -> dict[str, str]:
    """The plan to use: the config's, else ``model.tp_plan`` (or ``_tp_plan``), else a
    Hugging Face ``model.config.base_model_tp_plan``. Patterns written relative to the base
    model (``base_model_tp_plan``, and transformers 4.x's ``tp_plan``: "layers.*.mlp.up_proj"
    in a ``LlamaForCausalLM`` whose layers live under ``model.``) get its prefix."""
    if config_plan is not None:
        return dict(config_plan)
    for attr in ("tp_plan", "_tp_plan"):
        plan = getattr(model, attr, None)
        if isinstance(plan, dict) and plan:
            return _prefix_base(model, dict(plan))
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and isinstance(getattr(model, prefix, None), nn.Module):
            return {f"{prefix}.{k}": v for k, v in base.items()}
        return dict(base)
    known = KNOWN_PLANS.get(getattr(getattr(model, "config", None), "model_type", None))
    if known is not None:
        plan = _prefix_base(model, known)
        names = [n for n, _ in model.named_modules() if n]
        return {p: s for p, s in plan.items() if any(pattern_regex(p).fullmatch(n) for n in names)}
    raise ValueError(
        f"{type(model).__name__} has no tensor-parallel plan: give one in the config "
        '("tensor_parallel": {"size": N, "plan": {"blocks.*.mlp.fc": "colwise", ...}}) or set '
        "a tp_plan dict (module-name pattern -> style) on the model"
    )


def _prefix_base(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Each pattern that matches no module of ``model`` but does under the base model's prefix
    (Hugging Face's ``base_model_prefix``, e.g. "model") gets that prefix."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        return plan
    names = [n for n, _ in model.named_modules() if n]

    def matches(pattern: str) -> bool:
        rx = pattern_regex(pattern)
        return any(rx.fullmatch(n) for n in names)

    return {
        (f"{prefix}.{p}" if not matches(p) and matches(f"{prefix}.{p}") else p): s
        for p, s in plan.items()
    }
