"""Hugging Face safetensors weights (a sharded ``model.safetensors.index.json`` with its shard
files, or one ``model.safetensors``) read as checkpoint pieces, slice by slice.

Each stored tensor ``<key>`` is one whole-box piece "model/<key>" (pieces.py), so the resharding
reader (reshard.py) loads it into any layout: a ZeRO-3 rank asks for the rows of its flat
shard, a tensor-parallel rank for its block, and ``read`` hands the request to safetensors'
``safe_open(file).get_slice(key)[index]``, which reads those bytes of the file and nothing
else. No rank reads the whole model. The headers (names, dtypes, shapes) are all a reader
parses up front; ``bytes_read`` and ``tensors_opened`` count what it read since.

The index's ``weight_map`` says which file holds each key; a key the index names but its file
lacks, or a file outside the directory, is refused before anything is read.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.piece_index import PieceIndex
from shardwise.checkpoint.reshard import HeldPiece
from shardwise.checkpoint.safetensors_file import dtype_from_code

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def is_hf(path: str) -> bool:
    """``path`` is a directory of Hugging Face safetensors weights, or such a file."""
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    return any(os.path.isfile(os.path.join(path, n)) for n in (INDEX, SINGLE))


def _files(path: str) -> dict[str, list[str]]:
    """{shard file: its keys}, from the index (or the single file's header)."""
    if os.path.isfile(path):
        return {path: []}
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return {os.path.join(path, SINGLE): []}
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' naming the file of each tensor")
    out: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        file = os.path.normpath(os.path.join(path, name))
        if os.path.dirname(file) != os.path.normpath(path):
            raise CheckpointError(f"{index}: {key!r} is in {name!r}, outside the directory")
        out.setdefault(file, []).append(key)
    return out


class HfSafetensorsReader(PieceIndex):
    """The weights in ``path`` (module docstring), as the reader protocol of reshard.fill."""

    format = "huggingface"

    def __init__(self, path: str) -> None:
        self.path = path
        self._open: dict[str, Any] = {}
        self._pieces: dict[str, list[HeldPiece]] = {}
        self._where: dict[str, tuple[str, str]] = {}  # piece name -> (file, key)
        self.bytes_read, self.tensors_opened = 0, set()
        for file, keys in _files(path).items():
            if not os.path.isfile(file):
                raise CheckpointError(f"{path}: shard file {file} is missing; nothing was loaded")
            handle = self._handle(file)
            held = set(handle.keys())
            missing = [k for k in keys if k not in held]
            if missing:
                raise CheckpointError(f"{file} lacks {missing[:3]}, which the index places there")
            for key in keys or sorted(held):
                part = handle.get_slice(key)
                shape = tuple(int(n) for n in part.get_shape())
                name = f"model/{key}"
                box = tuple((0, n) for n in shape)
                dtype = dtype_from_code(part.get_dtype())
                self._pieces[name] = [HeldPiece(name, dtype, shape, box, None, None)]
                self._where[name] = (file, key)

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file]

    def _missing(self, name: str) -> str:
        return f"tensor {name[6:]!r} is not in the safetensors of {self.path}"

    def read(self, piece: Any, index: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``piece``'s tensor, or its part ``index`` (a tuple of slices: only those bytes are
        read from the file), into ``out`` (cast) when given."""
        file, key = self._where[piece.name]
        handle = self._handle(file)
        if index is None or not piece.global_shape:
            t = handle.get_tensor(key)
        else:
            t = handle.get_slice(key)[index]  # only the slice's bytes are read from the file
        self.bytes_read += t.numel() * t.element_size()  # what the safetensors call read
        self.tensors_opened.add(key)
        return t if out is None else out.copy_(t)

    @property
    def meta(self) -> dict:
        return {}

    def describe(self) -> dict[str, Any]:
        """What ``shardwise checkpoint inspect`` prints: weights only, nothing else to load."""
        size = sum(
            math.prod(p[0].global_shape) * p[0].dtype.itemsize for p in self._pieces.values()
        )
        layout = {"files": len(self._open), "tensors": len(self._pieces), "bytes": size}
        dropped = {"optimizer, scheduler, counters": "weights only: Hugging Face saves none here"}
        return {"format": "Hugging Face safetensors weights", "layout": layout, "dropped": dropped}

    def close(self) -> None:
        self._open = {}  # safe_open handles close when dropped

    def __enter__(self) -> HfSafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
