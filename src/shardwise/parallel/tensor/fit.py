"""Does each style of a plan fit the module it names? Checked before ``parallelize`` changes
anything; a style that does not fit is refused naming the style that would.

Three questions, read off the model and the plan (styles.py says what each style expects):

* the module's kind: the column and row styles split a weight matrix (nn.Linear, GPT-2's
  Conv1D); ``vocab`` an embedding or an LM head; ``loss_parallel`` a cross-entropy loss;
* packing: a layer whose outputs are k parts end to end (its parent splits them: GPT-2's
  ``c_attn`` by ``split_size``, a fused ``gate_up_proj`` in two) must be split part by part
  (``packed_colwise``): plain ``colwise`` would hand rank 0 all of q and half of k. A plain
  layer must not be (``packed_colwise`` would split it as halves and swap them across ranks);
* the input of a row split: the column layers beside it (same parent) decide whether it
  arrives split (one of them leaves its output split: ``rowwise``) or whole (they gather it:
  ``rowwise_split_input``). With no column layer beside it, the plan is taken as written (a
  pipeline stage may receive a split activation from the stage before).

``replicated_with_grad_allreduce`` keeps a module whole and sums its gradient over the TP group:
right for a norm that sees only this rank's heads (a column layer beside it leaves its output
split and the norm is narrower than that layer's input, e.g. Qwen3's q_norm over head_dim; one
as wide as the input normalizes the whole input before the split) or a sequence shard; wrong wherever every rank sees the same whole
input (each rank already has the whole gradient, the sum counts it n times), and a whole weight
matrix cannot take a split input at all.
"""

from __future__ import annotations

from torch import nn

from shardwise.parallel.tensor.heads import packs_of
from shardwise.parallel.tensor.layers import linear_dims
from shardwise.parallel.tensor.styles import COLUMN, ROW, SPLIT_OUTPUT

_NOT_LINEAR = (
    "it is not a linear layer: 'vocab' splits an embedding, 'loss_parallel' a cross-entropy loss, "
    "'replicate' keeps a module whole (a norm: 'sequence_parallel' with sequence parallelism, "
    "'replicated_with_grad_allreduce' when it sees this rank's heads)"
)


def check_fit(model: nn.Module, found: dict[str, tuple[str, str]], sequence_parallel: bool) -> None:
    """ValueError for the first module whose style does not fit. ``found``: module name ->
    (plan pattern, shardwise style), in module order."""
    styles = {name: style for name, (_, style) in found.items()}
    for name, (pattern, style) in found.items():
        module = model.get_submodule(name)
        problem = (
            _kind_problem(module, style)
            or _packing_problem(model, name, style)
            or _input_problem(model, name, style, styles, sequence_parallel)
        )
        if problem:
            raise ValueError(
                f"plan pattern {pattern!r} matched {name!r}, a {type(module).__name__}, "
                f"but style {style!r} does not fit: {problem}"
            )


def _kind_problem(module: nn.Module, style: str) -> str | None:
    linear = linear_dims(module) is not None
    if style in COLUMN + ROW and not linear:
        if isinstance(module, nn.Embedding):
            return "an embedding is split by vocabulary: use 'vocab' (embedding_rowwise)"
        return _NOT_LINEAR
    if style == "vocab" and not (linear or isinstance(module, nn.Embedding)):
        return "'vocab' splits an nn.Embedding or an LM head (nn.Linear)"
    if style == "loss_parallel" and not isinstance(module, nn.CrossEntropyLoss):
        return "'loss_parallel' replaces an nn.CrossEntropyLoss"
    return None


def _packing_problem(model: nn.Module, name: str, style: str) -> str | None:
    if style not in ("colwise", "packed_colwise"):
        return None
    parts = packs_of(model, name)
    if style == "colwise" and parts > 1:
        return (
            f"its outputs are {parts} parts end to end, which its parent splits apart; "
            "'colwise' would give rank 0 the first part and a piece of the next: use "
            "'packed_colwise' (each part split) or 'colwise_rep' (output gathered)"
        )
    if style == "packed_colwise" and parts == 1:
        return (
            "its outputs are not packed (its parent has no split_size dividing them, its name "
            "is no fused gate_up): 'packed_colwise' would split it as halves: use 'colwise'"
        )
    return None


def _input_problem(
    model: nn.Module, name: str, style: str, styles: dict[str, str], sequence_parallel: bool
) -> str | None:
    module = model.get_submodule(name)
    parent = name.rpartition(".")[0]
    beside = {n: s for n, s in styles.items() if n != name and n.rpartition(".")[0] == parent}
    columns = sorted(n for n, s in beside.items() if s in COLUMN)
    split = sorted(n for n, s in beside.items() if s in SPLIT_OUTPUT)
    if style == "rowwise" and columns and not split:
        return (
            f"its input arrives whole ({', '.join(columns)} gather their output): use "
            "'rowwise_split_input' (Hugging Face's rowwise_rep), which takes its slice"
        )
    if style == "rowwise_split_input" and split:
        return f"its input is the split output of {', '.join(split)}: use 'rowwise'"
    if style != "replicated_with_grad_allreduce":
        return None
    if linear_dims(module) is not None or isinstance(module, nn.Embedding):
        if split:
            return (
                f"a whole weight cannot take the split output of {', '.join(split)}: use 'rowwise'"
            )
        return (
            "every rank computes its whole gradient from the same input, and summing it over "
            "the TP group counts it n times: use 'replicate' (kept whole) or split it "
            "('colwise' / 'rowwise')"
        )
    inputs = {linear_dims(model.get_submodule(n))[0] for n in split}
    if not (split and _width(module) not in inputs) and not sequence_parallel:
        return (
            "it does not sit on a column layer's split output (none beside it leaves its "
            "output split, or it is as wide as their input: it normalizes that whole input), "
            "so every rank sees the same input and summing its gradient counts it n times: "
            "use 'replicate' (or 'sequence_parallel' with sequence parallelism)"
        )
    return None


def _width(module: nn.Module) -> int | None:
    """The features a norm normalizes: the last dimension of its first parameter."""
    p = next(module.parameters(recurse=False), None)
    return p.shape[-1] if p is not None and p.dim() else None
