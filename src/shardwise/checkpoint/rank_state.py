"""Per-rank state a checkpoint restores for an exact resume: random generators and data position.

Random generators (python ``random``, numpy's global generator, torch's CPU generator and every
CUDA device's when there is one, and the tensor-parallel streams of parallel/tensor/random.py's
tracker: "model-parallel-rng", which dropout in "split_dropout" and sequence-parallel regions
draws from) as JSON values and tensors, no pickle. Dropout on rank r draws from rank r's
generators, so each rank restores its own state; a rank that did not exist in the saved run
(loading on more processes) takes rank 0's. Streams the checkpoint lacks (saved without
tensor parallelism) keep their current state.

The data position is the training loader's ``state_dict()`` (data.py): global samples consumed
in the epoch, which is layout-independent; every rank saves it, and every rank loads rank 0's
(rank 0 always reads data; the loader of a middle pipeline stage never moves).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from shardwise.parallel.tensor.random import get_rng_tracker


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    streams = get_rng_tracker().get_states()
    if streams:
        state["tp_streams"] = streams
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        for device in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[device], device)
    if state.get("tp_streams"):
        tracker = get_rng_tracker()
        streams = tracker.get_states()
        for name, kinds in state["tp_streams"].items():
            saved = {k: torch.as_tensor(v, dtype=torch.uint8) for k, v in kinds.items()}
            streams[name] = {**streams.get(name, {}), **saved}  # a device kind not saved stays
        tracker.set_states(streams)


def data_state(loader: Any) -> dict[str, Any] | None:
    """The training loader's position (None without a resumable loader)."""
    if loader is None or not hasattr(loader, "state_dict"):
        return None
    return loader.state_dict()


def set_data_state(loader: Any, state: dict[str, Any] | None) -> None:
    """Resume the training loader (its running iterator restarts at the resumed position)."""
    if state is None or loader is None or not hasattr(loader, "load_state_dict"):
        return
    loader.load_state_dict(state)


def source_rank(rank: int, saved_world_size: int) -> int:
    """Whose per-rank state rank ``rank`` restores: its own, or rank 0's when the saved run
    had fewer ranks."""
    return rank if rank < saved_world_size else 0
