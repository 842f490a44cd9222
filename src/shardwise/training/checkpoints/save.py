"""The engine's checkpoint calls (DeepSpeed's names and meaning), over any layout.

save_checkpoint: every rank offers the pieces of its layout (checkpoint/rank_pieces.py: model weights, fp32
masters, optimizer states), its per-rank state (random generators, data position) and, on
rank 0, the shared state (LR scheduler, ``client_state``); the counters, loss scaler, optimizer
hyper-parameters and layout go to the JSON metadata. Storage (files, manifest, atomicity,
``latest``, rotation) is shardwise.checkpoint.storage; the config's ``checkpoint`` block gives
it ``keep_last`` and ``tag_validation`` (config/checkpoint.py).

Before anything is written the storage takes the save directory's lock and refuses a
directory holding checkpoints of later steps than this engine's (rotation.py), unless this
engine loaded a checkpoint of that directory or the config says ``overwrite_newer``; replicated
tensors are compared across their copies (checkpoint/replica_checksums.py).

load_checkpoint: load.py (all or nothing); what a rank holds: held.py.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from shardwise import comm
from shardwise.checkpoint import storage
from shardwise.checkpoint.async_save import SaveHandle
from shardwise.checkpoint.optim_state import groups_to_json, optim_pieces
from shardwise.checkpoint.rank_state import data_state, rng_state
from shardwise.checkpoint.reshard import plain_pieces
from shardwise.precision import compute_dtype
from shardwise.training.checkpoints.held import frozen_names, layout, tied_aliases
from shardwise.training.checkpoints.save_foreign import check_format, save_foreign

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.pieces import Piece
    from shardwise.training.checkpoints.autosave import AutoSave
    from shardwise.training.parts import TrainParts

logger = logging.getLogger("shardwise")


def save_checkpoint(
    parts: TrainParts,
    autosave: AutoSave,
    save_dir: str,
    tag: str | int | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    async_save: bool = False,
    format: str = "shardwise",  # noqa: A002 - the argument's name in the public call
) -> bool | SaveHandle:
    """Write ``save_dir/<tag>`` (default tag ``global_step<N>``); every rank must call it.
    With ``async_save``: the handle of a save written in the background (async_save.py).
    ``autosave`` holds the writer of asynchronous saves and the directory last loaded.
    ``format``: "shardwise" (its own), "deepspeed" or "dcp" (save_foreign.py)."""
    check_format(format, async_save)
    if autosave.writer is not None:
        autosave.writer.wait()  # at most one save in flight, a blocking one included
    steps = parts.counters.global_steps
    tag = f"global_step{steps}" if tag is None else str(tag)
    pieces, rank_state, meta = contents(parts, client_state, exclude_frozen_parameters)
    options = parts.config.checkpoint
    loaded_here = autosave.loaded_from == os.path.abspath(save_dir)
    plan = storage.begin_save(  # the lock and the refusal of newer steps: every format
        save_dir,
        tag,
        keep_last=options.keep_last,
        tag_validation=options.tag_validation,
        step=int(steps),
        allow_newer=options.overwrite_newer or loaded_here,
    )
    if format != "shardwise":
        whole = (pieces, rank_state, meta)
        return save_foreign(parts, format, plan, whole, client_state, save_latest)
    if async_save:
        writer = autosave.writer_for(parts.mesh)
        return writer.submit(plan, pieces, rank_state, meta, save_latest)
    storage.finish_save(plan, pieces, rank_state, meta, save_latest=save_latest)
    return True


def contents(
    parts: TrainParts, client_state: dict | None, exclude_frozen: bool
) -> tuple[list[Piece], dict[str, Any], dict[str, Any]]:
    """What a save of this rank writes: its pieces, its rank state (rank 0's with the
    scheduler and ``client_state``) and the JSON metadata."""
    lay = layout(parts)
    pieces = lay.model + lay.master_pieces()
    if exclude_frozen:
        frozen = frozen_names(parts)
        pieces = [p for p in pieces if p.name not in frozen]
    if parts.optimizer is not None:
        pieces += optim_pieces(lay, parts.optimizer)
    pieces = plain_pieces(pieces)  # packed tensors (q|k|v) as plain boxes: any layout reads them
    rank_state: dict[str, Any] = {
        "rng": rng_state(),
        "data": data_state(parts.training_dataloader),
    }
    if parts.mesh.rank == 0:
        sched = parts.lr_scheduler
        rank_state["lr_scheduler"] = sched.state_dict() if sched is not None else None
        rank_state["client_state"] = dict(client_state or {})
    meta = _meta(parts)
    meta["aliases"] = tied_aliases(parts.module, {p.name for p in lay.model})
    return pieces, rank_state, meta


def _meta(parts: TrainParts) -> dict[str, Any]:
    topo = parts.mesh.topology
    opt = parts.optimizer
    return {
        "layout": {
            "dp": topo.dp,
            "tp": topo.tp,
            "pp": topo.pp,
            "cp": topo.cp,
            "zero_stage": parts.config.zero_optimization.stage,
            "dtype": str(compute_dtype(parts.config)).removeprefix("torch."),
        },
        "counters": parts.counters.state_dict(),
        "loss_scaler": parts.scaler.state_dict(),
        "param_groups": groups_to_json(opt) if opt is not None else None,
    }


def save_16bit_model(
    parts: TrainParts,
    state: dict[str, torch.Tensor],
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
    if exclude_frozen_parameters:
        frozen = {n for n, p in parts.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    if parts.mesh.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _write_state(state, os.path.join(save_dir, save_filename))
        for attr in ("config", "hf_config"):
            hf_config = getattr(parts.module, attr, None)
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
