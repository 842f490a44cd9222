"""The engine's checkpoint calls (DeepSpeed's names and meaning), over any layout.

save_checkpoint: every rank offers the pieces of its layout (layouts.py: model weights, fp32
masters, optimizer states), its per-rank state (random generators, data position) and, on
rank 0, the shared state (LR scheduler, ``client_state``); the counters, loss scaler, optimizer
hyper-parameters and layout go to the JSON metadata. Storage (files, manifest, atomicity,
``latest``, rotation) is shardwise.checkpoint.storage; the config's ``checkpoint`` block gives
it ``keep_last`` and ``tag_validation`` (config/checkpoint.py).

Before anything is written the storage takes the save directory's lock and refuses a
directory holding checkpoints of later steps than this engine's (rotation.py), unless this
engine loaded a checkpoint of that directory or the config says ``overwrite_newer``; replicated
tensors are compared across their copies (replicas.py).

load_checkpoint: engine_load.py (all or nothing).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from shardwise import comm
from shardwise.checkpoint import storage
from shardwise.checkpoint.async_save import SaveHandle
from shardwise.checkpoint.engine_load import COUNTERS, LOADED_FROM, load_checkpoint  # noqa: F401
from shardwise.checkpoint.export import MODEL
from shardwise.checkpoint.layouts import Layout, layout_of
from shardwise.checkpoint.optim_state import groups_to_json, optim_pieces
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.rank_state import data_state, rng_state
from shardwise.checkpoint.reshard import CheckpointError, PieceReader, fill, plain_pieces
from shardwise.parallel.moe.experts import every_expert_name, global_names
from shardwise.precision import compute_dtype

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.reader import CheckpointReader
    from shardwise.engine import Engine

logger = logging.getLogger("shardwise")


def layout(engine: Engine) -> Layout:
    """What this rank of ``engine`` holds, as checkpoint pieces (layouts.py)."""
    return layout_of(engine.module, engine.optimizer, engine.strategy, engine.mesh)


def frozen_names(engine: Engine) -> set[str]:
    return {f"{MODEL}{n}" for n, p in engine.module.named_parameters() if not p.requires_grad}


def engine_pieces(engine: Engine) -> list[Piece]:
    """Every piece this rank holds: weights, fp32 masters, optimizer states."""
    lay = layout(engine)
    pieces = lay.model + lay.master_pieces()
    if engine.optimizer is not None:
        pieces += optim_pieces(lay, engine.optimizer)
    return pieces


def save_checkpoint(
    engine: Engine,
    save_dir: str,
    tag: str | int | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    async_save: bool = False,
) -> bool | SaveHandle:
    """Write ``save_dir/<tag>`` (default tag ``global_step<N>``); every rank must call it.
    With ``async_save``: the handle of a save written in the background (async_save.py)."""
    if engine.autosave.writer is not None:
        engine.autosave.writer.wait()  # at most one save in flight, a blocking one included
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    lay = layout(engine)
    pieces = lay.model + lay.master_pieces()
    if exclude_frozen_parameters:
        frozen = frozen_names(engine)
        pieces = [p for p in pieces if p.name not in frozen]
    if engine.optimizer is not None:
        pieces += optim_pieces(lay, engine.optimizer)
    pieces = plain_pieces(pieces)  # packed tensors (q|k|v) as plain boxes: any layout reads them
    rank_state: dict[str, Any] = {"rng": rng_state(), "data": data_state(engine)}
    if engine.global_rank == 0:
        sched = engine.lr_scheduler
        rank_state["lr_scheduler"] = sched.state_dict() if sched is not None else None
        rank_state["client_state"] = dict(client_state or {})
    options = engine.config.checkpoint
    meta = _meta(engine)
    meta["aliases"] = tied_aliases(engine.module, {p.name for p in lay.model})
    loaded_here = getattr(engine, LOADED_FROM, None) == os.path.abspath(save_dir)
    plan = storage.begin_save(
        save_dir,
        tag,
        keep_last=options.keep_last,
        tag_validation=options.tag_validation,
        step=int(engine.global_steps),
        allow_newer=options.overwrite_newer or loaded_here,
    )
    if async_save:
        writer = engine.autosave.writer_for(engine.mesh)
        return writer.submit(plan, pieces, rank_state, meta, save_latest)
    storage.finish_save(plan, pieces, rank_state, meta, save_latest=save_latest)
    return True


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


def _meta(engine: Engine) -> dict[str, Any]:
    topo = engine.mesh.topology
    opt = engine.optimizer
    return {
        "layout": {
            "dp": topo.dp,
            "tp": topo.tp,
            "pp": topo.pp,
            "cp": topo.cp,
            "zero_stage": engine.zero_optimization_stage(),
            "dtype": str(compute_dtype(engine.config)).removeprefix("torch."),
        },
        "counters": engine.counters.state_dict(),
        "loss_scaler": engine.scaler.state_dict(),
        "param_groups": groups_to_json(opt) if opt is not None else None,
    }


def _load_model(engine: Engine, reader: CheckpointReader, lay: Layout, strict: bool) -> None:
    """Weights and masters; frozen parameters absent from the checkpoint (saved with
    exclude_frozen_parameters) keep their values. ``strict`` also refuses saved weights this
    model has no place for."""
    targets = lay.model + lay.master_pieces()
    frozen = frozen_names(engine)
    fill(reader, targets, strict=strict, optional=lambda name: name in frozen)
    if strict:
        check_unexpected(engine, reader)


def check_unexpected(engine: Engine, reader: CheckpointReader) -> None:
    """Refuse saved weights this model has no place for (with one pipeline stage: a stage
    holds part of the names, so nothing is refused)."""
    if engine.mesh.topology.pp != 1:
        return
    module = engine.module
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


def load_module_state_dict(engine: Engine, state_dict: dict, strict: bool = True) -> None:
    """Load a whole-model state dict (the user's keys) into any layout; fp32 masters follow."""
    _load_model(engine, PieceReader.from_state_dict(state_dict), layout(engine), strict)


def save_16bit_model(
    engine: Engine,
    save_dir: str,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the consolidated model state dict (the model's dtype, the user's keys) to
    ``save_dir/save_filename``. Every rank must call it (ZeRO-3 gathers); rank 0 writes.

    The file is what its name promises, as DeepSpeed writes it: a ``torch.save`` state dict
    for the default ``pytorch_model.bin`` (safe to write; shardwise itself never reads a
    pickle), a safetensors file for a name ending in ``.safetensors``. Tied weights keep both
    names (as ``model.state_dict()`` has them; in safetensors as two copies, since a file
    cannot alias). A Hugging Face model's ``config.json`` is written beside it, so that
    ``from_pretrained(save_dir)`` loads the result (the module's ``config``, or the
    ``hf_config`` a pipeline cut from a Hugging Face model carries).
    """
    state = engine.consolidated_state_dict()
    if exclude_frozen_parameters:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    if engine.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _write_state(state, os.path.join(save_dir, save_filename))
        for attr in ("config", "hf_config"):
            hf_config = getattr(engine.module, attr, None)
            if hasattr(hf_config, "save_pretrained"):
                hf_config.save_pretrained(save_dir)
                break
    comm.barrier()
    return True


def _write_state(state: dict[str, Any], path: str) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if path.endswith(".safetensors"):
        # One storage per name: safetensors refuses tensors that share memory (tied weights).
        copies, seen = {}, set()
        for k, v in state.items():
            ptr = v.untyped_storage().data_ptr()
            copies[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(copies, tmp, metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)
