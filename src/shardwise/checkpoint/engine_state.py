"""The engine's checkpoint calls (DeepSpeed's names and meaning), over any layout.

save_checkpoint: every rank offers the pieces of its layout (layouts.py: model weights, fp32
masters, optimizer states), its per-rank state (random generators, data position) and, on
rank 0, the shared state (LR scheduler, ``client_state``); the counters, loss scaler, optimizer
hyper-parameters and layout go to the JSON metadata. Storage (files, manifest, atomicity,
``latest``, rotation) is shardwise.checkpoint.storage; the config's ``checkpoint`` block gives
it ``keep_last`` and ``tag_validation`` (config/checkpoint.py).

load_checkpoint, in this order, each step as DeepSpeed decides what it skips:

    model weights and fp32 masters       always (masters from "master/<p>", else the weights)
    optimizer states, hyper-parameters,  unless load_optimizer_states=False or load_module_only
      loss scaler
    LR scheduler                         unless load_lr_scheduler_states=False or load_module_only
    global_steps, global_samples,        unless load_module_only
      skipped_steps, micro_steps
    data loader position, random state   unless load_module_only (random state last: nothing
                                         after it draws)

Every piece is read from whatever layout wrote it (reshard.py): a ZeRO-3 checkpoint of 4 ranks
loads into one process and the reverse. Returns ``(load_path, client_state)``, or
``(None, None)`` when there is no ``latest`` and no tag (with a warning, as DeepSpeed).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shardwise import comm
from shardwise.checkpoint import storage
from shardwise.checkpoint.export import MODEL
from shardwise.checkpoint.layouts import Layout, layout_of
from shardwise.checkpoint.optim_state import (
    groups_from_json,
    groups_to_json,
    optim_pieces,
    optim_targets,
)
from shardwise.checkpoint.rank_state import (
    data_state,
    rng_state,
    set_data_state,
    set_rng_state,
    source_rank,
)
from shardwise.checkpoint.reshard import CheckpointError, PieceReader, fill, plain_pieces
from shardwise.precision import compute_dtype

logger = logging.getLogger("shardwise")

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def _layout(engine: Any) -> Layout:
    return layout_of(engine.module, engine.optimizer, engine.strategy, engine.mesh)


def _frozen(engine: Any) -> set[str]:
    return {f"{MODEL}{n}" for n, p in engine.module.named_parameters() if not p.requires_grad}


def save_checkpoint(
    engine: Any,
    save_dir: str,
    tag: Any = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write ``save_dir/<tag>`` (default tag ``global_step<N>``); every rank must call it."""
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    layout = _layout(engine)
    pieces = layout.model + layout.master_pieces()
    if exclude_frozen_parameters:
        frozen = _frozen(engine)
        pieces = [p for p in pieces if p.name not in frozen]
    if engine.optimizer is not None:
        pieces += optim_pieces(layout, engine.optimizer)
    pieces = plain_pieces(pieces)  # packed tensors (q|k|v) as plain boxes: any layout reads them
    rank_state: dict[str, Any] = {"rng": rng_state(), "data": data_state(engine)}
    if engine.global_rank == 0:
        sched = engine.lr_scheduler
        rank_state["lr_scheduler"] = sched.state_dict() if sched is not None else None
        rank_state["client_state"] = dict(client_state or {})
    options = engine.config.checkpoint
    meta = _meta(engine)
    meta["aliases"] = tied_aliases(engine.module, {p.name for p in layout.model})
    storage.save_pieces(
        save_dir,
        tag,
        pieces,
        rank_state,
        meta,
        save_latest=save_latest,
        keep_last=options.keep_last,
        tag_validation=options.tag_validation,
    )
    return True


def tied_aliases(module: Any, saved: set[str]) -> dict[str, str]:
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


def _meta(engine: Any) -> dict[str, Any]:
    topo = engine.mesh.topology
    opt = engine.optimizer
    return {
        "layout": {
            "dp": topo.dp,
            "tp": topo.tp,
            "pp": topo.pp,
            "zero_stage": engine.zero_optimization_stage(),
            "dtype": str(compute_dtype(engine.config)).removeprefix("torch."),
        },
        "counters": {k: int(getattr(engine, k)) for k in COUNTERS},
        "loss_scaler": engine.scaler.state_dict(),
        "param_groups": groups_to_json(opt) if opt is not None else None,
    }


