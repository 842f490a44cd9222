"""``save_checkpoint(..., format=...)`` into another framework's format, from any layout.

Every rank first writes shardwise's own checkpoint into a staging directory beside the target
(``<save_dir>/.<tag>.staging``, removed afterwards), then reads from it, through the
resharding reader, exactly the elements its files of the other format hold: the format's
partitions need not match this run's (another ZeRO flat layout, tensor-parallel pieces), and
no rank ever holds more than its own files. Formats:

    deepspeed   checkpoint/foreign/deepspeed_write.py: what DeepSpeed 0.19's
                ``load_checkpoint`` resumes at the same data-parallel size
    deepspeed-universal  checkpoint/foreign/deepspeed_universal_write.py: the universal
                folder DeepSpeed 0.19 loads at any data-parallel size (``load_universal``);
                ``latest_universal`` names it, as ``ds_to_universal`` does
    dcp         checkpoint/foreign/dcp_write.py: a torch.distributed.checkpoint directory
                with torchtitan's keys, written by torch's own ``dcp.save``

Stored as shardwise's own saves are (save.py takes the directory's lock and refuses later
steps first): the files go into the hidden ``.<tag>.tmp-<nonce>``, which rank 0 renames into
place once every rank has written (storage.install), with ``shardwise_save.json`` (format,
step) for ``keep_last`` rotation (rotation.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.checkpoint import rotation, storage
from shardwise.checkpoint.foreign import dcp_write
from shardwise.checkpoint.foreign import deepspeed_universal_write as dsu
from shardwise.checkpoint.foreign import deepspeed_write as dsw
from shardwise.checkpoint.foreign.deepspeed import DS_KEYS
from shardwise.checkpoint.gather import all_gather_json, broadcast_json
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.reshard import fill
from shardwise.checkpoint.tags import LATEST_UNIVERSAL
from shardwise.precision import compute_dtype
from shardwise.training.checkpoints.held import layout, tied_aliases

if TYPE_CHECKING:  # annotations only
    from shardwise.training.parts import TrainParts

FORMATS = ("shardwise", "deepspeed", "deepspeed-universal", "dcp")
DEEPSPEED = ("deepspeed", "deepspeed-universal")


def check_format(fmt: str, async_save: bool) -> None:
    """Refuse a format shardwise does not write, and an asynchronous save of another's."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: not a checkpoint format shardwise writes; choose one of {', '.join(FORMATS)}")  # fmt: skip
    if fmt != "shardwise" and async_save:
        raise ValueError(
            f"async_save=True with format={fmt!r}: only shardwise's own format is written in the "
            "background; save with async_save=False"
        )


@contextmanager
def staged(save_dir: str, tag: str, contents: tuple, step: int) -> Iterator[CheckpointReader]:
    """shardwise's own checkpoint of ``contents`` (pieces, rank state, meta), in a staging
    directory, open for every rank; removed when the block ends (module docstring)."""
    staging = os.path.join(save_dir, f".{tag}.staging")
    if comm.get_rank() == 0 and os.path.isdir(staging):
        shutil.rmtree(staging)  # a crashed save's leftovers
    plan = storage.begin_save(staging, "staged", step=step, allow_newer=True)
    storage.finish_save(plan, *contents, save_latest=False)
    reader = CheckpointReader(os.path.join(staging, "staged"), verify=False)
    try:
        yield reader
    finally:
        reader.close()
        comm.barrier()  # every rank has read its part
        if comm.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)


def save_foreign(
    parts: TrainParts,
    fmt: str,
    plan: storage.SavePlan,
    contents: tuple,
    client_state: dict | None,
    save_latest: bool,
) -> bool:
    """Write ``plan``'s tag in format ``fmt`` (module docstring); every rank calls it after
    ``storage.begin_save`` (the directory's lock, no newer steps there). The files go into the
    plan's hidden directory; once every rank has written, rank 0 adds the step marker
    (rotation.MARKER) and installs it as shardwise's own saves are installed (atomic rename,
    ``latest``, ``keep_last`` rotation); a failure on any rank leaves the directory as it was."""
    if fmt in DEEPSPEED:  # refusals before anything is written
        check_deepspeed(parts, fmt)
        client = _client(client_state)
    step = int(parts.counters.global_steps)
    failure: BaseException | None = None
    try:
        with staged(plan.save_dir, plan.tag, contents, step) as reader:
            spec = deepspeed_spec(parts, reader) if fmt in DEEPSPEED else None
            if fmt == "deepspeed-universal":
                dsu.check(spec)
            os.makedirs(plan.tmp, exist_ok=True)
            if fmt == "deepspeed":
                _write_deepspeed(parts, spec, reader, plan.tmp, client)
            elif fmt == "deepspeed-universal":
                _write_universal(parts, spec, reader, plan.tmp, client)
            else:
                _write_dcp(parts, reader, plan.tmp)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather, or the others hang
        failure = e
    _publish(plan, fmt, step, save_latest, failure)
    return True


