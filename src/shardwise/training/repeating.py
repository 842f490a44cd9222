"""DeepSpeed's ``RepeatingLoader``: an endless iterator over a loader, epoch after epoch."""

from __future__ import annotations

from typing import Any


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader``: an endless iterator over ``loader``.

    On exhaustion it moves the loader to the next epoch (``set_epoch``, or its sampler's, when
    there is one) and starts over, so every pass is reshuffled.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = getattr(loader, "epoch", 0)
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            pass
        self.epoch = getattr(self.loader, "epoch", self.epoch) + 1
        target = self.loader if hasattr(self.loader, "set_epoch") else None
        if target is None and hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            target = self.loader.sampler
        if target is not None:
            target.set_epoch(self.epoch)
        self.data_iter = iter(self.loader)
        try:
            return next(self.data_iter)
        except StopIteration:
            raise ValueError("RepeatingLoader: the loader yields no batch at all") from None

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self.data_iter = iter(self.loader)
