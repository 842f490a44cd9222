"""Sequence parallelism for Hugging Face decoders: the plan entries their own plans lack.

transformers publishes a ``tp_plan`` per model in its own style names, which the one table of
styles (tensor/styles.py) runs or refuses. With ``"sequence_parallel": true`` a Llama-style
decoder needs more than its plan says: where the sequence is split (the first layer: the
residual stream is split too), attention must see the whole sequence, and the head must gather
it back (transformers 4.57's plans name no head; 5.x's do).
"""

from __future__ import annotations

from typing import Any

from shardwise.parallel.tensor.plans import pattern_regex


def decoder_sequence_parallel(model: Any, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` completed with the sequence-parallel entries of a Llama-style Hugging Face
    decoder: the first layer is the entry (its input, the residual stream, is split along the
    sequence), the norms between the TP regions see only their positions, and attention gathers
    the whole sequence on entry (it reshapes by its input's length), and a head the plan does
    not name gathers it back (``_head_entries``). A plan that already marks
    the norms (Hugging Face's own "sequence_parallel" entries) gets the entry and the gather;
    one that names a "sequence_entry" or "sequence_gather" is the user's own, returned unchanged. Another
    Hugging Face model whose plan has no entry is refused (ValueError naming the styles to add);
    a model of shardwise's own conventions is returned unchanged (``parallelize`` asks for
    the entries it lacks)."""
    if {"sequence_entry", "sequence_gather"} & set(plan.values()):
        return plan
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    layers = getattr(base, "layers", None)
    norms = ("input_layernorm", "post_attention_layernorm")
    llama_like = layers is not None and len(layers) and hasattr(base, "norm")
    if not (llama_like and all(hasattr(layer, n) for layer in layers for n in norms)):
        if base is not None and hasattr(model, "config"):
            raise ValueError(
                f"sequence parallelism on {type(model).__name__}: shardwise completes the plan "
                "of Llama-style decoders only; give tensor_parallel.plan 'sequence_entry' on the "
                "module whose input is the residual stream (the first layer), "
                "'sequence_gather' on attention and 'sequence_parallel' on the norms, or turn "
                "sequence_parallel off"
            )
        return plan
    extra = {f"{prefix}.layers.0": "sequence_entry", f"{prefix}.norm": "sequence_parallel"}
    extra[f"{prefix}.layers.*.self_attn"] = "sequence_gather"  # reads T off its input
    extra.update({f"{prefix}.layers.*.{n}": "sequence_parallel" for n in norms})
    return {**extra, **_head_entries(model, plan), **plan}


def _head_entries(model: Any, plan: dict[str, str]) -> dict[str, str]:
    """The exit of the sequence-parallel region, when the plan names no head: the final norm
    leaves each rank T/n positions, and a whole head would give logits for those only. The
    head split by vocabulary with its logits gathered (transformers 5's "lm_head":
    "colwise_gather_output", 4.57's class plan "colwise_rep") all-gathers the sequence on
    entry, as every column layer does here. A head tied to the input embedding shares its
    weight, so the embedding is split by vocabulary too (5.x's "embedding_rowwise"; 4.57's
    plans name neither). Names are found by module identity (``get_output_embeddings``)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    names = {id(m): n for n, m in model.named_modules() if n}
    head_name = names.get(id(head))
    if head_name is None or _named(plan, head_name):
        return {}
    entries = {head_name: "colwise_rep"}
    embed = model.get_input_embeddings()
    tied = getattr(head, "weight", None) is getattr(embed, "weight", False)
    if tied and not _named(plan, names[id(embed)]):
        entries[names[id(embed)]] = "vocab"
    return entries


def _named(plan: dict[str, str], module: str) -> bool:
    """Does a pattern of ``plan`` name ``module`` (or its weight, as 4.57 wrote some)?"""
    return any(pattern_regex(p).fullmatch(n) for p in plan for n in (module, f"{module}.weight"))