def _publish(
    plan: storage.SavePlan, fmt: str, step: int, save_latest: bool, failure: BaseException | None
) -> None:
    """Rank 0 installs the hidden directory once every rank has written; all raise if any
    rank failed (this rank's own error first)."""
    mine = "" if failure is None else f"rank {comm.get_rank()}: {type(failure).__name__}: {failure}"
    errors = [e for e in all_gather_json(mine) if e]
    status = ""
    if comm.get_rank() == 0:
        try:
            if errors:
                shutil.rmtree(plan.tmp, ignore_errors=True)
            else:
                with open(os.path.join(plan.tmp, rotation.MARKER), "wb") as f:
                    f.write(rotation.marker(fmt, step))
                universal = fmt == "deepspeed-universal"
                latest = LATEST_UNIVERSAL if universal else storage.LATEST
                storage.install(plan.save_dir, plan.tag, plan.tmp, latest if save_latest else None,
                                plan.keep_last, plan.step)  # fmt: skip
        except OSError as e:
            status = f"{type(e).__name__}: {e}"
    status = broadcast_json(status)
    if failure is not None:
        raise failure
    if errors or status:
        raise CheckpointError(
            f"checkpoint {plan.tag!r} in {plan.save_dir} not saved: {'; '.join(errors) or status}"
        )


def _write_dcp(parts: TrainParts, reader: CheckpointReader, path: str) -> None:
    """This rank's share of the tensors, whole, and rank 0's objects, through ``dcp.save``."""
    rank, world = comm.get_rank(), comm.get_world_size()
    tensors, targets = dcp_write.targets(reader, rank, world)
    fill(reader, targets)
    objects = None
    opt = parts.optimizer
    names = [n for n, _ in parts.module.named_parameters()]
    groups = _group_names(parts, names) if opt is not None else []  # collective: every rank
    if rank == 0:
        hyper = [
            {k: v for k, v in g.items() if k != "params"} for g in (opt.param_groups if opt else [])
        ]
        sched = parts.lr_scheduler
        objects = {
            "param_groups": [h | {"params": g} for h, g in zip(hyper, groups, strict=True)],
            "lr_scheduler": sched.state_dict() if sched is not None else {},
            "train_state": {"step": int(parts.counters.global_steps)},
        }
    dcp_write.write(dcp_write.state_dict(tensors, objects), path)


# ------------------------------------------------------------------ DeepSpeed


def check_deepspeed(parts: TrainParts, fmt: str = "deepspeed") -> None:
    """Refuse the layouts this writer does not produce."""
    topo = parts.mesh.topology
    zero = parts.config.zero_optimization
    if fmt == "deepspeed-universal" and zero.stage == 0:
        raise ValueError(
            "format='deepspeed-universal' needs ZeRO stage 1-3: DeepSpeed loads universal "
            "folders into its ZeRO optimizers only; save with format='deepspeed' at stage 0"
        )
    if (topo.tp, topo.pp, topo.cp) != (1, 1, 1):
        raise ValueError(
            f"format='deepspeed' writes data-parallel layouts (ZeRO 0-3) only; this run has "
            f"tp={topo.tp}, pp={topo.pp}, cp={topo.cp}: save in shardwise's format and load it "
            "into a data-parallel engine first"
        )
    if compute_dtype(parts.config) == torch.float16:
        raise ValueError(
            f"format={fmt!r} writes fp32 and bf16 runs; fp16 is refused (DeepSpeed 0.19 runs "
            "fp16 on GPUs only, so its dynamic loss scale could not be checked against it here; "
            "save in shardwise's format, which keeps it)"
        )
    if parts.optimizer is None:
        raise ValueError("format='deepspeed' needs an optimizer: DeepSpeed's files hold its state")
    for key in ("round_robin_gradients", "parameter_alignment"):  # DeepSpeed reorders or pads
        if getattr(zero, key):  # its flat groups then: the layout written here would not fit
            raise ValueError(
                f"format='deepspeed' writes DeepSpeed's flat layout with zero_optimization.{key} "
                "false (its default) only; save with it false on both sides"
            )


