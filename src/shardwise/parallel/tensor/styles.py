"""The one table of tensor-parallel style names: shardwise's, Hugging Face's (4.57 and 5.x).

A plan maps module-name patterns to these names (tensor/parallelize.py). The config's
``tensor_parallel.plan``, ``parallelize`` and the Hugging Face translation all read this table,
so a name is accepted, run or refused in the same way wherever it is written.

Each name either runs as one of shardwise's styles (``runs_as``; Hugging Face's names that mean
the same split are aliases), or is refused with the reason (a layout shardwise has not built).
What a style does, for a layer Y = X A + b with W = A^T (out, in) on n ranks:

    weight   which axis of W is split: "out" (rows: output features), "in" (columns: input
             features), "vocab" (an embedding's rows, or an LM head's outputs, padded to n)
    input    how the module's input arrives on each rank: "whole" (replicated), "split" (the
             features a column layer left split), "sequence" (T/n positions), "any"
    output   "split" (features), "gathered" (all-gathered: whole), "summed" (partial sums
             all-reduced: whole), "kept" (the module's own output, unchanged)
    packed   True: the outputs are k parts end to end (q|k|v, gate|up) and each part is split;
             False: a plain layer (a packed one would be cut across its parts); None: either

Which module a style fits (packed or not, whole or split input, module kind) is checked on the
model by tensor/fit.py before anything changes. Hugging Face's definitions were read from
transformers 4.57 (``integrations/tensor_parallel.py``) and 5.x (``distributed/tensor_parallel.py``):
``rowwise_rep`` is there RowwiseParallel(input_layouts=Replicate()), a row split whose input
arrives whole, the same as 5.x's ``rowwise_split_input``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

SW, HF4, HF5 = "shardwise", "hf4.57", "hf5"


@dataclass(frozen=True)
class Style:
    """One name of the table; see the module doc for the fields."""

    runs_as: str | None  # the shardwise style that runs it; None: refused (``does`` says why)
    modules: str  # what it applies to, in words
    weight: str
    input: str
    output: str
    packed: bool | None
    does: str  # one line
    names: tuple[str, ...] = (SW,)  # the vocabularies that publish this name


def _own(modules: str, weight: str, inp: str, out: str, packed: bool | None, does: str) -> Style:
    return Style("", modules, weight, inp, out, packed, does)


LINEAR = "nn.Linear / Conv1D"
# shardwise's own styles: what parallelize runs.
OWN: dict[str, Style] = {
    "colwise": _own(
        LINEAR, "out", "whole", "split", False, "ColumnParallelLinear, output left split"
    ),
    "colwise_rep": _own(
        LINEAR, "out", "whole", "gathered", None, "ColumnParallelLinear, output all-gathered"
    ),
    "packed_colwise": _own(
        LINEAR,
        "out",
        "whole",
        "split",
        True,
        "ColumnParallelLinear splitting each packed part: rank r computes q_r | k_r | v_r",
    ),
    "rowwise": _own(
        LINEAR, "in", "split", "summed", None, "RowParallelLinear on a column layer's split output"
    ),
    "rowwise_split_input": _own(
        LINEAR,
        "in",
        "whole",
        "summed",
        None,
        "RowParallelLinear that takes its slice of a whole input (after a colwise_rep)",
    ),
    "vocab": _own(
        "nn.Embedding / LM head",
        "vocab",
        "whole",
        "summed (embedding) / split logits (head)",
        None,
        "VocabParallelEmbedding, or a head split by vocabulary (feed loss_parallel)",
    ),
    "loss_parallel": _own(
        "nn.CrossEntropyLoss", "-", "split", "kept", None, "VocabParallelCrossEntropyLoss"
    ),
    "split_dropout": _own(
        "any module", "-", "split", "kept", None, "forward draws from the per-TP-rank stream"
    ),
    "sequence_parallel": _own(
        "norm, dropout",
        "-",
        "sequence",
        "kept",
        None,
        "with sequence_parallel: sees T/n positions, gradients summed over TP",
    ),
    "sequence_entry": _own(
        "any module", "-", "whole", "kept", None, "with sequence_parallel: input split along T"
    ),
    "sequence_gather": _own(
        "any module",
        "-",
        "sequence",
        "kept",
        None,
        "with sequence_parallel: input all-gathered along T (attention)",
    ),
    "replicated_with_grad_allreduce": _own(
        "a norm inside a split region",
        "-",
        "split",
        "kept",
        None,
        "kept whole, gradients summed over TP: it sees this rank's heads only (q_norm)",
    ),
    "replicate": _own("any module", "-", "whole", "kept", None, "kept whole on every rank"),
}
# Names several vocabularies share: shardwise's own spelling is Hugging Face's where they agree.
SHARED = {
    "colwise": (SW, HF4, HF5),
    "colwise_rep": (SW, HF4, HF5),
    "packed_colwise": (SW, HF5),
    "rowwise": (SW, HF4, HF5),
    "rowwise_split_input": (SW, HF5),
    "sequence_parallel": (SW, HF4, HF5),
    "replicated_with_grad_allreduce": (SW, HF5),
    "replicate": (SW, HF4, HF5),
}
# Hugging Face names for the same split as one of ours.
ALIASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "local_colwise": ("colwise", (HF4,)),
    "local_rowwise": ("rowwise", (HF4,)),
    "colwise_gather_output": ("colwise_rep", (HF5,)),
    "rowwise_rep": ("rowwise_split_input", (HF4, HF5)),
    "embedding_rowwise": ("vocab", (HF5,)),
}
_MOE = "mixture-of-experts layers; not built"
# Hugging Face names of layouts shardwise has not built: refused with the reason.
REFUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding_colwise": (
        "an embedding split along the hidden dimension; shardwise splits embeddings by "
        "vocabulary: use 'vocab' (embedding_rowwise)",
        (HF5,),
    ),
    "packed_rowwise": ("fused weights split by row; not built", (HF5,)),
    "local_packed_rowwise": ("fused weights split by row; not built", (HF4,)),
    "local": ("expert weights local to each rank, summed by a 'gather' parent; " + _MOE, (HF4,)),
    "gather": ("a module whose outputs are all-reduced over TP (experts); " + _MOE, (HF4,)),
    "local_params": (
        "a module whose bare parameters (attention sinks) are split by their own plan "
        "entries; not built",
        (HF5,),
    ),
    "grouped_gemm": ("expert parallelism; not built", (HF4, HF5)),
    "ep_router": ("expert parallelism; not built", (HF4, HF5)),
    "ep_dispatch_experts": ("expert parallelism; not built", (HF5,)),
    "moe_tp_experts": (_MOE, (HF5,)),
    "moe_identity_expert": (_MOE, (HF5,)),
    "all_reduce": ("a module whose partial outputs are all-reduced (experts); " + _MOE, (HF5,)),
    "mla_kv_a_proj": ("multi-head latent attention's compressed projection; not built", (HF5,)),
}


def _table() -> dict[str, Style]:
    table = {n: replace(s, runs_as=n, names=SHARED.get(n, (SW,))) for n, s in OWN.items()}
    for name, (target, names) in ALIASES.items():
        table[name] = replace(table[target], names=names)
    for name, (why, names) in REFUSED.items():
        table[name] = Style(None, "-", "-", "-", "-", None, why, names)
    return table


STYLES: dict[str, Style] = _table()
ACCEPTED = tuple(n for n, s in STYLES.items() if s.runs_as)
COLUMN = ("colwise", "colwise_rep", "packed_colwise")  # Linear styles splitting W's rows
ROW = ("rowwise", "rowwise_split_input")  # Linear styles splitting W's columns
SPLIT_OUTPUT = ("colwise", "packed_colwise")  # column styles that leave their output split


def style_problem(style: object) -> str | None:
    """Why ``style`` cannot be run (refused, unknown, not a string), or None when it can."""
    if not isinstance(style, str):
        return f"a style is a string, got {style!r}"
    known = STYLES.get(style)
    if known is None:
        near = difflib.get_close_matches(style, ACCEPTED, n=1, cutoff=0.8)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown style {style!r}{hint} (known: {', '.join(ACCEPTED)})"
    if known.runs_as is None:
        return f"{style!r} is {known.does}"
    return None


def canonical(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with every name replaced by the shardwise style that runs it; ValueError
    naming each pattern whose style is refused or unknown, with the reason."""
    problems = {p: style_problem(s) for p, s in plan.items()}
    bad = "; ".join(f"{p!r}: {why}" for p, why in problems.items() if why)
    if bad:
        raise ValueError(
            f"tensor-parallel plan: {bad}. Give these modules one of shardwise's styles "
            "(docs/tensor-parallel.md, 'Styles')"
        )
    return {p: STYLES[s].runs_as for p, s in plan.items()}


def markdown() -> str:
    """The table as docs/tensor-parallel.md shows it (a test checks that the docs hold it)."""
    yes = {True: "yes", False: "no", None: "-"}
    rows = [
        "| style | runs as | published by | applies to | W split | input | output | packed | does |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in STYLES.items():
        if s.runs_as:
            rows.append(
                f"| `{name}` | `{s.runs_as}` | {', '.join(s.names)} | {s.modules} | {s.weight} "
                f"| {s.input} | {s.output} | {yes[s.packed]} | {_cell(s.does)} |"
            )
    rows += ["", "| refused style | published by | why |", "| --- | --- | --- |"]
    refused = [(n, s) for n, s in STYLES.items() if not s.runs_as]
    rows += [f"| `{n}` | {', '.join(s.names)} | {_cell(s.does)} |" for n, s in refused]
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
