"""Hugging Face's tensor-parallel style names, translated to shardwise's or refused with a reason.

transformers publishes a ``tp_plan`` per model (``model.tp_plan``, ``config.base_model_tp_plan``)
whose styles are its own DTensor layouts. Each name below is either the same split as one of
ours (see tensor/parallelize.py's module doc), or a module every TP rank keeps whole, or a layout
shardwise has not built, refused with the reason so that the user can give an explicit plan.

    HF style                          shardwise            why it is the same split
    colwise, local_colwise            colwise              weight rows (outputs) split, output split
    colwise_rep, colwise_gather_output colwise_rep         ... output all-gathered (replicated)
    rowwise, rowwise_rep, local_rowwise rowwise            weight columns split, outputs summed
    embedding_rowwise                 vocab                embedding rows (the vocabulary) split
    packed_colwise                    packed_colwise       each packed part's outputs split
    sequence_parallel                 sequence_parallel
    replicate, local, local_params,   (kept whole)         every TP rank holds it and computes the
    replicated_with_grad_allreduce                         same gradient from the same input
"""

from __future__ import annotations

from typing import Any

TRANSLATED: dict[str, str | None] = {
    "colwise": "colwise",
    "local_colwise": "colwise",
    "colwise_rep": "colwise_rep",
    "colwise_gather_output": "colwise_rep",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "local_rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "sequence_parallel": "sequence_parallel",
    "packed_colwise": "packed_colwise",
    "replicate": None,
    "local": None,
    "local_params": None,
    "replicated_with_grad_allreduce": None,
}

_EXPLICIT = "give tensor_parallel.plan with shardwise styles for these modules instead"
REFUSED: dict[str, str] = {
    "rowwise_split_input": "a row split whose input arrives whole (shardwise's rowwise takes "
    "the split output of a colwise layer)",
    "embedding_colwise": "an embedding split along the hidden dimension (shardwise splits "
    "embeddings by vocabulary: embedding_rowwise / vocab)",
    "packed_rowwise": "fused weights split by row; not built yet",
    "local_packed_rowwise": "fused weights split by row; not built yet",
    "gather": "a module whose outputs are gathered across TP ranks (mixture-of-experts "
    "layouts); not built",
    "isolated": "expert weights local to each rank (expert parallelism); not built",
    "moe_tp_experts": "mixture-of-experts layers; not built",
    "moe_identity_expert": "mixture-of-experts layers; not built",
    "ep_router": "expert parallelism; not built",
    "grouped_gemm": "expert parallelism; not built",
    "all_reduce": "a module whose partial outputs are all-reduced (mixture-of-experts); not built",
    "mla_kv_a_proj": "multi-head latent attention's compressed projection; not built",
}


def translate_hf_styles(plan: dict[str, str], known: set[str]) -> dict[str, str]:
    """``plan`` with Hugging Face style names replaced by shardwise's; modules every rank keeps
    whole are dropped. A style shardwise cannot run raises ValueError naming each pattern, its
    style and the reason. ``known``: shardwise's own style names, which pass unchanged."""
    refused = {p: s for p, s in plan.items() if s not in known and s in REFUSED}
    if refused:
        lines = "; ".join(f"{p!r}: {s!r} is {REFUSED[s]}" for p, s in refused.items())
        raise ValueError(f"tensor-parallel plan: {lines}. {_EXPLICIT}")
    out = {}
    for pattern, style in plan.items():
        if style in known:
            out[pattern] = style
        elif style in TRANSLATED:
            if TRANSLATED[style] is not None:
                out[pattern] = TRANSLATED[style]
        else:
            out[pattern] = style  # unknown: match_plan names it with the list of known styles
    return out


def decoder_sequence_parallel(model: Any, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` plus the sequence-parallel entries of a Llama-style Hugging Face decoder, when
    the plan has none: the first layer is the entry (its input, the residual stream, is split
    along the sequence), the norms between the TP regions see only their positions, and
    attention gathers the whole sequence on entry (it reshapes by its input's length). Other
    models are returned unchanged (``parallelize`` then asks for the entries)."""
    if "sequence_parallel" in plan.values():
        return plan
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    layers = getattr(base, "layers", None)
    norms = ("input_layernorm", "post_attention_layernorm")
    if layers is None or not len(layers) or not hasattr(base, "norm"):
        return plan
    if not all(hasattr(layer, n) for layer in layers for n in norms):
        return plan
    extra = {f"{prefix}.layers.0": "sequence_entry", f"{prefix}.norm": "sequence_parallel"}
    extra[f"{prefix}.layers.*.self_attn"] = "sequence_gather"  # reads T off its input
    extra.update({f"{prefix}.layers.*.{n}": "sequence_parallel" for n in norms})
    return {**plan, **extra}
