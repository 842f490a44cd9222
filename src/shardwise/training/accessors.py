"""DeepSpeed's engine accessors, as one mixin: the parts, the batch sizes, the config, the ranks.

``engine.optimizer``, ``engine.config`` and the other parts are views of ``engine.parts``
(parts.py), read and written there, so the engine and the modules it hands the parts to never
see two versions of one part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from shardwise.training.parts import TrainParts

# the parts an engine attribute of the same name reads and writes (``PartField``)
PART_FIELDS = frozenset(
    {
        "optimizer",
        "lr_scheduler",
        "strategy",
        "mesh",
        "config",
        "batch",
        "scaler",
        "counters",
        "context",
        "training_dataloader",
        "loss_fn",
    }
)


class PartField:
    """``engine.<name>`` as a view of ``engine.parts.<name>`` (read and write)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.parts, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.parts, self.name, value)


class EngineAccessors:
    """DeepSpeed's engine accessors over ``self.parts`` (the module docstring)."""

    parts: TrainParts
    pipeline: Any
    module: torch.nn.Module
    consolidated_state_dict: Any  # the engine's

    optimizer, lr_scheduler, strategy = PartField(), PartField(), PartField()
    mesh, config, batch, scaler = PartField(), PartField(), PartField(), PartField()
    counters, context = PartField(), PartField()
    training_dataloader, loss_fn = PartField(), PartField()

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Accelerate saves a ZeRO-3 model through ``_zero3_consolidated_16bit_state_dict``
        only when this is true (else it asks for ``save_checkpoint``), as with DeepSpeed."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model's state dict in the training dtype (DeepSpeed's name, which
        Accelerate and the Trainer call to save a ZeRO-3 model); every rank must call it, and
        every rank gets it (DeepSpeed returns it on rank 0 only)."""
        state = self.consolidated_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def get_lr(self) -> list[float]:
        return self.parts.lrs()

    @property
    def device(self) -> torch.device:
        p = next(self.parts.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.topology.world_size

    @property
    def local_rank(self) -> int:
        return comm.get_local_rank()

    @property
    def dp_world_size(self) -> int:
        return self.mesh.topology.dp

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    def is_first_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_last_stage()
