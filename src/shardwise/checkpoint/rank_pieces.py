"""What each gradient strategy holds on this rank, as checkpoint pieces (pieces.py).

A layout is described by two lists:

    model   pieces "model/<p>" of parameters and persistent buffers, in the model's dtype;
    slots   where this rank holds optimizer-side data of a parameter: the part (box, flat range)
            of parameter <p>, the tensor the optimizer keys its state by (``owner``: the user's
            parameter, or a flat fp32 master shard), where the part starts in the owner, and
            the separate fp32 master values when there are some.

From the slots come "master/<p>" (only where the master is separate storage: 16-bit training
or offload) and "optim/<key>/<p>" for each optimizer state tensor shaped like its owner
(exp_avg, exp_avg_sq, momentum_buffer...). A 0-dim state (Adam's ``step``) is one scalar piece
per parameter, "optim/step/<p>", offered by the rank holding the parameter's first element; a
flat master shared by several parameters takes the largest of their values on load (they are
equal unless a parameter never had a gradient in a per-parameter layout).

Who saves what (``Piece.save``): ZeRO shards by the rank that owns them; data-parallel
replicas (every parameter in plain DP, model weights under ZeRO-1/2, persistent units under
ZeRO-3) by one data-parallel rank each, spread so that the ranks write as many bytes as one
another (greedy, in model order: every replica computes the same choice, without
communication; the model weights and the optimizer-side slots are balanced separately); a
tensor-parallel-replicated parameter (tensor/placement.py) by tensor-parallel rank 0 only; the other
copies are compared with the saved one (replica_checksums.py), buffers excepted. Names are the user's
``named_parameters()`` (a tied parameter under its first name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reshard import CheckpointError
from shardwise.parallel.data.replica_groups import get_replicas, has_replicas
from shardwise.parallel.flat import FlatLayout
from shardwise.parallel.moe.experts import global_names
from shardwise.parallel.tensor.placement import Placement, get_placement
from shardwise.parallel.zero.masters import shares_storage  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.topology import ProcessMesh

Box = tuple[tuple[int, int], ...]


@dataclass
class Slot:
    """One rank's optimizer-side part of one parameter (see the module docstring)."""

    name: str
    global_shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None  # None: the whole box, and ``owner`` is the parameter itself
    owner: torch.Tensor
    offset: int  # where the part starts in ``owner``'s flattening (flat slots)
    master: torch.Tensor | None
    save: bool
    packed: tuple[int, int] | None = None  # box and flat in the packed view (tensor/placement.py)

    @property
    def first(self) -> bool:
        """Holds the parameter's element (0, ..., 0): offers its scalar states."""
        at_zero = all(s == 0 for s, _ in self.box)
        return at_zero and (self.flat is None or self.flat[0] == 0)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` (shaped like ``owner``) that this slot covers."""
        if self.flat is None:
            return t
        return t.view(-1)[self.offset : self.offset + self.flat[1] - self.flat[0]]


@dataclass
class Layout:
    model: list[Piece]
    slots: list[Slot]

    def master_pieces(self) -> list[Piece]:
        return [
            Piece(
                f"master/{s.name}", s.global_shape, s.box, s.flat, s.master, s.save, packed=s.packed
            )
            for s in self.slots
            if s.master is not None
        ]

    def owners(self) -> list[torch.Tensor]:
        return list({id(s.owner): s.owner for s in self.slots}.values())


def _placement(p: torch.Tensor, shape: tuple[int, ...]) -> Placement:
    """The recorded placement, or the whole tensor of ``shape`` (a ZeRO-3 parameter's data is
    empty between uses, so its own shape says nothing)."""
    pl = get_placement(p)
    if pl.local_shape == tuple(shape):
        return pl
    return Placement(tuple(shape), tuple((0, n) for n in shape), True)


class _Namer:
    def __init__(self, module: nn.Module, mesh: ProcessMesh) -> None:
        # Experts under their single-process names (parallel/moe/experts.py).
        self.rename = global_names(module)
        self.names = {id(p): self.rename(n) for n, p in module.named_parameters()}
        self.dp_rank, self.tp0 = mesh.dp_cp_rank, mesh.tp_rank == 0  # context ranks: replicas
        self.topology = mesh.topology
        self.loads = {kind: [0] * mesh.topology.dp_cp for kind in ("model", "slot")}
        self.turns: dict[tuple[int, ...], int] = {}  # MiCS: pieces offered per set of holders

    def name(self, p: torch.Tensor) -> str:
        if id(p) not in self.names:
            raise CheckpointError(
                "the optimizer trains a tensor that is not a parameter of the model: "
                "checkpoints name every tensor by the model's named_parameters()"
            )
        return self.names[id(p)]

    def offers(
        self,
        pl: Placement,
        replicated_over_dp: bool,
        numel: int,
        kind: str,
        t: torch.Tensor,
        holders: tuple[int, ...] = (),
    ) -> bool:
        """This rank offers a piece of this placement (one rank per set of replicas); a DP
        replica goes to the data-parallel rank with the fewest elements of ``kind`` so far
        among those holding it (an expert: each expert-data group, in turn, so that every
        rank makes the same choices, data/replica_groups.py). A shard held by several data
        ranks (``holders``: MiCS replicas) goes to each of them in turn, counted among those
        holders only (they alone see that shard's pieces, so ``loads`` cannot be used)."""
        if not (self.tp0 or not pl.tp_replicated):
            return False
        if not replicated_over_dp and len(holders) > 1:
            turn = self.turns.get(holders, 0)
            self.turns[holders] = turn + 1
            return holders[turn % len(holders)] == self.dp_rank
        if not replicated_over_dp:
            return True
        loads, mine = self.loads[kind], False
        sets = [range(len(loads))]
        if has_replicas(t):  # data indices of each set of copies
            sets = [
                [self.topology.dp_cp_index(r) for r in rs] for rs in get_replicas(t, None, []).sets
            ]
        for holders in sets:
            owner = min(holders, key=loads.__getitem__)
            loads[owner] += numel
            mine = mine or owner == self.dp_rank
        return mine


def _whole_model(module: nn.Module, namer: _Namer, skip: set[int]) -> list[Piece]:
    """Parameters (not in ``skip``) and persistent buffers, whole, replicated over DP."""
    out = []
    persistent = set(module.state_dict(keep_vars=True))
    tensors = list(module.named_parameters()) + [
        (n, b) for n, b in module.named_buffers() if n in persistent
    ]
    params = {id(p) for p in module.parameters()}
    for name, t in tensors:
        if id(t) in skip:
            continue
        pl = get_placement(t)
        save = namer.offers(pl, True, t.numel(), "model", t)
        # A buffer's copies may differ by design (BatchNorm statistics): not compared.
        verify = id(t) in params
        out.append(
            Piece(
                f"model/{namer.rename(name)}",
                pl.global_shape,
                pl.box,
                None,
                t.data,
                save,
                verify,
                pl.packed,
            )
        )
    return out


def replicated_layout(module: nn.Module, optimizer: Optimizer, mesh: ProcessMesh) -> Layout:
    """Whole parameters on every data rank, the user's optimizer over them (plain data
    parallelism): each parameter and its states are offered by one data rank."""
    namer = _Namer(module, mesh)
    slots = []
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                pl = get_placement(p)
                name, save = namer.name(p), namer.offers(pl, True, p.numel(), "slot", p)
                slots.append(Slot(name, pl.global_shape, pl.box, None, p, 0, None, save, pl.packed))
    return Layout(_whole_model(module, namer, set()), slots)


@dataclass
class FlatShard:
    """This rank's shard ``part`` of one flat buffer (parallel/flat.py) whose optimizer state
    lives on ``master``. ``model``: the shard of the parameters themselves when they are
    sharded too (ZeRO-3), else None (whole parameters in the module). ``replicated``: every
    data rank holds the same shard (one part: 16-bit stage 0, a persistent ZeRO-3 unit)."""

    layout: FlatLayout
    part: int
    master: torch.Tensor
    separate: bool  # the master is its own storage (16-bit or offloaded), saved as "master/"
    replicated: bool
    model: torch.Tensor | None = None
    holders: tuple[int, ...] = ()  # MiCS: the data indices holding this same shard (one saves)


def flat_layout(module: nn.Module, mesh: ProcessMesh, shards: list[FlatShard]) -> Layout:
    """ZeRO: masters and states as flat shards of each buffer; the parameters as flat shards
    too where ``model`` is given, whole otherwise."""
    namer = _Namer(module, mesh)
    model, slots, managed = [], [], set()
    for sh in shards:
        lay = sh.layout
        found = _flat_slots(namer, lay, sh, () if sh.replicated else sh.holders)
        if sh.model is not None:
            managed.update(id(p) for p in lay.params)
            for s in found:  # the model shard covers exactly what the master shard does
                values = sh.model[s.offset : s.offset + s.flat[1] - s.flat[0]]
                piece = Piece(f"model/{s.name}", s.global_shape, s.box, s.flat, values, s.save)
                piece.packed = s.packed
                model.append(piece)
        slots += found
    return Layout(model + _whole_model(module, namer, managed), slots)


def _overlaps(
    offsets: list[int], numels: list[int], lo: int, hi: int
) -> list[tuple[int, int, int, int]]:
    """(param index, start in param, start in [lo, hi), length) of params laid at ``offsets``."""
    out = []
    for i, (a, n) in enumerate(zip(offsets, numels, strict=True)):
        start, end = max(a, lo), min(a + n, hi)
        if start < end:
            out.append((i, start - a, start - lo, end - start))
    return out


def _flat_slots(
    namer: _Namer, lay: FlatLayout, sh: FlatShard, holders: tuple[int, ...]
) -> list[Slot]:
    """Slots of the parameters overlapping shard ``sh.part`` of a flat buffer laid out by
    ``lay``, whose optimizer state lives on ``sh.master`` (this rank's shard)."""
    part, master, separate, replicated_over_dp = sh.part, sh.master, sh.separate, sh.replicated
    out = []
    numels = [math.prod(s) for s in lay.shapes]
    lo = part * lay.shard_numel
    for i, start, at, n in _overlaps(lay.offsets, numels, lo, lo + lay.shard_numel):
        pl = _placement(lay.params[i], tuple(lay.shapes[i]))
        values = master.detach()[at : at + n] if separate else None
        name, save = (
            namer.name(lay.params[i]),
            namer.offers(pl, replicated_over_dp, n, "slot", lay.params[i], holders),
        )
        flat = (start, start + n)
        out.append(Slot(name, pl.global_shape, pl.box, flat, master, at, values, save, pl.packed))
    return out


class LayoutSource(Protocol):
    """What ``layout_of`` asks of a gradient strategy: every strategy has it (the contract in
    parallel/strategy_contract.py, whose strategies build their layouts from this module)."""

    def checkpoint_layout(
        self, module: nn.Module, optimizer: Optimizer | None, mesh: ProcessMesh
    ) -> Layout:
        """What this rank holds, as checkpoint pieces and optimizer slots."""


def layout_of(
    module: nn.Module, optimizer: Optimizer, strategy: LayoutSource, mesh: ProcessMesh
) -> Layout:
    """The pieces this rank holds under ``strategy``: its ``checkpoint_layout`` (parallel/strategy_contract.py)."""
    return strategy.checkpoint_layout(module, optimizer, mesh)