def load_checkpoint(
    engine: Any,
    load_dir: str,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict | None]:
    """Load ``load_dir/<tag>`` (default: the tag named by ``load_dir/latest``) into this
    engine, whatever layout wrote it (module docstring)."""
    if tag is None:
        tag = storage.latest_tag(load_dir)
        if tag is None:
            logger.warning(
                "no 'latest' file in %s and no tag given: nothing loaded; pass tag= or "
                "save with save_latest=True",
                load_dir,
            )
            return None, None
    tag = str(tag)
    storage.check_tag(tag)  # an explicit tag is checked like latest's: no "../x", no paths
    storage.recover(load_dir, tag)  # a save killed while overwriting this tag
    path = os.path.join(load_dir, tag)
    reader = storage.CheckpointReader(path, verify=engine.config.checkpoint.verify)
    layout = _layout(engine)
    _load_model(engine, reader, layout, load_module_strict)
    shared = reader.rank_state(0)
    if not load_module_only:
        meta = reader.meta
        if load_optimizer_states and engine.optimizer is not None:
            targets, finish = optim_targets(layout, engine.optimizer, reader)
            fill(reader, targets)
            finish()
            if meta.get("param_groups") is not None:
                groups_from_json(engine.optimizer, meta["param_groups"])
            engine.scaler.load_state_dict(meta["loss_scaler"])
        sched_state = shared.get("lr_scheduler")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and sched_state:
            _load_scheduler(engine, sched_state)
        for k in COUNTERS:
            setattr(engine, k, int(meta["counters"][k]))
        # The data position is global (samples consumed), so rank 0's serves every rank: it
        # always reads data (a middle pipeline stage never iterates its loader).
        set_data_state(engine, shared.get("data"))
        own = reader.rank_state(source_rank(engine.global_rank, reader.world_size))
        set_rng_state(own["rng"])
    return path, dict(shared.get("client_state") or {})


def _load_scheduler(engine: Any, state: dict) -> None:
    """The schedule's position, and its current lr in the optimizer (a scheduler's
    load_state_dict does not set it; the optimizer's groups may not have been loaded)."""
    sched = engine.lr_scheduler
    sched.load_state_dict(state)
    if engine.optimizer is not None and hasattr(sched, "get_last_lr"):
        for group, lr in zip(engine.optimizer.param_groups, sched.get_last_lr(), strict=False):
            if hasattr(group["lr"], "fill_"):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


def _load_model(engine: Any, reader: Any, layout: Layout, strict: bool) -> None:
    """Weights and masters; frozen parameters absent from the checkpoint (saved with
    exclude_frozen_parameters) keep their values. ``strict`` also refuses saved weights this
    model has no place for (with one pipeline stage: a stage holds part of the names)."""
    targets = layout.model + layout.master_pieces()
    frozen = _frozen(engine)
    fill(reader, targets, strict=strict, optional=lambda name: name in frozen)
    if strict and engine.mesh.topology.pp == 1:
        module = engine.module
        mine = {f"model/{n}" for n in module.state_dict()}
        mine |= {f"model/{n}" for n, _ in module.named_parameters()}
        unexpected = sorted(n for n in reader.names() if n.startswith("model/") and n not in mine)
        if unexpected:
            raise CheckpointError(
                f"the checkpoint holds weights this model does not have: {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}; it was saved from another model "
                "(pass load_module_strict=False to ignore them)"
            )


def load_module_state_dict(engine: Any, state_dict: dict, strict: bool = True) -> None:
    """Load a whole-model state dict (the user's keys) into any layout; fp32 masters follow."""
    _load_model(engine, PieceReader.from_state_dict(state_dict), _layout(engine), strict)


def save_16bit_model(
    engine: Any,
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
        from safetensors.torch import save_file

        # One storage per name: safetensors refuses tensors that share memory (tied weights).
        copies, seen = {}, set()
        for k, v in state.items():
            ptr = v.untyped_storage().data_ptr()
            copies[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(copies, tmp, metadata={"format": "pt"})
    else:
        import torch

        torch.save(state, tmp)
    os.replace(tmp, path)
