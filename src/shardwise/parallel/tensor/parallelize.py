"""parallelize(model, plan, mesh): rewrite an ordinary model for tensor parallelism, in place.

A plan maps module-name patterns to styles: shardwise's names or Hugging Face's (4.57 and 5.x),
one table for all (tensor/styles.py, which says what each does; Hugging Face's names that mean
the same split run as ours). In a pattern ``*`` stands for exactly one name component
("blocks.*.attn.q" matches "blocks.3.attn.q", not "blocks.3.x.q"); a pattern naming a parameter
("norm.weight", as transformers 4.57 wrote some) stands for its module. Each style is checked
against its module before anything changes (tensor/fit.py).

    colwise            nn.Linear -> ColumnParallelLinear, output left split
    colwise_rep        nn.Linear -> ColumnParallelLinear, output all-gathered (replicated)
    packed_colwise     nn.Linear whose outputs are k parts end to end (a fused q|k|v or
                       gate|up) -> ColumnParallelLinear splitting each part: rank r computes
                       q_r | k_r | v_r. k is the parent's ``split_size`` parts (GPT-2's c_attn:
                       3), else 2 for a fused gate_up (Hugging Face's convention)
    rowwise            nn.Linear -> RowParallelLinear, its input a column layer's split output,
                       partial outputs summed
    rowwise_split_input  the same on a whole input (after a colwise_rep): it takes its slice
    vocab              nn.Embedding -> VocabParallelEmbedding; nn.Linear (an LM head) ->
                       ColumnParallelLinear over the vocabulary padded to a multiple of the TP
                       size, padded logits -inf (feed it to a "loss_parallel" loss)
    loss_parallel      nn.CrossEntropyLoss -> VocabParallelCrossEntropyLoss (split logits)
    split_dropout      the module's forward draws from the per-TP-rank random stream (dropout
                       on split activations, e.g. attention probabilities of local heads)
    replicated_with_grad_allreduce  kept whole, gradients summed over the TP group: a norm
                       that sees this rank's heads only (Qwen3's q_norm / k_norm)
    replicate          kept whole on every rank (nothing to do)
    sequence_parallel  a module between the TP regions (norm, dropout); a no-op unless
                       ``sequence_parallel=True``, see below
    sequence_entry     the module whose input is split along the sequence (a Hugging Face
                       decoder's first layer, whose residual must be split too); optional
    sequence_gather    a module that must see the whole sequence (Hugging Face attention reads
                       the sequence length off its input): its input is all-gathered on entry
                       (backward: reduce-scattered) and its column layers use it as it is

Sequence parallelism (``sequence_parallel=True``): between the TP regions every rank holds
T/n positions of the (B, T, C) activations (dim ``seq_dim``). The plan's "sequence_parallel"
modules mark that region:
  * the "sequence_entry" module, else the first of them in module order (the GPT's dropout
    after the embeddings), is the entry: its input, replicated, is split along the sequence
    there (backward: all-gather), so the residual stream is split from that point on (a Hugging
    Face decoder layer reads the residual before its first norm, so there the entry is the
    first layer; rotary cos/sin stay whole: attention sees the whole sequence);
  * column layers all-gather their input along the sequence (backward reduce-scatter), row
    layers reduce-scatter their output (backward all-gather), the vocab head all-gathers its
    input (the exit: logits cover the whole sequence, split by vocabulary);
  * each "sequence_parallel" module sees only its shard, so its parameters' gradients are
    summed over the TP group (norm weights) and its forward draws from the per-rank stream
    (dropout masks of different positions must be independent).
The vocab embedding stays an all-reduce: position embeddings are added to whole sequences.

Random streams: dropout outside split regions uses the default stream, identical on every TP
rank; split regions fork the tracker's per-rank stream (random.py). ``parallelize`` adds that
stream if the script did not (``model_parallel_seed``).

Every nn.Linear style also takes a GPT-2 ``Conv1D`` (weight stored transposed, (in, out)): the
split layer keeps that storage, so names, shapes and checkpoints stay the model's own.

Attention heads: layers split by column hand each rank whole heads when the heads divide the
TP size. A module with both column and row children (attention) that has ``head_dim`` is
checked; one with ``n_head``/``num_heads``/... has it divided by the TP size (its forward then
sees local heads, and a ``split_size``, the width of one packed part, is divided too). Tied parameters (embedding and head, both "vocab") share the new shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.compile import traceable
from shardwise.parallel.tensor import random as tp_random
from shardwise.parallel.tensor.comm import (
    gather_from_sequence,
    scatter_to_sequence,
    sum_grad_over_tp,
)
from shardwise.parallel.tensor.fit import check_fit
from shardwise.parallel.tensor.heads import HEAD_ATTRS, heads_to_divide, packs_of  # noqa: F401
from shardwise.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedInput,
    linear_dims,
)
from shardwise.parallel.tensor.placement import get_placement
from shardwise.parallel.tensor.plans import pattern_regex, resolve_plan  # noqa: F401 (re-exported)
from shardwise.parallel.tensor.styles import STYLES, canonical  # noqa: F401 (re-exported)
from shardwise.parallel.tensor.vocab import VocabParallelCrossEntropyLoss, VocabParallelEmbedding

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

    from shardwise.topology import ProcessMesh


@dataclass
class _Context:
    group: Any
    tp: int
    sequence_parallel: bool
    seq_dim: int
    tracker: tp_random.RNGStatesTracker
    shared: SharedInput = field(default_factory=SharedInput)
    shards: dict[int, tuple] = field(default_factory=dict)  # id(old param) -> (old, new, box)
    packs: dict[str, int] = field(default_factory=dict)  # packed_colwise module -> its parts


def _tp_of(mesh_or_group: ProcessMesh | ProcessGroup | None) -> tuple[Any, int]:
    """(group, rank in it) from a ProcessMesh or a process group."""
    if hasattr(mesh_or_group, "tp_group") and hasattr(mesh_or_group, "tp_rank"):
        return mesh_or_group.tp_group, mesh_or_group.tp_rank
    return mesh_or_group, comm.get_rank(mesh_or_group)


def match_plan(
    model: nn.Module, plan: dict[str, str], sequence_parallel: bool = False
) -> dict[str, str]:
    """module name -> shardwise style, in module order; every pattern must match a module,
    every style be one the table runs (tensor/styles.py) and fit its module (tensor/fit.py)."""
    if not plan:
        raise ValueError("the tensor-parallel plan is empty: map module-name patterns to styles")
    plan = canonical(plan)
    names = [n for n, _ in model.named_modules() if n]
    compiled = {p: pattern_regex(_module_pattern(p, names)) for p in plan}
    found: dict[str, tuple[str, str]] = {}
    used = set()
    for name in names:
        for pattern, rx in compiled.items():
            if not rx.fullmatch(name):
                continue
            used.add(pattern)
            style = plan[pattern]
            if name in found and found[name][1] != style:
                raise ValueError(
                    f"module {name!r} is matched by plan patterns {found[name][0]!r} "
                    f"({found[name][1]}) and {pattern!r} ({style}): keep one"
                )
            found[name] = (pattern, style)
    missing = [p for p in plan if p not in used]
    if missing:
        raise ValueError(
            f"tensor-parallel plan patterns {missing} (tensor_parallel.plan, or the model's "
            f"tp_plan) match no module of {type(model).__name__} ('*' stands for one name "
            "component, e.g. 'blocks.*.mlp.fc')"
        )
    check_fit(model, found, sequence_parallel)
    return {name: style for name, (_, style) in found.items()}


def _module_pattern(pattern: str, names: list[str]) -> str:
    """A pattern naming a parameter ("layers.*.norm.weight", transformers 4.57) stands for its
    module, when it matches no module itself."""
    head, _, last = pattern.rpartition(".")
    if last not in ("weight", "bias") or not head:
        return pattern
    if any(pattern_regex(pattern).fullmatch(n) for n in names):
        return pattern
    return head


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def _check_sizes(model: nn.Module, matches: dict[str, str], tp: int) -> None:
    """Divisibility errors before anything changes (the model stays intact on error)."""
    for name, style in matches.items():
        dims = linear_dims(model.get_submodule(name))
        if dims is None:
            continue
        in_f, out_f, _ = dims
        parts = packs_of(model, name) if style == "packed_colwise" else 1
        if style in ("colwise", "colwise_rep", "packed_colwise") and out_f % (tp * parts):
            what = f"{parts} packed parts of {out_f // parts}" if parts > 1 else ""
            raise ValueError(
                f"{name}: out_features {out_f} {what} is not divisible by the "
                f"tensor-parallel size {tp} (style {style!r})"
            )
        if style in ("rowwise", "rowwise_split_input") and in_f % tp:
            raise ValueError(
                f"{name}: in_features {in_f} is not divisible by the "
                f"tensor-parallel size {tp} (style {style!r})"
            )


def _share_tied(ctx: _Context, old: nn.Module, new: nn.Module, name: str) -> None:
    """A parameter shared by two split modules is shared by their new shards too."""
    for attr in ("weight", "bias"):
        before, after = getattr(old, attr, None), getattr(new, attr, None)
        if before is None or after is None:
            continue
        box = get_placement(after).box
        if id(before) not in ctx.shards:
            ctx.shards[id(before)] = (before, after, box)
            continue
        _, shard, first_box = ctx.shards[id(before)]
        if box != first_box:
            raise ValueError(
                f"{name}.{attr} is tied to a parameter already split as {first_box}, but "
                f"this style splits it as {box}: give tied modules the same style ('vocab')"
            )
        setattr(new, attr, shard)


def _fork_rng(module: nn.Module, tracker: tp_random.RNGStatesTracker) -> None:
    """Run ``module``'s forward inside the per-TP-rank random stream."""
    open_forks: list = []

    def enter(mod: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() and not _draws(mod):
            # Nothing random runs inside: the stream would come back unchanged, and dynamo
            # cannot trace the RNG state swap (a graph break inside the block, docs/compile.md).
            open_forks.append(None)
            return
        fork = tracker.fork(tp_random.TP_STREAM)
        fork.__enter__()
        open_forks.append(fork)

    def leave(mod: nn.Module, args: tuple, out: Any) -> None:
        fork = open_forks.pop()
        if fork is not None:
            fork.__exit__(None, None, None)

    # Traced inside a compiled region: the fork is skipped there when nothing draws (above);
    # with dropout it breaks the graph around this module, per block or whole alike.
    module.register_forward_pre_hook(traceable(enter))
    module.register_forward_hook(traceable(leave), always_call=True)


def _draws(module: nn.Module) -> bool:
    """Whether ``module`` may draw random numbers: training, with a dropout module or a
    numeric ``*dropout*`` attribute (GPT's Attend, Hugging Face's attention_dropout) above 0."""
    if not module.training:
        return False
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, (int, float)) and value > 0:
                return True
    return False


