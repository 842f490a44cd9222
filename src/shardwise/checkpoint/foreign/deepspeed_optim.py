"""DeepSpeed's optimizer states as checkpoint pieces: fp32 masters and per-element states.

Four layouts, by who wrapped the user's optimizer (DeepSpeed 0.19, runtime/):

    ZeRO-1/2, bf16 (zero/stage_1_and_2.py, bf16_optimizer.py): per rank and parameter group one
        flat fp32 partition (``single_partition_of_fp32_groups``) and the base optimizer's state
        over it (``base_optimizer_state["state"][group]``, or a list per group when saved with
        ``elastic_checkpoint``); deepspeed_flat.py says which parameter elements each holds.
    ZeRO-3 (zero/stage3.py): per rank one flat fp32 buffer per sub-group (``fp32_flat_groups``)
        and the base optimizer's state per sub-group.
    ZeRO-0 with bf16/fp16 (fp16/unfused_optimizer.py): masters per parameter
        (``fp32_groups``) in the model file's ``optimizer`` entry (the fused fp16 optimizer's
        ``fp32_groups_flat`` is refused: DeepSpeed runs fp16 on GPUs only, nothing tested it).
    ZeRO-0 in fp32: the user's optimizer's own ``state_dict()``.

Pieces: "master/<p>" (fp32 masters; flat pieces for partitions), "optim/<key>/<p>" for every
state tensor shaped like its partition (exp_avg, exp_avg_sq, momentum_buffer, ...), and a 0-dim
"optim/<key>/<p>" (Adam's step) per parameter, offered by the partition holding the parameter's
first element. The layouts without parameter names (ZeRO-0) are named through ``order``: the
parameter names of each optimizer group, in the order the optimizer was built (as torch's
``Optimizer.load_state_dict`` and DeepSpeed itself assume), checked against the saved shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.checkpoint.foreign import deepspeed_flat as flat
from shardwise.checkpoint.foreign.deepspeed_flat import Fragment
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece

Shapes = dict[str, tuple[int, ...]]


@dataclass
class Mapped:
    """What an optimizer layout gives: pieces, hyper-parameters, the optimizer wrapper's dict."""

    pieces: list[Piece] = field(default_factory=list)
    param_groups: list[dict] | None = None
    wrapper: dict | None = None  # where the loss scaler was saved (ZeRO / fp16 wrapper state)
    kind: str = ""


def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def _state_tensor(value: Any) -> torch.Tensor | None:
    """A state value as a tensor (older torch saved Adam's step as a float)."""
    if torch.is_tensor(value):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    return None


def fragment_pieces(
    frags: list[Fragment], master: torch.Tensor, state: dict, where: str
) -> list[Piece]:
    """Masters and optimizer states of the fragments of one flat partition ``master`` whose
    base optimizer state is ``state`` (tensors as long as the partition, or longer: padding)."""
    out = []
    for f in frags:
        n, box = f.hi - f.lo, _whole(f.shape)
        out.append(Piece(f"master/{f.name}", f.shape, box, (f.lo, f.hi), master[f.at : f.at + n]))
        for key, value in state.items():
            t = _state_tensor(value)
            if t is None:
                raise CheckpointError(f"{where}: optimizer state {key!r} is a {type(value)}")
            if t.dim() == 0:
                if f.lo == 0:
                    out.append(Piece(f"optim/{key}/{f.name}", (), (), None, t))
            elif t.dim() == 1 and t.numel() >= f.at + n:
                out.append(Piece(f"optim/{key}/{f.name}", f.shape, box, (f.lo, f.hi),
                                 t[f.at : f.at + n]))  # fmt: skip
            else:
                raise CheckpointError(
                    f"{where}: optimizer state {key!r} has shape {tuple(t.shape)}, not a flat "
                    f"partition of at least {f.at + n} elements: it cannot be resharded"
                )
    return out


def _groups(base: Any) -> tuple[dict, list[dict] | None]:
    """(state by index, hyper-parameters per group) of a base optimizer's state dict, or of
    an elastic checkpoint's list of per-group states (no hyper-parameters saved)."""
    if isinstance(base, list):
        return dict(enumerate(base)), None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    return dict(base["state"]), groups


def zero12(param_shapes: list[Shapes], files: list[dict], paths: list[str]) -> Mapped:
    """ZeRO-1/2 and bf16-optimizer partitions of every rank (module docstring)."""
    out = Mapped(kind="flat fp32 partitions (ZeRO-1/2)")
    world = len(files)
    for rank, (sd, where) in enumerate(zip(files, paths, strict=True)):
        osd = sd["optimizer_state_dict"]
        unpadded = "zero_stage" in osd  # ZeRO-1/2 drop the padding, the bf16 optimizer keeps it
        states, groups = _groups(osd["base_optimizer_state"])
        out.param_groups = groups if out.param_groups is None else out.param_groups
        masters = osd["single_partition_of_fp32_groups"]
        paddings = osd.get("param_alignment_paddings") or [None] * len(masters)
        if len(masters) != len(param_shapes):
            raise CheckpointError(
                f"{where}: {len(masters)} flat groups, the model file names {len(param_shapes)}"
            )
        for g, (shapes, master) in enumerate(zip(param_shapes, masters, strict=True)):
            size = master.numel() + (int(osd["group_paddings"][g]) if unpadded else 0)
            if size * world < flat.group_numel(shapes, paddings[g]):
                raise CheckpointError(
                    f"{where}: group {g}'s partitions ({world} x {size}) are smaller than its "
                    "parameters: the files come from different runs"
                )
            frags = flat.zero12_fragments(shapes, paddings[g], size, rank)
            mappings = osd.get("param_slice_mappings")
            if mappings is not None:
                flat.check_mappings(frags, mappings[g], f"{where} group {g}")
            out.pieces += fragment_pieces(frags, master, states.get(g, {}), where)
        out.wrapper = out.wrapper or osd
    return out