def deepspeed_spec(parts: TrainParts, reader: CheckpointReader) -> dsw.Spec:
    """The layout and names DeepSpeed's files describe (deepspeed_write.Spec): global shapes
    and dtypes from the staged checkpoint, the optimizer groups from the engine."""
    cfg, names = parts.config, reader.names()
    model = {n[6:]: reader.pieces(n)[0] for n in names if n.startswith("model/")}
    named = [n for n, _ in parts.module.named_parameters()]
    groups = _group_names(parts, named)
    trained = {n for g in groups for n in g}
    keys: dict[bool, list[str]] = {True: [], False: []}  # scalar? -> optimizer state keys
    for n in names:
        if n.startswith("optim/"):
            scalar = reader.pieces(n)[0].global_shape == ()
            keys[scalar] += [] if n.split("/")[1] in keys[scalar] else [n.split("/")[1]]
    shape = {n: tuple(p.global_shape) for n, p in model.items()}
    return dsw.Spec(
        stage=cfg.zero_optimization.stage,
        world=parts.mesh.topology.dp,
        dtype=compute_dtype(cfg),
        groups=[{n: shape[n] for n in g} for g in groups],
        hyper=[{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups],
        frozen={n: shape[n] for n in named if n not in trained and n in shape},
        buffers={n: shape[n] for n in model if n not in named},
        aliases=tied_aliases(parts.module, {f"model/{n}" for n in model}),
        vector_keys=keys[False],
        scalar_keys=keys[True],
        sub_group_size=cfg.zero_optimization.sub_group_size,
        clip=float(cfg.gradient_clipping),
        steps=int(parts.counters.global_steps),
        order=list(parts.module.state_dict(keep_vars=True)),
        dtypes={n: p.dtype for n, p in model.items() if n not in named},
    )


def _group_names(parts: TrainParts, named: list[str]) -> list[list[str]]:
    """The parameter names of each optimizer group, in the model's order: every rank tells
    which group steps each parameter part it holds (a ZeRO rank holds some only)."""
    opt = parts.optimizer
    group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    mine = {s.name: group_of[id(s.owner)] for s in layout(parts).slots if id(s.owner) in group_of}
    every: dict[str, int] = {}
    for part in all_gather_json(mine):
        every.update(part)
    order = named + sorted(n for n in every if n not in named)
    return [[n for n in order if every.get(n) == g] for g in range(len(opt.param_groups))]


def _client(client_state: dict | None) -> dict[str, Any]:
    client = dict(client_state or {})
    taken = sorted(set(client) & DS_KEYS)
    if taken:
        raise ValueError(
            f"client_state key {taken[0]!r} is one DeepSpeed's model file uses itself; "
            "rename it (format='deepspeed' writes client_state beside DeepSpeed's keys)"
        )
    return client


def _common(parts: TrainParts, spec: dsw.Spec) -> dict[str, Any]:
    """The model file's counters, scheduler and config entries."""
    counters, cfg, batch = parts.counters, parts.config, parts.batch
    sched = parts.lr_scheduler
    ds_config = {
        "train_batch_size": batch.train_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": float(cfg.gradient_clipping),
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == torch.bfloat16},
    }
    return {
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters.skipped_steps),
        "global_steps": int(counters.global_steps),
        "global_samples": int(counters.global_samples),
        "dp_world_size": spec.world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config,
        "ds_version": dsw.DS_VERSION,
    }


def _write_deepspeed(
    parts: TrainParts, spec: dsw.Spec, reader: CheckpointReader, path: str, client: dict
) -> None:
    """This rank's DeepSpeed files, filled from the staged checkpoint."""
    names = set(reader.names())
    rank_files = dsw.RankFiles(spec, comm.get_rank())
    for t in rank_files.targets:  # fp32 training keeps no separate masters: the weights are
        if t.name.startswith("master/") and t.name not in names:
            t.name = "model/" + t.name[7:]
    fill(reader, rank_files.targets)
    for name, obj in rank_files.files(_common(parts, spec), client).items():
        dsw.write(obj, os.path.join(path, name))


def _write_universal(
    parts: TrainParts, spec: dsw.Spec, reader: CheckpointReader, path: str, client: dict
) -> None:
    """This rank's parameter folders, and rank 0's model file and global state."""
    rank, world = comm.get_rank(), comm.get_world_size()
    names = set(reader.names())
    folders = dsu.ParamFiles(spec, rank, world)
    targets = list(folders.targets)
    if rank == 0:
        model = dsw.RankFiles(spec, 0, optimizer=False)
        first = next(n for g in spec.groups for n in g)
        step = torch.zeros(())
        targets += model.targets
        if "step" in spec.scalar_keys:
            targets.append(Piece(f"optim/step/{first}", (), (), None, step))
    for t in targets:  # fp32 training keeps no separate masters: the weights are
        if t.name.startswith("master/") and t.name not in names:
            t.name = "model/" + t.name[7:]
    fill(reader, targets)
    files = folders.files()
    if rank == 0:
        (model_file,) = model.files(_common(parts, spec), client).values()
        files[dsu.model_file_name(spec)] = model_file
        files[f"{dsu.ZERO}/optimizer_state.pt"] = dsu.global_state(spec, float(step))
    dsu.makedirs(path, files)
    for name, obj in files.items():
        dsw.write(obj, os.path.join(path, name))
