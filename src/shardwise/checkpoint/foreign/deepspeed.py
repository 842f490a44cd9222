"""A DeepSpeed checkpoint (one tag directory) read as a shardwise checkpoint.

``DeepSpeedReader(path)`` offers what ``CheckpointReader`` offers to ``reshard.plan`` and the
engine's load (``names``, ``pieces``, ``read``, ``meta``, ``rank_state``), so that
``engine.load_checkpoint`` loads a DeepSpeed checkpoint into any layout through the same
all-or-nothing path as its own. The files are read by safe_load.py (weights only, an
allow-list: nothing in them runs); tensors stay memory-mapped, so a rank reads only the bytes of
the pieces it fills. What maps to what (docs/checkpoint-deepspeed.md):

    module (model file)                      "model/<p>" (ZeRO-3: buffers; weights = masters)
    fp32 partitions / masters                "master/<p>"         deepspeed_optim.py
    base optimizer state                     "optim/<key>/<p>"    deepspeed_optim.py
    param_groups (lr, betas, ...)            meta["param_groups"]
    loss scaler (ZeRO / fp16 wrapper)        meta["loss_scaler"]
    global_steps, global_samples,            meta["counters"] (micro_steps = global_steps x
      skipped_steps                            gradient_accumulation_steps: a boundary)
    lr_scheduler                             rank state "lr_scheduler"
    every key the user passed as client_state  rank state "client_state"
    shared_params (tied weights)             meta["aliases"]
    mp_rank_MM files of tensor ranks MM      each rank's slices placed in whole tensors by the
                                               loading model's shapes (deepspeed_tp.py)

Everything is mapped when the reader is built: a file that cannot be mapped fully raises
``CheckpointError`` then, before an engine changes (``dropped`` lists what is ignored, and why).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardwise.checkpoint.foreign import deepspeed_optim as optim
from shardwise.checkpoint.foreign import deepspeed_tp as tp
from shardwise.checkpoint.foreign import deepspeed_universal as universal
from shardwise.checkpoint.foreign.deepspeed_files import DeepSpeedFiles, find
from shardwise.checkpoint.foreign.safe_load import load_pt
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reshard import PieceReader

# What DeepSpeed itself writes into a model file; every other key is the user's client_state.
DS_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params "
    "frozen_param_fragments lr_scheduler data_sampler random_ltd skipped_steps global_steps "
    "global_samples dp_world_size mp_world_size checkpoint_parallel_dimensions ds_config "
    "ds_version universal_checkpoint_info sparse_tensor_module_names".split()
)
IGNORED = {  # read and not loaded: why
    "data_sampler": "curriculum-learning sampler state: shardwise has no such sampler",
    "random_ltd": "random-LTD layer-drop schedule: shardwise has no random-LTD",
    "clip_grad": "gradient clipping comes from this run's config",
    "ds_config": "the saving run's config: this run's config decides",
}


def _shapes(groups: Any) -> list[dict[str, tuple[int, ...]]]:
    return [{k: tuple(int(n) for n in v) for k, v in g.items()} for g in groups or []]


def _mapped_shapes(optims: list[dict], module: dict) -> list[dict[str, tuple[int, ...]]]:
    """Names and shapes per group in flat order, from the partitions' ``param_slice_mappings``
    (the bf16 optimizer without ZeRO, as a bf16 pipeline runs it, saves no param_shapes)."""
    groups: list[dict[str, tuple[int, ...]]] = []
    for sd in optims:
        mappings = sd.get("optimizer_state_dict", {}).get("param_slice_mappings") or []
        for g, names in enumerate(mappings):
            if g == len(groups):
                groups.append({})
            for name in names:
                if name not in module:
                    raise CheckpointError(
                        f"parameter {name!r} of the optimizer files has no weights"
                    )
                groups[g].setdefault(name, tuple(module[name].shape))
    return groups


class DeepSpeedReader:
    """The checkpoint DeepSpeed saved in tag directory ``path`` (module docstring).
    ``param_order``: the parameter names of each optimizer group of the loading run, which
    names ZeRO-0's optimizer states (saved by index); default: the model's order.
    ``shapes``: the loading model's whole parameter shapes, which say how the slices of a
    tensor-parallel tag (mp_rank_00, mp_rank_01, ...) make whole tensors (deepspeed_tp.py)."""

    format = "deepspeed"

    def __init__(
        self,
        path: str,
        param_order: list[list[str]] | None = None,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.path = path
        self.tag = os.path.basename(os.path.normpath(path))
        files = find(path)
        self._models = {mp: [load_pt(f) for f in fs] for mp, fs in files.model.items()}
        main = self._main = self._models[0][0]
        if not isinstance(main, dict) or "global_steps" not in main:
            raise CheckpointError(f"{files.model[0][0]}: not a DeepSpeed model-state file")
        self._optims = {mp: [load_pt(f) for f in fs] for mp, fs in files.optim.items()}
        # A universal folder (ds_to_universal): whole tensors under zero/ instead of partitions
        self._universal = universal.global_state(path) if universal.is_universal(path) else None
        self.config = main.get("ds_config") if isinstance(main.get("ds_config"), dict) else {}
        self.stage, self.dropped = self._stage(), {}
        self.pipeline = self._stages(len(self._models), bool(files.layers))
        layers = {i: load_pt(f) for i, f in files.layers.items()}
        if self.tp == 1:
            pieces, mapped = self._mapped(sorted(self._models), layers, param_order, files)
        else:  # each tensor-parallel rank's slices alone, then placed in whole tensors
            per_rank = {m: self._mapped([m], layers, param_order, files) for m in self._models}
            pieces, notes = tp.merge({m: v[0] for m, v in per_rank.items()}, shapes, path)
            mapped, self.dropped = per_rank[0][1], {**self.dropped, **notes}
        self.kind = mapped.kind
        self._reader = PieceReader(pieces)
        self.meta = self._meta(mapped)
        for key in IGNORED:
            if main.get(key) is not None or (mapped.wrapper or {}).get(key) is not None:
                self.dropped[key] = IGNORED[key]

    # ---------------------------------------------------------------- the reader protocol

    def names(self) -> list[str]:
        return self._reader.names()

    def __contains__(self, name: str) -> bool:
        return name in self._reader.names()

    def pieces(self, name: str) -> list:
        if name not in self:
            raise CheckpointError(f"tensor {name!r} is not in the DeepSpeed checkpoint {self.path}")
        return self._reader.pieces(name)

    def read(self, piece: Any, index: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The saved tensor of ``piece``, or its part ``index`` (into ``out``, cast)."""
        return self._reader.read(piece, index, out)

    @property
    def world_size(self) -> int:
        return int(self._main.get("dp_world_size") or 1) * int(self._main.get("mp_world_size") or 1)

    def rank_state(self, rank: int) -> dict:
        """What every rank restores: DeepSpeed saves no random state nor data position."""
        client = {k: v for k, v in self._main.items() if k not in DS_KEYS}
        return {"client_state": client, "lr_scheduler": self._main.get("lr_scheduler")}

    def close(self) -> None:
        self._models, self._optims = {}, {}

    def __enter__(self) -> DeepSpeedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- mapping

    def _stage(self) -> int:
        if self._universal is not None:
            return int(self._universal.get("zero_stage") or 0)
        if not self._optims:
            return 0
        osd = self._optims[min(self._optims)][0].get("optimizer_state_dict", {})
        if "zero_stage" in osd:
            return int(osd["zero_stage"])
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

    def _stages(self, files: int, layers: bool) -> int:
        """The saving run's pipeline stages and tensor-parallel ranks (``self.tp``): one model
        file per stage or per tensor rank; both at once (pipeline + tensor) refused."""
        main = self._main
        dims = main.get("checkpoint_parallel_dimensions") or {}
        tp = int(dims.get("tp_degree") or (1 if layers else main.get("mp_world_size") or 1))
        pp = int(dims.get("pp_degree") or max(1, files // tp))
        self.tp = tp
        if tp > 1 and (pp > 1 or layers):
            raise CheckpointError(
                f"{self.path}: a pipeline of {pp} stages with tensor parallelism (tp_degree "
                f"{tp}): not mapped by shardwise yet; nothing was loaded"
            )
        if pp * tp != files:
            raise CheckpointError(
                f"{self.path}: {files} model-state files (mp_rank_XX) but the saving run had "
                f"{pp} pipeline stages x {tp} tensor ranks: files of two runs?"
            )
        return pp

    def _mapped(
        self, ranks: list[int], layers: dict, order: list[list[str]] | None, files: DeepSpeedFiles
    ) -> tuple[list[Piece], optim.Mapped]:
        """The pieces of model-parallel ranks ``ranks`` (pipeline stages merged, or one
        tensor-parallel rank's slices) and what their optimizer files gave."""
        module = self._module(layers, ranks)
        mapped = self._optimizer(module, order, files, ranks)
        pieces = self._model_pieces(module, ranks[0]) + mapped.pieces
        if self.stage < 3:
            optim.check_counts(mapped, {k: tuple(v.shape) for k, v in module.items()})
        return pieces, mapped

    def _module(self, layers: dict[int, dict], ranks: list[int]) -> dict[str, torch.Tensor]:
        """The model's tensors by name: the model files' ``module``, and a pipeline's layer
        files as "<layer index>.<key>" (its stages' parameter names)."""
        module, buffers = {}, set()
        for mp in ranks:
            main = self._models[mp][0]
            module.update(main.get("module") or {})
            buffers.update(main.get("buffer_names") or [])
        for index, state in sorted(layers.items()):
            module.update({f"{index}.{k}": v for k, v in state.items()})
        self._buffers = buffers
        if self.stage == 3:  # parameters are empty placeholders: the optimizer files hold them
            module = {k: v for k, v in module.items() if k in buffers}
        if not module and self.stage < 3:
            raise CheckpointError(f"{self.path}: the model files hold no weights")
        return module

    def _model_pieces(self, module: dict[str, torch.Tensor], mp: int) -> list[Piece]:
        out = []
        for name, t in module.items():
            if torch.is_tensor(t):
                shape = tuple(t.shape)
                out.append(Piece(f"model/{name}", shape, tuple((0, n) for n in shape), None, t))
        if self.stage == 3:
            out += self._frozen_zero3(mp)
        return out

    def _frozen_zero3(self, mp: int) -> list[Piece]:
        """ZeRO-3's frozen parameters: each rank's part, in the model file of that rank."""
        out = []
        world = len(self._models[mp])
        for rank, sd in enumerate(self._models[mp]):
            shapes = _shapes([sd.get("frozen_param_shapes") or {}])[0]
            for name, part in (sd.get("frozen_param_fragments") or {}).items():
                n = 1
                for d in shapes[name]:
                    n *= d
                size = -(-n // world)
                lo, hi = min(rank * size, n), min((rank + 1) * size, n)
                if lo < hi:
                    box = tuple((0, d) for d in shapes[name])
                    view = part.reshape(-1)[: hi - lo]
                    out.append(Piece(f"model/{name}", shapes[name], box, (lo, hi), view))
        return out

    def _optimizer(
        self, module: dict, order: list[list[str]] | None, files: DeepSpeedFiles, ranks: list[int]
    ) -> optim.Mapped:
        """Every stage's optimizer state (one stage without a pipeline), merged."""
        out, params = optim.Mapped(), [k for k in module if k not in self._buffers]
        if self._universal is not None:
            if self.pipeline > 1 or self.tp > 1:
                raise CheckpointError(
                    f"{self.path}: a universal folder of a pipeline or of tensor-parallel "
                    "ranks: not mapped"
                )
            shapes = _shapes(self._main.get("param_shapes"))
            return universal.mapped(self.path, self._universal, shapes, self.stage)
        if order is not None and self.pipeline > 1:
            order = None  # this run's groups name all stages: cut per stage below
        for mp in ranks:
            main, optims = self._models[mp][0], self._optims.get(mp, [])
            paths = files.optim.get(mp) or files.model[mp]
            if optims:
                shapes = _shapes(main.get("param_shapes")) or _mapped_shapes(optims, module)
                if not shapes:
                    raise CheckpointError(f"{paths[0]}: ZeRO files, but no param_shapes")
                mapping = optim.zero3 if self.stage == 3 else optim.zero12
                part = mapping(shapes, optims, paths)
            elif main.get("optimizer") is None:
                self.dropped["optimizer"] = "not in the checkpoint (saved without its states)"
                part = optim.Mapped(kind="none saved")
            else:
                saved = main["optimizer"]
                base = saved.get("optimizer_state_dict", saved)
                sizes = [len(g["params"]) for g in base["param_groups"]]
                mine, params = params[: sum(sizes)], params[sum(sizes) :]
                cut = [mine[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
                part = optim.plain(order or cut, {k: module[k] for k in module}, saved, paths[0])
            out.pieces += part.pieces
            out.param_groups = out.param_groups or part.param_groups
            out.wrapper, out.kind = out.wrapper or part.wrapper, part.kind
        return out

    def _meta(self, mapped: optim.Mapped) -> dict:
        main, cfg = self._main, self.config
        steps = int(main["global_steps"])
        gas = int(cfg.get("gradient_accumulation_steps") or 1)
        samples = main.get("global_samples")
        if samples is None:
            batch = cfg.get("train_batch_size")
            if batch is None:
                raise CheckpointError(f"{self.path}: no global_samples and no train_batch_size")
            samples = steps * int(batch)
        counters = {
            "micro_steps": steps * gas,
            "global_steps": steps,
            "global_samples": int(samples),
            "skipped_steps": int(main.get("skipped_steps") or 0),
        }
        meta: dict[str, Any] = {"counters": counters, "loss_scaler": self._scaler(mapped.wrapper)}
        if mapped.param_groups is not None:
            meta["param_groups"] = mapped.param_groups
        if main.get("shared_params"):
            meta["aliases"] = dict(main["shared_params"])
        return meta

    def _scaler(self, wrapper: dict | None) -> dict:
        """The loss scale in shardwise's terms (precision.LossScaler.state_dict)."""
        hysteresis = int((self.config.get("fp16") or {}).get("hysteresis", 2))
        out = {"scale": 1.0, "cur_hysteresis": hysteresis, "cur_iter": 0, "last_overflow_iter": -1}
        if wrapper is None:
            return out
        saved = wrapper.get("loss_scaler")
        if saved is not None:  # a ZeRO optimizer's LossScaler / DynamicLossScaler stand-in
            values = vars(saved)
            out["scale"] = float(values.get("cur_scale", 1.0))
            for key in ("cur_hysteresis", "cur_iter", "last_overflow_iter"):
                if key in values:
                    out[key] = int(values[key])
        elif "cur_scale" in wrapper:  # the fp16/bf16 ZeRO-0 wrapper's own keys
            out["scale"] = float(wrapper["cur_scale"])
            for key in ("cur_iter", "last_overflow_iter"):
                if key in wrapper and wrapper.get("dynamic_loss_scale"):  # static: never moves
                    out[key] = int(wrapper[key])
        return out

    def describe(self) -> dict[str, Any]:
        """The source layout and what a load takes from it (``shardwise checkpoint inspect``)."""
        main = self._main
        dims = main.get("checkpoint_parallel_dimensions") or {}
        cfg = self.config
        dtype = (
            "bfloat16"
            if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled")
            else ("float16" if (cfg.get("fp16") or {}).get("enabled") else "float32")
        )
        kind = "universal checkpoint" if self._universal is not None else "checkpoint"
        return {
            "notes": tp.describe(self.tp) if self.tp > 1 else {},
            "format": f"DeepSpeed {main.get('ds_version', '?')} {kind}",
            "layout": {
                "zero_stage": self.stage,
                "data_parallel": int(main.get("dp_world_size") or 1),
                "tensor_parallel": int(dims.get("tp_degree", main.get("mp_world_size") or 1)),
                "pipeline_parallel": self.pipeline,
                "weights_dtype": dtype,
                "optimizer": self.kind,
            },
            "dropped": dict(self.dropped),
        }