def zero3(param_shapes: list[Shapes], files: list[dict], paths: list[str]) -> Mapped:
    """ZeRO-3 per-rank flat buffers (module docstring); weights are the masters (rounded)."""
    out = Mapped(kind="per-parameter fp32 partitions (ZeRO-3)")
    shapes = {k: v for group in param_shapes for k, v in group.items()}
    world = len(files)
    for rank, (sd, where) in enumerate(zip(files, paths, strict=True)):
        osd = sd["optimizer_state_dict"]
        states, groups = _groups(osd["optimizer_state_dict"])
        out.param_groups = groups if out.param_groups is None else out.param_groups
        buffers = list(osd["fp32_flat_groups"])
        lengths = [b.numel() for b in buffers]
        if sum(lengths) != flat.zero3_numel(shapes, world):
            raise CheckpointError(
                f"{where}: flat buffers of {sum(lengths)} elements, but {world} ranks' partitions "
                f"of the recorded parameters take {flat.zero3_numel(shapes, world)}"
            )
        for f in flat.zero3_fragments(shapes, world, rank):
            i, at = flat.locate(f.at, f.hi - f.lo, lengths, where)
            moved = Fragment(f.name, f.shape, f.lo, f.hi, at)
            out.pieces += fragment_pieces([moved], buffers[i], states.get(i, {}), where)
        out.wrapper = out.wrapper or osd
    for p in [p for p in out.pieces if p.name.startswith("master/")]:
        out.pieces.append(Piece("model/" + p.name[7:], p.global_shape, p.box, p.flat, p.tensor))
    return out


def _named(order: list[list[str]], groups: list[dict], shapes: Shapes, where: str) -> list[list]:
    """The parameter names of each saved group (``params``: indices), from ``order``."""
    if [len(g["params"]) for g in groups] != [len(names) for names in order]:
        raise CheckpointError(
            f"{where}: the saved optimizer has groups of {[len(g['params']) for g in groups]} "
            f"parameters, this one {[len(n) for n in order]}: build the optimizer with the "
            "same parameter groups as the run that saved it (load_optimizer_states=False "
            "loads the weights alone)"
        )
    unknown = [n for names in order for n in names if n not in shapes]
    if unknown:
        raise CheckpointError(f"{where}: parameters {unknown[:3]} are not in the saved model")
    return [
        list(zip(g["params"], names, strict=True)) for g, names in zip(groups, order, strict=True)
    ]


def plain(order: list[list[str]], module: dict, saved: dict, where: str) -> Mapped:
    """ZeRO-0: the user's optimizer's state dict, or the fp16/bf16 wrapper's around it."""
    wrapped = "optimizer_state_dict" in saved
    base = saved["optimizer_state_dict"] if wrapped else saved
    states, groups = _groups(base)
    shapes = {k: tuple(v.shape) for k, v in module.items()}
    named = _named(order, base["param_groups"], shapes, where)
    out = Mapped(param_groups=groups, wrapper=saved if wrapped else None)
    out.kind = "fp32 optimizer state per parameter (ZeRO-0)"
    if "fp32_groups_flat" in saved:
        raise CheckpointError(
            f"{where}: the fused fp16 optimizer's flat masters (fp32_groups_flat) are not mapped "
            "yet (DeepSpeed 0.19 runs fp16 on GPUs only, so no test could write one); nothing "
            "was loaded"
        )
    masters = saved.get("fp32_groups")
    for g, pairs in enumerate(named):
        for j, (index, name) in enumerate(pairs):
            shape = shapes[name]
            box = _whole(shape)
            if masters is not None:
                master = masters[g][j]
                out.kind = "fp32 masters per parameter (ZeRO-0, fp16/bf16)"
                if tuple(master.shape) != shape:
                    raise CheckpointError(f"{where}: master of {name!r} has shape {master.shape}")
                out.pieces.append(Piece(f"master/{name}", shape, box, None, master))
            for key, value in states.get(index, {}).items():
                t = _state_tensor(value)
                if t is None or (t.dim() and tuple(t.shape) != shape):
                    raise CheckpointError(
                        f"{where}: optimizer state {key!r} of {name!r} is {value!r:.60}, not a "
                        f"tensor of its shape {shape}: the parameter order differs from the run's"
                    )
                out.pieces.append(Piece(f"optim/{key}/{name}", shape if t.dim() else (),
                                        box if t.dim() else (), None, t))  # fmt: skip
    return out


def check_counts(mapped: Mapped, shapes: Shapes) -> None:
    """Every saved master covers its parameter exactly once (a consistency check of the
    arithmetic: the pieces of one name hold as many elements as the shape has)."""
    held: dict[str, int] = {}
    for p in mapped.pieces:
        if p.name.startswith("master/"):
            n = math.prod(p.global_shape) if p.flat is None else p.flat[1] - p.flat[0]
            held[p.name[7:]] = held.get(p.name[7:], 0) + n
    odd = [k for k, n in held.items() if n != math.prod(shapes.get(k, (-1,)))]
    if odd:
        raise CheckpointError(f"the saved partitions do not hold parameters {odd[:3]} exactly once")
