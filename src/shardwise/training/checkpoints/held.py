"""What this rank holds, as checkpoint pieces, and the model loaded from a checkpoint's.

``layout(parts)``: the pieces of this rank's part of the layout (checkpoint/rank_pieces.py:
weights, fp32 masters, optimizer states), as the save writes them, the load fills them and the
replica check compares them; ``load_model`` fills the weights and masters from any reader (a
checkpoint, or a whole-model state dict: ``load_module_state_dict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardwise.checkpoint.export import MODEL
from shardwise.checkpoint.foreign.hf_safetensors import HfSafetensorsReader
from shardwise.checkpoint.optim_state import optim_pieces
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.rank_pieces import Layout, layout_of
from shardwise.checkpoint.reshard import CheckpointError, PieceReader, fill
from shardwise.parallel.moe.experts import every_expert_name, global_names

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.reader import CheckpointReader
    from shardwise.training.parts import TrainParts


def layout(parts: TrainParts) -> Layout:
    """What this rank holds, as checkpoint pieces (checkpoint/rank_pieces.py)."""
    return layout_of(parts.module, parts.optimizer, parts.strategy, parts.mesh)


def frozen_names(parts: TrainParts) -> set[str]:
    return {f"{MODEL}{n}" for n, p in parts.module.named_parameters() if not p.requires_grad}


def engine_pieces(parts: TrainParts) -> list[Piece]:
    """Every piece this rank holds: weights, fp32 masters, optimizer states."""
    lay = layout(parts)
    pieces = lay.model + lay.master_pieces()
    if parts.optimizer is not None:
        pieces += optim_pieces(lay, parts.optimizer)
    return pieces


def tied_aliases(module: nn.Module, saved: set[str]) -> dict[str, str]:
    """``{alias: name}`` for every parameter reachable under two names (tied weights, such as a
    language model head sharing the embedding): the checkpoint stores the tensor once, under
    ``name``, and export writes it under both names, as ``module.state_dict()`` has them."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = name
        elif f"{MODEL}{first[id(p)]}" in saved and f"{MODEL}{name}" not in saved:
            aliases[name] = first[id(p)]
    return aliases


def load_model(parts: TrainParts, reader: CheckpointReader, lay: Layout, strict: bool) -> None:
    """Weights and masters; frozen parameters absent from the checkpoint (saved with
    exclude_frozen_parameters) keep their values. ``strict`` also refuses saved weights this
    model has no place for."""
    targets = lay.model + lay.master_pieces()
    frozen = frozen_names(parts)
    fill(reader, targets, strict=strict, optional=lambda name: name in frozen)
    if strict:
        check_unexpected(parts, reader)


def check_unexpected(parts: TrainParts, reader: CheckpointReader) -> None:
    """Refuse saved weights this model has no place for (with one pipeline stage: a stage
    holds part of the names, so nothing is refused)."""
    if parts.mesh.topology.pp != 1:
        return
    module = parts.module
    rename = global_names(module)  # experts by their single-process names, all of them
    mine = {f"model/{rename(n)}" for n in module.state_dict()}
    mine |= {f"model/{rename(n)}" for n, _ in module.named_parameters()}
    mine |= {f"model/{n}" for n in every_expert_name(module)}
    unexpected = sorted(n for n in reader.names() if n.startswith("model/") and n not in mine)
    if unexpected:
        raise CheckpointError(
            f"the checkpoint holds weights this model does not have: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; it was saved from another model "
            "(pass load_module_strict=False to ignore them)"
        )


def load_module_state_dict(parts: TrainParts, state_dict: dict, strict: bool = True) -> None:
    """Load a whole-model state dict (the user's keys) into any layout; fp32 masters follow."""
    load_model(parts, PieceReader.from_state_dict(state_dict), layout(parts), strict)


def load_safetensors(parts: TrainParts, path: str, strict: bool = True) -> HfSafetensorsReader:
    """Hugging Face safetensors weights (checkpoint/foreign/hf_safetensors.py) into any layout,
    each rank reading only the slices its pieces hold; all or nothing, as any load (the
    reads are planned and checked before a tensor is assigned). Returns the reader (its
    counts of what this rank read)."""
    with HfSafetensorsReader(path) as reader:
        load_model(parts, reader, layout(parts), strict)
    return reader
