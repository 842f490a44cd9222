"""``shardwise checkpoint inspect DIR``: the format found, the layout that saved it, and what a
load takes from it or drops (and why); a checkpoint that cannot be mapped fully is reported as
refused, with the reason a load would give, before any engine exists.
"""

from __future__ import annotations

import math
from typing import Any

from shardwise.checkpoint.export import inspect as inspect_own
from shardwise.checkpoint.foreign.detect import (
    HUGGINGFACE,
    SHARDWISE,
    detect,
    open_checkpoint,
    resolve,
)
from shardwise.checkpoint.foreign.hf_safetensors import HfSafetensorsReader
from shardwise.checkpoint.manifest import CheckpointError


def summary(path: str, tag: str | None = None) -> str:
    """The report (module docstring); raises ``CheckpointError`` for a refused checkpoint,
    its message starting with the format found."""
    where = resolve(path, tag)
    found = detect(where)
    if found == SHARDWISE:
        return f"format: shardwise checkpoint (loads whole into any layout)\n{inspect_own(where)}"
    if found == HUGGINGFACE:
        with HfSafetensorsReader(where) as reader:
            return "\n".join(_weights_lines(reader, where))
    try:
        reader = open_checkpoint(where)
    except CheckpointError as e:
        raise CheckpointError(f"format: {found or 'unknown'} at {where}: refused: {e}") from None
    with reader:
        return "\n".join(_lines(reader, where))


def _lines(reader: Any, where: str) -> list[str]:
    info = reader.describe()
    layout = ", ".join(f"{k} {v}" for k, v in info["layout"].items())
    names = reader.names()
    kinds = {"model": [], "master": [], "optim": []}
    for name in names:
        kinds.setdefault(name.partition("/")[0], []).append(name)
    keys = sorted({n.split("/")[1] for n in kinds["optim"]})
    meta, shared = reader.meta, reader.rank_state(0)
    groups = meta.get("param_groups")
    lines = [
        f"format: {info['format']} at {where}",
        f"source layout: {layout}",
        *(f"{k}: {v}" for k, v in info.get("notes", {}).items()),
        "loads (into any layout; all of it or nothing):",
        f"  weights: {len(kinds['model'])} tensors ({_numel(reader, kinds['model'])} elements)",
        f"  fp32 masters: {len(kinds['master'])} tensors"
        if kinds["master"]
        else "  fp32 masters: none saved (fp32 training: the weights are the masters)",
        f"  optimizer states: {', '.join(keys) or 'none'} ({len(kinds['optim'])} tensors)",
        f"  optimizer hyper-parameters: {len(groups)} groups ({', '.join(sorted(groups[0]))})"
        if groups
        else "  optimizer hyper-parameters: none saved (this run's stay)",
        f"  loss scaler: {meta['loss_scaler']}",
        f"  counters: {meta['counters']}",
        f"  lr scheduler: {shared.get('lr_scheduler')}",
        f"  client state: keys {sorted(shared.get('client_state') or {})}",
        "  random state, data position: not saved by this format (this run's stay)",
    ]
    if meta.get("aliases"):
        lines.append(f"  tied weights: {meta['aliases']}")
    lines.append("dropped:" if info["dropped"] else "dropped: nothing")
    lines += [f"  {k}: {why}" for k, why in sorted(info["dropped"].items())]
    rows = [(n, str(reader.pieces(n)[0].dtype).removeprefix("torch."),
             "x".join(map(str, reader.pieces(n)[0].global_shape)) or "scalar",
             str(len(reader.pieces(n)))) for n in names]  # fmt: skip
    widths = [
        max(len(r[i]) for r in [("tensor", "dtype", "shape", "pieces"), *rows]) for i in range(4)
    ]
    lines.append(f"tensors ({len(rows)}):")
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
              for r in [("tensor", "dtype", "shape", "pieces"), *rows]]  # fmt: skip
    return lines


def _weights_lines(reader: Any, where: str) -> list[str]:
    """A weights-only directory (Hugging Face safetensors): what it holds and how it loads."""
    info, names = reader.describe(), reader.names()
    layout = ", ".join(f"{k} {v}" for k, v in info["layout"].items())
    lines = [
        f"format: {info['format']} at {where}",
        f"source layout: {layout}",
        "loads with engine.load_module_state_dict(path), into any layout, each rank reading",
        f"only its slices: weights: {len(names)} tensors ({_numel(reader, names)} elements)",
        "dropped:",
    ]
    lines += [f"  {k}: {why}" for k, why in sorted(info["dropped"].items())]
    lines.append(f"tensors ({len(names)}):")
    for n in names:
        p = reader.pieces(n)[0]
        shape = "x".join(map(str, p.global_shape)) or "scalar"
        lines.append(f"  {n}  {str(p.dtype).removeprefix('torch.')}  {shape}")
    return lines


def _numel(reader: Any, names: list[str]) -> int:
    return sum(math.prod(reader.pieces(n)[0].global_shape) for n in names)
