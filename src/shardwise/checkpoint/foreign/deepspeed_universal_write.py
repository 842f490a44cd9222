"""A DeepSpeed universal checkpoint folder, written: what DeepSpeed 0.19 loads at any
data-parallel size with ``"checkpoint": {"load_universal": true}``.

The folder is the one ``ds_to_universal`` makes (deepspeed_universal.py reads it):

    mp_rank_00_model_states.pt (ZeRO-1/2)       the model file rank 0 of a plain DeepSpeed
      zero_pp_rank_0_mp_rank_00_... (ZeRO-3)     save writes (deepspeed_write.py): counters,
                                                scheduler, client state, param_shapes; DeepSpeed's
                                                universal load reads rank 0's only
    zero/optimizer_state.pt                     the wrapper's global entries (no loss scaler:
                                                DeepSpeed keeps its own, the static scale 1 of
                                                fp32 and bf16), ``param_groups``; ZeRO-3's loader
                                                takes the step of ``optimizer_state_dict``
    zero/<p>/fp32.pt, <key>.pt                  {"param": whole tensor, "cat_dim": 0}
    zero/<p>/step.pt                            the 0-dim step

What DeepSpeed reads of them (runtime/base_optimizer.py ``load_hp_checkpoint_state_from_
checkpoint_dir``, zero/stage3.py ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``):
every ``<key>.pt`` of a parameter's folder, ``["param"]`` of each but step, cut to the loading
rank's partition. The parameter folders are spread over the saving ranks (parameter i by rank
i mod world), each whole tensor filled from the staged checkpoint through the resharding
reader: no rank holds more than its folders.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardwise.checkpoint.foreign.deepspeed_write import DS_VERSION, Spec
from shardwise.checkpoint.pieces import Piece

ZERO = "zero"


def check(spec: Spec) -> None:
    """Refuse what DeepSpeed's universal loader cannot take (stage 0: save_foreign.py)."""
    if spec.stage == 3 and spec.frozen:
        raise ValueError(
            f"format='deepspeed-universal' at ZeRO-3 with frozen parameters ({next(iter(spec.frozen))!r}, "
            "...): DeepSpeed's universal folder has no place for their partitions; save with "
            "format='deepspeed', or at ZeRO-1/2"
        )
    odd = [k for k in spec.scalar_keys if k != "step"]
    if odd:
        raise ValueError(
            f"format='deepspeed-universal': optimizer state {odd[0]!r} is a scalar other than "
            "'step', which DeepSpeed's universal loader cannot read; save with format='deepspeed'"
        )


class ParamFiles:
    """The parameter folders rank ``rank`` of ``world`` writes: ``targets`` to fill, then
    ``files()`` (path under the tag -> object)."""

    def __init__(self, spec: Spec, rank: int, world: int) -> None:
        self.targets: list[Piece] = []
        self._files: dict[str, Any] = {}
        names = [(n, s) for g in spec.groups for n, s in g.items()]
        for name, shape in names[rank::world]:
            box = tuple((0, n) for n in shape)
            for key in ["fp32", *spec.vector_keys]:
                t = torch.zeros(shape)
                label = "master" if key == "fp32" else f"optim/{key}"
                self.targets.append(Piece(f"{label}/{name}", shape, box, None, t))
                self._files[f"{ZERO}/{name}/{key}.pt"] = {"param": t, "cat_dim": 0}
            if "step" in spec.scalar_keys:
                t = torch.zeros(())
                self.targets.append(Piece(f"optim/step/{name}", (), (), None, t))
                self._files[f"{ZERO}/{name}/step.pt"] = t

    def files(self) -> dict[str, Any]:
        return self._files


def global_state(spec: Spec, step: float) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` (module docstring); ``step``: the optimizer's step."""
    groups = [h | {"params": [g]} for g, h in enumerate(spec.hyper)]
    return {
        "zero_stage": spec.stage,
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": float(spec.clip),
        "partition_count": [spec.world] * len(spec.groups),
        "ds_version": DS_VERSION,
        "param_groups": groups,
        "optimizer_state_dict": {
            "state": {0: {"step": torch.tensor(float(step))}},
            "param_groups": groups,
        },
    }


def model_file_name(spec: Spec) -> str:
    """The one model file DeepSpeed's universal load reads (rank 0's)."""
    name = "mp_rank_00_model_states.pt"
    return f"zero_pp_rank_0_{name}" if spec.stage == 3 else name


def makedirs(path: str, files: dict[str, Any]) -> None:
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
