"""``wall_clock_breakdown``: DeepSpeed's engine timers, summed per optimizer step.

The engine times ``fwd`` (its forward), ``bwd`` (its backward), inside it ``bwd_inner``
(autograd, with the gradient hooks that launch the reductions) and ``bwd_allreduce`` (waiting
for the reductions to finish), and ``step`` (norm, clip, optimizer, parameter all-gather).
With a pipeline the schedule's instructions are timed too, under DeepSpeed's pipeline names
(``PHASES``). Every ``steps_per_print`` steps (every step when null) rank 0 logs DeepSpeed's line with the mean per
optimizer step over those steps (micro-batches summed, as DeepSpeed's global timers do):

    time (ms) | fwd: 1.52 | bwd: 3.10 | bwd_inner: 2.71 | bwd_allreduce: 0.39 | step: 0.84
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

ENGINE = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
PHASES = {  # pipeline instruction (schedule.Op name) -> DeepSpeed's timer name
    "LOAD": "batch_input",
    "RECV_ACT": "pipe_recv_input",
    "FORWARD": "fwd",
    "SEND_ACT": "pipe_send_output",
    "RECV_GRAD": "pipe_recv_grad",
    "BACKWARD": "bwd",
    "BACKWARD_INPUT": "bwd",  # zero-bubble schedules: B and W both count as backward
    "BACKWARD_WEIGHT": "bwd",
    "SEND_GRAD": "pipe_send_grad",
    "REDUCE_GRADS": "bwd_allreduce",
    "REDUCE_TIED": "reduce_tied_grads",
}
ORDER = (*ENGINE, *(n for n in PHASES.values() if n not in ENGINE))
EVENT_NAMES = {  # DeepSpeed's monitor events for the timers (engine._write_monitor)
    "fwd": "forward",
    "bwd": "backward",
    "bwd_inner": "backward_inner",
    "bwd_allreduce": "backward_allreduce",
    "step": "step",
}


class WallClock:
    """Seconds per timer name: this step's, the last finished step's, and the window's."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.window: dict[str, float] = {}
        self.steps = 0

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

    def end_step(self) -> None:
        """Close the optimizer step: its times become ``last`` and join the window."""
        self.last, self.current = self.current, {}
        for name, seconds in self.last.items():
            self.window[name] = self.window.get(name, 0.0) + seconds
        self.steps += 1

    def line(self) -> str:
        """DeepSpeed's ``time (ms) | name: mean ...`` over the window, which restarts."""
        steps = max(self.steps, 1)
        parts = [f"{n}: {1000 * self.window[n] / steps:.2f}" for n in ORDER if n in self.window]
        self.window, self.steps = {}, 0
        return " | ".join(["time (ms)", *parts])

    def events(self, samples: int) -> list[tuple[str, float, int]]:
        """The last step's engine timers as DeepSpeed's ``Train/Samples/elapsed_time_ms_*``."""
        return [
            (f"Train/Samples/elapsed_time_ms_{EVENT_NAMES[n]}", 1000 * self.last[n], samples)
            for n in ENGINE
            if n in self.last
        ]
