"""Random streams for tensor parallelism: one shared, one per tensor-parallel rank.

Dropout must draw the same mask on every tensor-parallel rank where the activations are
replicated (after an all-reduce: the ranks hold copies of one tensor, and different masks
would make the copies diverge), and independent masks where each rank holds a different part
of the activations (attention heads, sequence shards): one mask drawn on the whole tensor
covers its parts independently, so per-rank streams match a single process in distribution.

Megatron's recipe (``model_parallel_cuda_manual_seed``), kept here:

    default stream   seed                       identical on every TP rank (replicated regions)
    TP stream        seed + 2718 + tp_rank      "model-parallel-rng", forked around split regions

``RNGStatesTracker.fork(name)`` swaps the process's default generators (CPU, and the current
CUDA device's when CUDA is available) for the named stream, and back on exit, so code inside
uses ``torch.rand``/``F.dropout`` unchanged. A tracker is process-wide state like torch's own
default generator, so one default tracker is kept here (``get_rng_tracker``); activation
checkpointing saves and restores every live tracker's states (``all_trackers``) so that a
recomputed forward draws the same masks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

TP_STREAM = "model-parallel-rng"  # Megatron's and DeepSpeed's name for the per-rank stream
TP_SEED_OFFSET = 2718  # Megatron's offset between the default seed and the TP streams' seeds

States = dict[str, torch.Tensor]  # device kind ("cpu", "cuda") -> generator state


def _capture() -> States:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _restore(states: States) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _seeded(seed: int) -> States:
    """The generator states a fresh ``torch.manual_seed(seed)`` would give, without touching
    the current ones."""
    states = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if torch.cuda.is_available():
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        states["cuda"] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
    return states


_TRACKERS: weakref.WeakSet = weakref.WeakSet()


class RNGStatesTracker:
    """Named random streams that code can step into with ``fork(name)``.

    The names of Megatron's ``CudaRNGStatesTracker``: ``add``, ``fork``, ``get_states``,
    ``set_states``, ``reset``.
    """

    def __init__(self) -> None:
        self._states: dict[str, States] = {}
        self._seeds: dict[int, str] = {}
        _TRACKERS.add(self)

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` starting as ``torch.manual_seed(seed)`` would."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; reset() the tracker first")
        if seed in self._seeds:
            raise ValueError(
                f"seed {seed} of RNG stream {name!r} is already used by {self._seeds[seed]!r}: "
                "two streams with one seed would draw the same numbers"
            )
        self._states[name] = _seeded(seed)
        self._seeds[seed] = name

    def has(self, name: str) -> bool:
        return name in self._states

    def get_states(self) -> dict[str, States]:
        """A copy of every stream's state (to save, or to restore before a recompute)."""
        return {name: {k: v.clone() for k, v in s.items()} for name, s in self._states.items()}

    def set_states(self, states: dict[str, States]) -> None:
        """Replace every stream's state by ``states`` (from ``get_states``)."""
        self._states = {name: {k: v.clone() for k, v in s.items()} for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left as it was."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} was never added: call "
                "shardwise.parallel.tensor.random.model_parallel_seed(seed, tp_rank) after seeding, "
                "or tracker.add(name, seed)"
            )
        outside = _capture()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _restore(outside)


_DEFAULT = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's default tracker (DeepSpeed: ``checkpointing.get_cuda_rng_tracker()``)."""
    return _DEFAULT


get_cuda_rng_tracker = get_rng_tracker  # the name DeepSpeed and Megatron scripts call


def all_trackers() -> list[RNGStatesTracker]:
    """Every live tracker (activation checkpointing saves and restores all of them)."""
    return list(_TRACKERS)


def all_tracker_states() -> list[tuple[RNGStatesTracker, Any]]:
    """(tracker, a copy of its states) for every live tracker: what a recompute replays."""
    return [(tracker, tracker.get_states()) for tracker in all_trackers()]


def set_tracker_states(saved: list[tuple[RNGStatesTracker, Any]]) -> None:
    """Put back states taken by ``all_tracker_states``."""
    for tracker, states in saved:
        tracker.set_states(states)


def model_parallel_seed(seed: int, tp_rank: int, tracker: RNGStatesTracker | None = None) -> None:
    """Seed the default stream with ``seed`` (the same on every TP rank) and the tracker's
    TP stream with ``seed + 2718 + tp_rank`` (different on every TP rank); Megatron's
    ``model_parallel_cuda_manual_seed`` with the TP rank passed explicitly."""
    tracker = tracker if tracker is not None else _DEFAULT
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(TP_STREAM, seed + TP_SEED_OFFSET + tp_rank)


def ensure_tp_stream(tp_rank: int, tracker: RNGStatesTracker | None = None) -> None:
    """Add the TP stream if nobody did, seeded from the default stream's initial seed (the
    same on every rank when the script seeded before building the model)."""
    tracker = tracker if tracker is not None else _DEFAULT
    if not tracker.has(TP_STREAM):
        seed = (torch.initial_seed() + TP_SEED_OFFSET + tp_rank) % 2**63  # a valid seed
        tracker.add(TP_STREAM, seed)
