"""Which format a checkpoint directory holds, and the reader for it.

    manifest.json                                 shardwise's own (reader.py)
    mp_rank_00_model_states.pt, zero_pp_rank_*,   DeepSpeed's tag directory (deepspeed.py)
      layer_*-model_states.pt
    .metadata, __R_0.distcp                       torch.distributed.checkpoint (dcp.py)
    model.safetensors.index.json (+ shards),      Hugging Face weights (hf_safetensors.py):
      model.safetensors                             weights only, loaded by
                                                    ``engine.load_module_state_dict(path)``

A save directory (``latest`` naming a tag) is resolved first, as ``load_checkpoint`` does;
a Hugging Face Trainer's ``checkpoint-N/`` is such a save directory (DeepSpeed writes
``checkpoint-N/latest`` and ``checkpoint-N/global_stepN/``).
"""

from __future__ import annotations

import os
from typing import Any

from shardwise.checkpoint import manifest as mf
from shardwise.checkpoint.foreign.dcp import DcpReader, is_dcp
from shardwise.checkpoint.foreign.deepspeed import DeepSpeedReader
from shardwise.checkpoint.foreign.deepspeed_files import is_deepspeed
from shardwise.checkpoint.foreign.hf_safetensors import is_hf
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.tags import check_tag, latest_tag

SHARDWISE, DEEPSPEED, DCP, HUGGINGFACE = "shardwise", "deepspeed", "dcp", "huggingface"


def detect(path: str) -> str | None:
    """The format of checkpoint directory ``path`` (one tag's), None if none we know."""
    if os.path.isfile(os.path.join(path, mf.MANIFEST)):
        return SHARDWISE
    if is_deepspeed(path):
        return DEEPSPEED
    if is_dcp(path):
        return DCP
    if os.path.isdir(path) and is_hf(path):
        return HUGGINGFACE
    return None


def resolve(path: str, tag: str | None = None) -> str:
    """The tag directory meant by ``path``: ``path/tag``, ``path`` itself when it holds a
    checkpoint, else the tag ``path/latest`` names."""
    if tag is not None:
        check_tag(tag)
        return os.path.join(path, tag)
    if detect(path) is not None:
        return path
    found = latest_tag(path) if os.path.isdir(path) else None
    if found is None:
        raise CheckpointError(
            f"{path}: no checkpoint there (no {mf.MANIFEST}, no DeepSpeed model-state file) and "
            "no 'latest' file naming one; pass a tag"
        )
    return os.path.join(path, found)


def open_checkpoint(
    path: str,
    verify: bool = True,
    param_order: list[list[str]] | None = None,
    samples_per_step: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> Any:
    """A reader for the checkpoint in tag directory ``path``, whatever wrote it; raises
    ``CheckpointError`` for a directory of no known format. ``verify`` applies to shardwise's
    own (checksums); ``param_order`` to DeepSpeed's ZeRO-0 states, ``shapes`` (the loading
    model's whole parameter shapes) to its tensor-parallel slices (deepspeed.py)."""
    found = detect(path)
    if found == DEEPSPEED:
        return DeepSpeedReader(path, param_order, shapes)
    if found == DCP:
        return DcpReader(path, samples_per_step)
    if found == HUGGINGFACE:
        raise CheckpointError(
            f"{path} holds Hugging Face weights only (no optimizer, counters or scheduler): load "
            "them with engine.load_module_state_dict(path), each rank reading its slices"
        )
    if found is None and os.path.isdir(path):
        held = ", ".join(sorted(os.listdir(path))[:6])
        raise CheckpointError(
            f"{path} holds no checkpoint of a format shardwise reads ({held}): a shardwise "
            "checkpoint has manifest.json, a DeepSpeed one mp_rank_00_model_states.pt"
        )
    return CheckpointReader(path, verify=verify)
