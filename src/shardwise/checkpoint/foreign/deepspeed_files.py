"""The files of one DeepSpeed checkpoint tag (``<save_dir>/global_stepN/``), found by name.

What DeepSpeed 0.14-0.19 writes into a tag directory (runtime/engine.py, pipe/module.py):

    mp_rank_XX_model_states.pt                      weights, counters, scheduler, client state
                                                    (ZeRO 0-2; one per tensor-parallel rank XX)
    zero_pp_rank_D_mp_rank_XX_model_states.pt       the same per data-parallel rank D (ZeRO-3,
                                                    whose weights live in the optimizer files)
    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt  rank D's ZeRO partitions (fp32 masters,
                                                    optimizer states, loss scaler); "bf16_"
                                                    when bf16 was enabled
    layer_LL-model_XX-model_states.pt               a pipeline's weights, one file per layer
    layer_L_expert_E_mp_rank_XX_model_states.pt, expp_rank_*   MoE experts (not mapped)

``find`` sorts them out and refuses what shardwise does not map yet, before anything is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from shardwise.checkpoint.manifest import CheckpointError

_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
_EXPERT = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_.*\.pt")


@dataclass
class DeepSpeedFiles:
    """The paths of one tag directory's files, by role (module docstring)."""

    path: str
    model: list[str] = field(default_factory=list)  # per data-parallel rank (ZeRO-3), or one
    optim: list[str] = field(default_factory=list)  # per data-parallel rank
    layers: dict[int, str] = field(default_factory=dict)  # pipeline layer index -> file
    bf16_names: bool = False  # the optimizer files carry the "bf16_" prefix


def is_deepspeed(path: str) -> bool:
    """``path`` is a directory holding DeepSpeed checkpoint files."""
    if not os.path.isdir(path):
        return False
    return any(
        _MODEL.fullmatch(n) or _ZERO3_MODEL.fullmatch(n) or _LAYER.fullmatch(n)
        for n in os.listdir(path)
    )


def _by_rank(found: dict[int, str], what: str, path: str) -> list[str]:
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        raise CheckpointError(
            f"{path}: {what} files for data-parallel ranks {ranks}: some are missing, the "
            "checkpoint is incomplete; nothing was loaded"
        )
    return [os.path.join(path, found[r]) for r in ranks]


def find(path: str) -> DeepSpeedFiles:
    """The files of tag directory ``path``; refuses tensor-parallel (mp_rank_01...) and MoE
    expert files, which are not mapped yet, and incomplete sets of rank files."""
    names = sorted(os.listdir(path))
    experts = [n for n in names if _EXPERT.fullmatch(n)]
    mp_ranks = set()
    model, zero3, optim, layers = {}, {}, {}, {}
    prefixes = set()
    for n in names:
        if m := _OPTIM.fullmatch(n):
            prefixes.add(bool(m.group(1)))
            optim.setdefault(int(m.group(2)), n)
            mp_ranks.add(int(m.group(3)))
        elif m := _ZERO3_MODEL.fullmatch(n):
            zero3[int(m.group(1))] = n
            mp_ranks.add(int(m.group(2)))
        elif m := _MODEL.fullmatch(n):
            model[int(m.group(1))] = n
            mp_ranks.add(int(m.group(1)))
        elif m := _LAYER.fullmatch(n):
            layers[int(m.group(1))] = n
            mp_ranks.add(int(m.group(2)))
    if experts:
        raise CheckpointError(
            f"{path}: MoE expert files ({experts[0]}, ...) are not mapped by shardwise yet; "
            "nothing was loaded"
        )
    if mp_ranks - {0}:
        raise CheckpointError(
            f"{path}: tensor-parallel files (model-parallel ranks {sorted(mp_ranks)}) are not "
            "mapped by shardwise yet (which dimension each weight was split along is not in "
            "the files); nothing was loaded"
        )
    if len(prefixes) > 1:
        raise CheckpointError(f"{path}: both bf16_ and plain ZeRO optimizer files: which run?")
    found = DeepSpeedFiles(path, bf16_names=prefixes == {True})
    found.model = _by_rank(zero3, "ZeRO-3 model-state", path) if zero3 else []
    if not zero3 and model:
        found.model = [os.path.join(path, model[0])]
    found.optim = _by_rank(optim, "ZeRO optimizer-state", path) if optim else []
    found.layers = {i: os.path.join(path, n) for i, n in layers.items()}
    if not found.model:
        raise CheckpointError(f"{path}: no model-state file (mp_rank_00_model_states.pt)")
    return found
