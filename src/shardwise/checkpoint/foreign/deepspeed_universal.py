"""DeepSpeed's universal checkpoint folder (what ``ds_to_universal`` writes) as pieces.

DeepSpeed 0.19's ``deepspeed/checkpoint/ds_to_universal.py`` turns a ZeRO-1/2/3 tag directory
into a folder that no longer depends on the saving run's data-parallel size:

    <tag>/mp_rank_00_model_states.pt            the source's model-state files, copied
      (ZeRO-3: zero_pp_rank_D_mp_rank_00_...)     (counters, scheduler, client state, shapes)
    <tag>/zero/optimizer_state.pt               the optimizer wrapper's dict of rank 0 (loss
                                                scaler, ...), ``param_groups`` (hyper-parameters)
    <tag>/zero/<param>/fp32.pt                  the whole fp32 master of <param>
    <tag>/zero/<param>/exp_avg.pt, exp_avg_sq.pt  the whole optimizer states (any other
                                                ``<key>.pt`` alike)
    <tag>/zero/<param>/step.pt                  the step (ZeRO-1/2; ZeRO-3 keeps it per flat
                                                sub-group in optimizer_state.pt only)

A whole-tensor file holds ``{"param": tensor, "cat_dim": d}`` (ZeRO-1/2) or the bare tensor,
flattened (ZeRO-3). Each becomes one whole piece: "master/<p>" from fp32.pt, "optim/<key>/<p>"
from the others, and under ZeRO-3, whose model files hold empty placeholders, "model/<p>" from
fp32.pt too (the loader casts it: DeepSpeed's bf16 weights are the rounded masters). Every file
goes through safe_load.py. Entries that only tensor parallelism writes (``vocab_tensor``,
``sub_param_shape``, ...) are refused: the folder came from a tensor-parallel run, which is not
mapped.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from shardwise.checkpoint.foreign.deepspeed_optim import Mapped
from shardwise.checkpoint.foreign.safe_load import load_pt
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece

ZERO, STATE = "zero", "optimizer_state.pt"
_PLAIN_KEYS = {"param", "cat_dim"}  # what a data-parallel source writes into a whole-tensor file


def is_universal(path: str) -> bool:
    """``path`` is a tag directory holding a universal ``zero/`` folder."""
    return os.path.isfile(os.path.join(path, ZERO, STATE))


def global_state(path: str) -> dict:
    """``zero/optimizer_state.pt`` of tag directory ``path``."""
    state = load_pt(os.path.join(path, ZERO, STATE))
    if not isinstance(state, dict) or "param_groups" not in state:
        raise CheckpointError(f"{path}/{ZERO}/{STATE}: no param_groups: not DeepSpeed's")
    return state


def _whole(file: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of one whole-tensor file, in ``shape``."""
    saved = load_pt(file)
    if isinstance(saved, dict):
        odd = sorted(set(saved) - _PLAIN_KEYS)
        if odd or "param" not in saved:
            raise CheckpointError(
                f"{file}: entries {odd or ['no param']}: written for a tensor-parallel source, "
                "which shardwise does not map yet; nothing was loaded"
            )
        saved = saved["param"]
    if not torch.is_tensor(saved) or saved.numel() != math.prod(shape):
        got = tuple(saved.shape) if torch.is_tensor(saved) else type(saved).__name__
        raise CheckpointError(f"{file}: holds {got}, the model file says shape {shape}")
    return saved.reshape(shape)


def _steps(state: dict, where: str) -> torch.Tensor | None:
    """ZeRO-3's one step of every flat sub-group (they step together), None if none saved."""
    inner = (state.get("optimizer_state_dict") or {}).get("state") or {}
    steps = {float(s["step"]) for s in inner.values() if isinstance(s, dict) and "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"{where}: the flat sub-groups saved steps {sorted(steps)}")
    return torch.tensor(steps.pop(), dtype=torch.float32) if steps else None


def mapped(path: str, state: dict, groups: list[dict[str, tuple]], stage: int) -> Mapped:
    """Masters and optimizer states of every trained parameter (``groups``: names and shapes
    per optimizer group, from the model file) of tag directory ``path`` (module docstring)."""
    zero = os.path.join(path, ZERO)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    out = Mapped(param_groups=hyper, wrapper=state, kind="whole fp32 tensors (universal)")
    step = _steps(state, os.path.join(zero, STATE)) if stage == 3 else None
    for name, shape in ((n, tuple(s)) for g in groups for n, s in g.items()):
        folder = os.path.join(zero, name)
        if not os.path.isfile(os.path.join(folder, "fp32.pt")):
            raise CheckpointError(f"{folder}/fp32.pt is missing: the folder is incomplete")
        box = tuple((0, n) for n in shape)
        for file in sorted(os.listdir(folder)):
            key, ext = os.path.splitext(file)
            if ext != ".pt":
                continue
            if key == "step":
                t = load_pt(os.path.join(folder, file))
                out.pieces.append(Piece(f"optim/step/{name}", (), (), None, _scalar(t, folder)))
                continue
            t = _whole(os.path.join(folder, file), shape)
            label = "master" if key == "fp32" else f"optim/{key}"
            out.pieces.append(Piece(f"{label}/{name}", shape, box, None, t))
            if key == "fp32" and stage == 3:  # the model files hold placeholders
                out.pieces.append(Piece(f"model/{name}", shape, box, None, t))
        if step is not None and not os.path.isfile(os.path.join(folder, "step.pt")):
            out.pieces.append(Piece(f"optim/step/{name}", (), (), None, step))
    return out


def _scalar(value: Any, where: str) -> torch.Tensor:
    if torch.is_tensor(value) and value.numel() == 1:
        return value.reshape(()).float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    raise CheckpointError(f"{where}/step.pt holds {type(value).__name__}, not a step count")
