"""The files of a DeepSpeed 0.19 checkpoint tag, as ``load_checkpoint`` resumes them at the same
data-parallel size: what one rank writes, as targets to fill and the dicts to save.

What DeepSpeed's loader reads (runtime/engine.py ``_load_checkpoint``, the optimizers'
``load_state_dict``) and this module writes, for ZeRO stage s on W data-parallel ranks:

    mp_rank_00_model_states.pt (s < 3, rank 0)    module (whole weights, model dtype),
    zero_pp_rank_D_mp_rank_00_model_states.pt      buffer_names, optimizer (s = 0), param_shapes,
      (s = 3, every rank D; parameters as empty     shared_params, frozen_param_* (s >= 2),
      placeholders, as DeepSpeed saves them)        lr_scheduler, counters, dp_world_size, ...,
                                                    and the client_state keys beside them
    [bf16_]zero_pp_rank_D_mp_rank_00_optim_states.pt (s >= 1, every rank D):
      ZeRO-1/2: ``single_partition_of_fp32_groups`` (rank D's flat fp32 partition per group,
        the final padding dropped), ``base_optimizer_state`` (the torch optimizer's state over
        the padded partitions), group/alignment paddings, partition counts;
      ZeRO-3: ``fp32_flat_groups`` (per sub-group, rank D's part of every parameter) and the
        torch optimizer's state over them; ``loss_scaler`` (see ``LOSS_SCALER``).

Which elements a partition holds is deepspeed_flat.py's arithmetic (the reader's, so shardwise
reads back what it writes). Everything is a plain dict, list, number, string, ``torch.Size``
or tensor, except ZeRO-3's ``loss_scaler``: DeepSpeed's ZeRO-3 loader assigns that entry
verbatim and calls its methods, so it must be DeepSpeed's ``LossScaler``; it is written *by
name* (a pickle global reference and the two attributes DeepSpeed's own file holds), without
importing DeepSpeed. ZeRO-1/2 files leave it out: their loader keeps its own scaler then,
which for fp32 and bf16 is the static scale 1 a checkpoint would hold.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.checkpoint.foreign import deepspeed_flat as flat
from shardwise.checkpoint.pieces import Piece

DS_VERSION = "0.19.0"  # the loader checks the version only against ZeRO-1's 0.3.17 break
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
Shapes = dict[str, tuple[int, ...]]


@dataclass
class Spec:
    """What the files describe: the layout, and the model and optimizer by name.

    ``groups``: per optimizer parameter group, its trained parameters' names and shapes in
    DeepSpeed's flat order (the model's); ``hyper``: the groups' hyper-parameters; ``frozen``:
    the other parameters; ``buffers`` the persistent buffers; ``aliases`` tied names;
    ``vector_keys`` the optimizer states shaped like their parameter (exp_avg, ...),
    ``scalar_keys`` the 0-dim ones (step)."""

    stage: int
    world: int
    dtype: torch.dtype
    groups: list[Shapes]
    hyper: list[dict]
    frozen: Shapes
    buffers: Shapes
    aliases: dict[str, str]
    vector_keys: list[str]
    scalar_keys: list[str]
    sub_group_size: int = 1_000_000_000
    clip: float = 0.0  # gradient_clipping, which ZeRO-1/2 files record
    steps: int = 0  # global steps: the 16-bit ZeRO-0 wrapper's cur_iter
    order: list[str] = field(default_factory=list)  # module state-dict key order
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # the buffers'

    @property
    def sixteen(self) -> bool:
        return self.dtype != torch.float32


def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


class RankFiles:
    """The files rank ``rank`` writes: ``targets`` to fill from a checkpoint reader
    (reshard.fill), then ``files(common)`` the dicts by file name; without ``optimizer``
    the model file alone."""

    def __init__(self, spec: Spec, rank: int, optimizer: bool = True) -> None:
        self.spec, self.rank = spec, rank
        self.targets: list[Piece] = []
        self.module: dict[str, torch.Tensor] = {}
        self.optim: dict[str, Any] | None = None
        writes_model = spec.stage == 3 or rank == 0
        if writes_model:
            self._module()
        if not optimizer:  # the model file alone (a universal folder's)
            return
        if spec.stage == 0:
            self.optim = self._zero0() if rank == 0 else None
        elif spec.stage < 3:
            self.optim = self._zero12()
        else:
            self.optim = self._zero3()

    def _target(self, name: str, shape: tuple, flat_range: Any, out: torch.Tensor) -> None:
        box = _whole(shape) if shape else ()
        self.targets.append(Piece(name, tuple(shape), box, flat_range, out))

    def _module(self) -> None:
        spec = self.spec
        params = {k: v for g in spec.groups for k, v in g.items()} | spec.frozen
        for name, shape in (params | spec.buffers).items():
            if spec.stage == 3 and name in params:
                self.module[name] = torch.empty(0, dtype=spec.dtype)  # DeepSpeed's placeholder
                continue
            dtype = spec.dtype if name in params else spec.dtypes.get(name, torch.float32)
            t = self.module[name] = torch.empty(shape, dtype=dtype)
            self._target(f"model/{name}", shape, None, t)
        self.frozen = {}
        for name, shape in spec.frozen.items():  # ZeRO-2/3 save them beside the module
            n = math.prod(shape)
            part = -(-n // spec.world) if spec.stage == 3 else n
            lo, hi = min(self.rank * part, n), min((self.rank + 1) * part, n)
            t = self.frozen[name] = torch.zeros(
                part if spec.stage == 3 else shape, dtype=spec.dtype
            )
            if lo < hi:
                self._target(f"model/{name}", shape, (lo, hi), t.reshape(-1)[: hi - lo])

    def _states(self, frags: list[flat.Fragment], length: int, first: str) -> tuple:
        """Master and state buffers of one flat partition, targets for its fragments."""
        master = torch.zeros(length)
        states: dict[str, torch.Tensor] = {k: torch.zeros(length) for k in self.spec.vector_keys}
        for f in frags:
            n, shape = f.hi - f.lo, f.shape
            self._target(f"master/{f.name}", shape, (f.lo, f.hi), master[f.at : f.at + n])
            for key, buf in states.items():
                self._target(f"optim/{key}/{f.name}", shape, (f.lo, f.hi), buf[f.at : f.at + n])
        for key in self.spec.scalar_keys:  # one value per group: its first parameter's
            t = states[key] = torch.zeros(())
            self._target(f"optim/{key}/{first}", (), None, t)
        return master, states

    def _zero12(self) -> dict:
        spec, w = self.spec, self.spec.world
        masters, state, paddings = [], {}, []
        for g, shapes in enumerate(spec.groups):
            n = flat.group_numel(shapes, None)
            align = 2 * w  # DeepSpeed's nccl_start_alignment_factor (2) x world
            size = -(-n // align) * align // w
            frags = flat.zero12_fragments(shapes, None, size, self.rank)
            master, state[g] = self._states(frags, size, next(iter(shapes)))
            pad = size * w - n if self.rank == w - 1 else 0  # the padding: the last rank's
            masters.append(master[: size - pad])
            paddings.append(pad)
        base = {"state": state, "param_groups": self._param_groups(range(len(spec.groups)))}
        return {
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": float(spec.clip),
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": masters,
            "zero_stage": spec.stage,
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(s) for s in spec.groups],
            "partition_count": [w] * len(spec.groups),
            "ds_version": DS_VERSION,
        }

    def sub_groups(self) -> list[tuple[int, Shapes]]:
        """(parameter group, shapes) of each ZeRO-3 sub-group, cut as DeepSpeed cuts a group:
        parameters in order until their partitions reach ``sub_group_size`` elements."""
        out, w = [], self.spec.world
        for g, shapes in enumerate(self.spec.groups):
            parts = {k: -(-math.prod(s) // w) for k, s in shapes.items()}
            if self.spec.sub_group_size >= sum(parts.values()):
                out.append((g, dict(shapes)))
                continue
            current: Shapes = {}
            for name, shape in shapes.items():
                current[name] = shape
                if sum(parts[k] for k in current) >= self.spec.sub_group_size:
                    out.append((g, current))
                    current = {}
            if current:
                out.append((g, current))
        return out

    def _zero3(self) -> dict:
        subs = self.sub_groups()
        masters, state = [], {}
        for i, (_, shapes) in enumerate(subs):
            frags = flat.zero3_fragments(shapes, self.spec.world, self.rank)
            length = flat.zero3_numel(shapes, self.spec.world)
            master, state[i] = self._states(frags, length, next(iter(shapes)))
            masters.append(master)
        members = [
            [i for i, (g, _) in enumerate(subs) if g == group]
            for group in range(len(self.spec.groups))
        ]
        groups = [h | {"params": m} for h, m in zip(self.spec.hyper, members, strict=True)]
        return {
            "zero_stage": 3,
            "loss_scaler": ByName(*LOSS_SCALER, {"cur_scale": 1.0, "dynamic": False}),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": self.spec.world,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": masters,
        }

    def _param_groups(self, members: Any) -> list[dict]:
        return [h | {"params": [g]} for h, g in zip(self.spec.hyper, members, strict=True)]

    def _zero0(self) -> dict:
        """The torch optimizer's own state dict (by parameter index), inside the unfused
        16-bit wrapper's dict (its fp32 masters per parameter) in bf16."""
        spec = self.spec
        state, masters, groups, index = {}, [], [], 0
        for g, shapes in enumerate(spec.groups):
            masters.append([])
            groups.append(spec.hyper[g] | {"params": list(range(index, index + len(shapes)))})
            for name, shape in shapes.items():
                entry = state[index] = {}
                for key in spec.vector_keys:
                    t = entry[key] = torch.zeros(shape)
                    self._target(f"optim/{key}/{name}", shape, None, t)
                for key in spec.scalar_keys:
                    t = entry[key] = torch.zeros(())
                    self._target(f"optim/{key}/{name}", (), None, t)
                if spec.sixteen:
                    masters[g].append(torch.zeros(shape))
                    self._target(f"master/{name}", shape, None, masters[g][-1])
                index += 1
        inner = {"state": state, "param_groups": groups}
        if not spec.sixteen:
            return inner
        return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": spec.steps,
                "optimizer_state_dict": inner, "fp32_groups": masters}  # fmt: skip

    def files(self, common: dict[str, Any], client: dict[str, Any]) -> dict[str, dict]:
        """File name -> the dict to save. ``common``: counters, scheduler and config entries
        of the model file (the caller's), ``client``: the user's client_state."""
        spec, out = self.spec, {}
        zero = spec.stage >= 1
        if self.module:
            module = OrderedDict((k, self.module[k]) for k in spec.order if k in self.module)
            module.update((k, v) for k, v in self.module.items() if k not in module)
            for alias, name in spec.aliases.items():  # state_dict() holds both names
                module[alias] = module[name]
            frozen = spec.stage >= 2
            model = {
                "module": module,
                "buffer_names": list(spec.buffers),
                "optimizer": self.optim if spec.stage == 0 else None,
                "param_shapes": [
                    OrderedDict((k, torch.Size(s)) for k, s in g.items()) for g in spec.groups
                ]
                if zero
                else None,
                "frozen_param_shapes": OrderedDict(
                    (k, torch.Size(s)) for k, s in spec.frozen.items()
                )
                if frozen
                else None,
                "shared_params": dict(spec.aliases) if zero else None,
                "frozen_param_fragments": OrderedDict(self.frozen) if frozen else None,
            } | common
            model.update(client)
            name = "mp_rank_00_model_states.pt"
            out[f"zero_pp_rank_{self.rank}_{name}" if spec.stage == 3 else name] = model
        if zero and self.optim is not None:
            prefix = "bf16_" if spec.dtype == torch.bfloat16 else ""
            optim = {"optimizer_state_dict": self.optim, "ds_config": common["ds_config"],
                     "ds_version": DS_VERSION}  # fmt: skip
            out[f"{prefix}zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"] = optim
        return out


# ------------------------------------------------------------------ writing a file


class ByName:
    """An object pickled as an instance of the class ``module.name`` (called with no
    arguments, then given ``state``) without importing ``module`` (module docstring)."""

    def __init__(self, module: str, name: str, state: dict[str, Any]) -> None:
        self.module, self.name, self.state = module, name, state


class _Ref:
    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self) -> None:  # pickle asks that a reduce function be callable
        raise TypeError("a pickle reference, not a function")


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
    dispatch = dict(pickle._Pickler.dispatch)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ByName):
            return _Ref(obj.module, obj.name), (), dict(obj.state)
        return NotImplemented

    def _save_ref(self, ref: _Ref) -> None:
        if self.proto >= 4:
            self.save(ref.module)
            self.save(ref.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode())
        self.memoize(ref)

    dispatch[_Ref] = _save_ref


class _PickleModule:
    """What torch.save asks of a pickle module, with the pickler above."""

    __name__ = "pickle"
    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    load, loads, dump, dumps = pickle.load, pickle.loads, pickle.dump, pickle.dumps


def write(obj: dict[str, Any], path: str) -> None:
    """``torch.save`` of ``obj`` into ``path`` (atomically: a reader never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_PickleModule)
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
