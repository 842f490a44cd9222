"""The files of one DeepSpeed checkpoint tag (``<save_dir>/global_stepN/``), found by name.

What DeepSpeed 0.14-0.19 writes into a tag directory (runtime/engine.py, pipe/module.py):

    mp_rank_XX_model_states.pt                      weights, counters, scheduler, client state
                                                    (ZeRO 0-2; one per model-parallel rank XX:
                                                    a pipeline stage, or a tensor-parallel rank)
    zero_pp_rank_D_mp_rank_XX_model_states.pt       the same per data-parallel rank D (ZeRO-3,
                                                    whose weights live in the optimizer files)
    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt  rank D's ZeRO partitions (fp32 masters,
                                                    optimizer states, loss scaler) of model-
                                                    parallel rank XX; "bf16_" with bf16
    layer_LL-model_states.pt                        a pipeline's weights, one file per layer
                                                    (layer_LL-model_TT-model_states.pt with
                                                    tensor parallelism: not mapped)
    layer_L_expert_E_mp_rank_XX_model_states.pt, expp_rank_*   MoE experts (not mapped)

``find`` sorts them out by model-parallel rank and refuses what shardwise does not map yet,
before anything is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from shardwise.checkpoint.manifest import CheckpointError

_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
_EXPERT = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_.*\.pt")


@dataclass
class DeepSpeedFiles:
    """The paths of one tag directory's files, by role and model-parallel rank."""

    path: str
    model: dict[int, list[str]] = field(default_factory=dict)  # one file, or one per DP rank
    optim: dict[int, list[str]] = field(default_factory=dict)  # per data-parallel rank
    layers: dict[int, str] = field(default_factory=dict)  # pipeline layer index -> file


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


def _refuse(path: str, names: list[str]) -> None:
    experts = [n for n in names if _EXPERT.fullmatch(n)]
    if experts:
        raise CheckpointError(
            f"{path}: MoE expert files ({experts[0]}, ...) are not mapped by shardwise yet; "
            "nothing was loaded"
        )
    split = [n for n in names if (m := _LAYER.fullmatch(n)) and m.group(2) not in (None, "00")]
    if split:
        raise CheckpointError(f"{path}: tensor-parallel layer files ({split[0]}, ...) are not "
                              "mapped by shardwise yet; nothing was loaded")  # fmt: skip


def find(path: str) -> DeepSpeedFiles:
    """The files of tag directory ``path`` by model-parallel rank; refuses MoE expert and
    tensor-parallel layer files, which are not mapped yet, and incomplete sets of rank files."""
    names = sorted(os.listdir(path))
    _refuse(path, names)
    model: dict[int, dict[int, str]] = {}
    optim: dict[int, dict[int, str]] = {}
    found, prefixes = DeepSpeedFiles(path), set()
    for n in names:
        if m := _OPTIM.fullmatch(n):
            prefixes.add(bool(m.group(1)))
            optim.setdefault(int(m.group(3)), {}).setdefault(int(m.group(2)), n)
        elif m := _ZERO3_MODEL.fullmatch(n):
            model.setdefault(int(m.group(2)), {})[int(m.group(1))] = n
        elif m := _MODEL.fullmatch(n):
            model.setdefault(int(m.group(1)), {})[0] = n
        elif m := _LAYER.fullmatch(n):
            found.layers[int(m.group(1))] = os.path.join(path, n)
    if len(prefixes) > 1:
        raise CheckpointError(f"{path}: both bf16_ and plain ZeRO optimizer files: which run?")
    if sorted(model) != list(range(len(model))) or not model:
        raise CheckpointError(
            f"{path}: model-state files for model-parallel ranks {sorted(model)}: a file is "
            "missing (mp_rank_00_model_states.pt first); nothing was loaded"
        )
    found.model = {mp: _by_rank(files, "model-state", path) for mp, files in model.items()}
    found.optim = {mp: _by_rank(files, "ZeRO optimizer-state", path) for mp, files in optim.items()}
    return found
