"""Whole tensors from a Megatron-style tensor-parallel DeepSpeed tag (``mp_rank_MM`` files).

A run that passed an ``mpu`` of model-parallel size t to ``deepspeed.initialize`` saves one
model file per tensor-parallel rank m (``mp_rank_MM_model_states.pt``) and, under ZeRO, one
optimizer file per data-parallel rank D of each (``zero_pp_rank_D_mp_rank_MM_optim_states.pt``,
engine.py ``_get_ckpt_name``/``_get_zero_ckpt_name``, m = ``mpu.get_model_parallel_rank()``).
Each rank's files are mapped alone into pieces of its *slices* (deepspeed.py); ``merge`` places
them in the whole tensors. The files do not say along which dimension a weight was split, so
the shape of the loading model decides: for a slice of shape S and a whole parameter of shape F,

    S == F                               replicated: tensor-parallel rank 0's copy is loaded
                                         (the others are compared with it: ``dropped`` names
                                         any copy that differs, and by how much)
    S[d] * t == F[d], S[i] == F[i] else  split along d: rank m's box is shifted by m * S[d]
    anything else                        refused, naming the parameter

The master weights and every optimizer state of a parameter follow its weight's split (they
share its shape; 0-dim states such as Adam's step are replicated). A name the loading model
does not have keeps rank 0's slice, so a strict load refuses it by name and a non-strict one
ignores it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reshard import PieceReader, fill

Shape = tuple[int, ...]


def param_of(name: str) -> str:
    """The parameter a piece name belongs to: "model/p", "master/p", "optim/<key>/p"."""
    kind, _, rest = name.partition("/")
    return rest.partition("/")[2] if kind == "optim" else rest


def split_dim(param: str, slice_shape: Shape, full: Shape, tp: int, where: str) -> int | None:
    """The dimension ``param`` was split along (module docstring), None if replicated."""
    if tuple(slice_shape) == tuple(full):
        return None
    differ = [d for d, (s, f) in enumerate(zip(slice_shape, full, strict=False)) if s != f]
    if (
        len(slice_shape) == len(full)
        and len(differ) == 1
        and slice_shape[differ[0]] * tp == full[differ[0]]
    ):
        return differ[0]
    raise CheckpointError(
        f"{where}: parameter {param!r}: each of the {tp} tensor-parallel ranks holds a slice "
        f"of shape {tuple(slice_shape)}, but this model's is {tuple(full)}: no split into {tp} "
        "equal parts along one dimension gives it (a checkpoint of another model?); nothing "
        "was loaded"
    )


def _shifted(p: Piece, d: int, offset: int, full: Shape) -> Piece:
    box = tuple((a + offset, b + offset) if i == d else (a, b) for i, (a, b) in enumerate(p.box))
    return Piece(p.name, tuple(full), box, p.flat, p.tensor)


def _whole(pieces: list[Piece]) -> torch.Tensor:
    """One rank's copy of a tensor, assembled from its pieces."""
    first = pieces[0]
    shape = tuple(first.global_shape)
    out = torch.empty(shape, dtype=first.tensor.dtype)
    fill(PieceReader(pieces), [Piece(first.name, shape, tuple((0, n) for n in shape), None, out)])
    return out


def merge(
    by_rank: dict[int, list[Piece]], full: dict[str, Shape] | None, where: str
) -> tuple[list[Piece], dict[str, str]]:
    """Pieces of whole tensors from each tensor-parallel rank's slice pieces (module
    docstring); ``full``: the loading model's parameter shapes, None to keep rank 0's slices
    (inspect, before any model exists). Returns the pieces and what was dropped, and why."""
    tp = len(by_rank)
    named: list[dict[str, list[Piece]]] = []
    for m in range(tp):
        names: dict[str, list[Piece]] = {}
        for p in by_rank[m]:
            names.setdefault(p.name, []).append(p)
        named.append(names)
    for m in range(1, tp):
        if set(named[m]) != set(named[0]):
            odd = sorted(set(named[m]) ^ set(named[0]))[:3]
            raise CheckpointError(
                f"{where}: tensor-parallel ranks 0 and {m} hold different tensors ({odd}): "
                "files of two runs?"
            )
    out, dropped = [], {}
    for name, first in named[0].items():
        param, shape = param_of(name), tuple(first[0].global_shape)
        if any(tuple(named[m][name][0].global_shape) != shape for m in range(tp)):
            raise CheckpointError(
                f"{where}: {name!r} has another shape on another tensor-parallel rank"
            )
        if full is None or param not in full or shape == ():
            out += first
            continue
        d = split_dim(param, shape, full[param], tp, where)
        if d is None:
            out += first
            worst = _worst_difference([named[m][name] for m in range(tp)])
            if worst:
                dropped[f"tensor-parallel copies of {name}"] = (
                    f"replicated, but ranks' copies differ by up to {worst:.3g}: "
                    "tensor-parallel rank 0's loaded"
                )
            continue
        for m in range(tp):
            out += [_shifted(p, d, m * shape[d], full[param]) for p in named[m][name]]
    return out, dropped


def _worst_difference(copies: list[list[Piece]]) -> float:
    """The largest difference between tensor-parallel rank 0's copy and the others'."""
    base = _whole(copies[0]).float()
    return max((float((_whole(c).float() - base).abs().max()) for c in copies[1:]), default=0.0)


def describe(tp: int) -> dict[str, Any]:
    """What ``shardwise checkpoint inspect`` says of a tensor-parallel tag."""
    return {
        "tensor_parallel": (
            f"{tp} ranks' slices (mp_rank_00..{tp - 1:02d}); each parameter's split "
            "dimension is found at load by comparing its slice with the model's full shape "
            "(equal shapes: replicated, rank 0's copy loaded); shapes below are per rank"
        )
    }
