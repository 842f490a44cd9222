"""What one run of a layout leaves for the parent: ``result.json`` (losses, gradient norms,
parameter order, random-stream findings) and ``params.safetensors`` (the full parameters after
every step, keys ``"{step}/{name}"``). safetensors, never pickle: the parent reads tensors only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RESULT_JSON = "result.json"
PARAMS_FILE = "params.safetensors"


@dataclass
class RunResult:
    """Per-step losses and norms of one layout, and its full parameters after each step."""

    layout: str
    losses: list[float]
    norms: list[float | None]
    names: list[str]  # single-process names, in the model's order
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)  # one dict per step
    streams: list[str] = field(default_factory=list)  # random-stream findings (streams.py)
    zero_grad: list[str] = field(default_factory=list)  # gradient 0 up to rounding (reference)


def save_result(result: RunResult, out: str | Path) -> None:
    """Write both files, each to a temporary name first: never a half-written result."""

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{step}/{name}": t.detach().float().cpu().contiguous().clone()
        for step, state in enumerate(result.params, 1)
        for name, t in state.items()
    }
    tmp = out / (PARAMS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / PARAMS_FILE)
    meta = {k: v for k, v in asdict(result).items() if k != "params"}
    tmp = out / (RESULT_JSON + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, out / RESULT_JSON)


def load_result(out: str | Path) -> RunResult:

    out = Path(out)
    meta = json.loads((out / RESULT_JSON).read_text())
    tensors = load_file(str(out / PARAMS_FILE))
    params: list[dict[str, torch.Tensor]] = [{} for _ in meta["losses"]]
    for key, t in tensors.items():
        step, name = key.split("/", 1)
        params[int(step) - 1][name] = t
    return RunResult(params=params, **meta)


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """The initial weights every layout loads (tied tensors stored as separate copies)."""

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(path))


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:

    return load_file(str(path))