def _split_sequence_on_entry(module: nn.Module, ctx: _Context) -> None:
    def split(mod: nn.Module, args: tuple) -> tuple:
        return (scatter_to_sequence(args[0], ctx.group, ctx.seq_dim), *args[1:])

    module.register_forward_pre_hook(split)


def _gather_sequence_on_entry(module: nn.Module, ctx: _Context) -> None:
    """All-gather the hidden states (first argument, or ``hidden_states=``) along the sequence
    and mark the result as prepared, so the column layers inside (q, k, v) read it as it is:
    their partial input gradients are summed once, by this gather's reduce-scatter."""
    kind = ("sequence", ctx.seq_dim)

    def gather(x: Any) -> Any:
        full = gather_from_sequence(x, ctx.group, ctx.seq_dim)
        return ctx.shared.prepare(full, kind, lambda t: t)

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _replacement(module: nn.Module, name: str, style: str, ctx: _Context) -> nn.Module | None:
    """The split module for ``style``, or None when the module is kept (hooks only)."""
    sp = {"sequence_parallel": ctx.sequence_parallel, "seq_dim": ctx.seq_dim, "name": name}
    col = {**sp, "shared_input": ctx.shared}
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, ctx.group, **col)
    if style == "colwise_rep":
        return ColumnParallelLinear.from_linear(module, ctx.group, gather_output=True, **col)
    if style == "packed_colwise":
        return ColumnParallelLinear.from_linear(module, ctx.group, packs=ctx.packs[name], **col)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, ctx.group, **sp)
    if style == "rowwise_split_input":
        return RowParallelLinear.from_linear(module, ctx.group, input_is_parallel=False, **sp)
    if style == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding.from_embedding(module, ctx.group, name)
    if style == "vocab":
        return ColumnParallelLinear.from_linear(module, ctx.group, pad_vocab=True, **col)
    if style == "loss_parallel":
        return VocabParallelCrossEntropyLoss.from_module(module, ctx.group, name)
    return None


