"""DeepSpeed's engine accessors of the resolved batch sizes and the config, as one mixin."""

from __future__ import annotations

from typing import Any


class ConfigAccessors:
    """DeepSpeed's engine accessors of the resolved batch sizes (``self.batch``) and config."""

    batch: Any
    config: Any

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled
