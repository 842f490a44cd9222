"""The engine's training counters, one object that checkpoints save and load whole.

    micro_steps     forward/backward passes taken (every micro-batch)
    global_steps    optimizer steps counted (applied or skipped): DeepSpeed's global_steps
    global_samples  samples consumed by those steps (train_batch_size each)
    skipped_steps   steps skipped for an fp16 overflow

The engine reads and writes them as ``engine.global_steps`` etc. (DeepSpeed's names), which are
``CounterField`` views of ``engine.counters``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainingCounters:
    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Every counter from ``state`` (validated by the checkpoint loader first)."""
        for name in self.names():
            setattr(self, name, int(state[name]))

    def count_update(self, samples: int, skipped: bool) -> None:
        """One optimizer step over ``samples`` samples, applied or skipped."""
        self.global_steps += 1
        self.global_samples += samples
        self.skipped_steps += int(skipped)


class CounterField:
    """``engine.<name>`` as a view of ``engine.counters.<name>`` (read and write)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.counters, self.name)

    def __set__(self, obj: Any, value: int) -> None:
        setattr(obj.counters, self.name, value)