def _apply(model: nn.Module, name: str, style: str, ctx: _Context, entry: bool) -> None:
    module = model.get_submodule(name)
    new = _replacement(module, name, style, ctx)
    if new is not None:
        new.train(module.training)
        _share_tied(ctx, module, new, name)
        parent, child = _parent(model, name)
        setattr(parent, child, new)
    elif style == "split_dropout":
        _fork_rng(module, ctx.tracker)
    elif style == "replicated_with_grad_allreduce":
        for p in module.parameters():
            sum_grad_over_tp(p, ctx.group)  # each rank's gradient covers its heads only
    elif style == "sequence_parallel" and ctx.sequence_parallel:
        for p in module.parameters():
            sum_grad_over_tp(p, ctx.group)  # each rank's gradient covers its positions only
        if entry:
            _split_sequence_on_entry(module, ctx)
        _fork_rng(module, ctx.tracker)
    elif style == "sequence_entry" and ctx.sequence_parallel and entry:
        _split_sequence_on_entry(module, ctx)
    elif style == "sequence_gather" and ctx.sequence_parallel:
        _gather_sequence_on_entry(module, ctx)


def _check_ties(model: nn.Module, ctx: _Context) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        kept = ctx.shards.get(id(p))
        if kept is not None and kept[0] is p:
            raise ValueError(
                f"parameter {name!r} is tied to a parameter that the plan split, but its "
                "module is not in the plan: give it the same style as the module it is tied to"
            )


def parallelize(
    model: nn.Module,
    plan: dict[str, str],
    mesh_or_group: ProcessMesh | ProcessGroup | None = None,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
    rng_tracker: tp_random.RNGStatesTracker | None = None,
    split_entry: bool = True,
) -> nn.Module:
    """Split ``model``'s layers over the tensor-parallel group, in place, and return it.

    ``mesh_or_group``: a ProcessMesh (its ``tp_group``) or a process group. Every TP rank must
    call this with the same, identically initialized model. See the module doc for styles.
    ``split_entry=False``: with sequence parallelism, the model's input arrives already split
    along the sequence (a pipeline stage after the first), so no module splits it.
    """
    group, rank = _tp_of(mesh_or_group)
    tp = comm.get_world_size(group)
    matches = match_plan(model, plan, sequence_parallel)
    if sequence_parallel and "sequence_parallel" not in matches.values():
        raise ValueError(
            "sequence_parallel=True needs 'sequence_parallel' entries in the plan: the norms "
            "and dropouts between the tensor-parallel layers, the first one where the "
            "sequence is split (e.g. the dropout after the embeddings)"
        )
    if tp == 1:
        return model
    _check_sizes(model, matches, tp)
    heads = heads_to_divide(model, matches, tp)
    tracker = rng_tracker if rng_tracker is not None else tp_random.get_rng_tracker()
    tp_random.ensure_tp_stream(rank, tracker)
    ctx = _Context(group, tp, sequence_parallel, seq_dim, tracker)
    ctx.packs = {n: packs_of(model, n) for n, s in matches.items() if s == "packed_colwise"}
    marked = [n for n, s in matches.items() if s == "sequence_entry"]
    entry = next((n for n, s in matches.items() if s == "sequence_parallel"), None)
    entry = marked[0] if marked else entry
    entry = entry if split_entry else None
    for name, style in matches.items():
        _apply(model, name, style, ctx, entry=name == entry)
    _check_ties(model, ctx)
    for module, attr in heads:
        setattr(module, attr, getattr(module, attr) // tp)
    return model
