"""``manifest.json``: what a checkpoint holds, where, and the checksums to trust it.

    {"format": "shardwise.checkpoint", "version": 2, "tag": "global_step10", "step": 10,
     "created": 1700000000.0, "world_size": 2, "versions": {"torch": ..., ...},
     "meta": {...the caller's: layout, step, ...},
     "files": {"rank_00000.safetensors": {"rank": 0, "size": ..., "header_bytes": ...,
                                          "header_crc32": ..., "state_crc32": {key: [...]}},
               ...},
     "tensors": {"model/w": {"dtype": "float32", "global_shape": [8, 6],
                             "pieces": [{"box": [[0, 4], [0, 6]], "flat": null,
                                         "file": "rank_00000.safetensors", "key": "model/w",
                                         "crc32": [...]}, ...]}, ...},
     "manifest_crc32": 123456789}

``crc32`` lists the CRC-32 of each ``crc_chunk`` bytes of the stored tensor (safetensors_file).
``step`` is the training step saved (null when the caller gave none): rotation and the check
for checkpoints ahead of a run order by it. ``manifest_crc32`` is the CRC-32 of the manifest
itself: of its canonical JSON (keys sorted, no spaces) without that key, so that the manifest
is checked like the data (``seal``, ``parse``). Version 1 manifests (no ``step``, no
``manifest_crc32``) are still read.

``parse`` also checks that each tensor's pieces fit its global shape (a whole-box piece inside
it, a flat range inside its box) and hold at least as many elements as the shape has: a
``global_shape`` inflated by corruption or by hand is refused before anything is allocated.

A piece is described as in ``pieces.py``. Whole-box pieces are stored cropped to the logical box
(padding past ``global_shape`` is not written); flat pieces are stored as given, so a loader
skips the flat elements that fall into padding.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.safetensors_file import (
    CRC_CHUNK,
    FormatError,
    dtype_from_name,
    dtype_name,
)

FORMAT = "shardwise.checkpoint"
VERSION = 2
READ_VERSIONS = (1, 2)  # 1: before ``step`` and ``manifest_crc32``
CHECKSUM_KEY = "manifest_crc32"
MANIFEST = "manifest.json"
FILE_KEYS = ("rank", "size", "header_bytes", "header_crc32", "state_crc32")
FILE_RE = re.compile(r"rank_\d{5}\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the file and tensor."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass(frozen=True)
class SavedPiece:
    """One stored piece: which part of global tensor ``name`` the tensor at ``file``/``key``
    holds (``box`` and ``flat`` as in ``Piece``)."""

    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    flat: tuple[int, int] | None
    file: str
    key: str
    crc32: tuple[int, ...] = ()  # per CRC_CHUNK bytes of the stored tensor

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the stored tensor."""
        return self.box_shape if self.flat is None else (self.flat[1] - self.flat[0],)


def stored_piece(p: Piece) -> tuple[tuple[tuple[int, int], ...], torch.Tensor] | None:
    """(box, tensor) as stored: checked against its description, a whole-box piece cropped to
    the logical box; None when the piece holds padding only."""
    where = f"piece {p.name!r} (box {p.box}, flat {p.flat})"
    if len(p.box) != len(p.global_shape):
        raise CheckpointError(f"{where}: box has {len(p.box)} dims, global_shape {p.global_shape}")
    if any(not 0 <= a <= b for a, b in p.box):
        raise CheckpointError(f"{where}: every box range must be 0 <= start <= stop")
    if p.flat is not None:
        a, b = p.flat
        if p.tensor.dim() != 1 or p.tensor.numel() != b - a or not 0 <= a <= b:
            raise CheckpointError(f"{where}: a flat piece needs a 1-D tensor of {b - a} elements")
        if b > math.prod(p.box_shape):
            raise CheckpointError(f"{where}: flat range exceeds the box's {math.prod(p.box_shape)}")
        return tuple(p.box), p.tensor
    if tuple(p.tensor.shape) != p.box_shape:
        raise CheckpointError(f"{where}: tensor shape {tuple(p.tensor.shape)} != box shape")
    logical = tuple((min(a, n), min(b, n)) for (a, b), n in zip(p.box, p.global_shape, strict=True))
    if math.prod(b - a for a, b in logical) == 0 and p.tensor.numel() > 0:
        return None  # padding only: nothing of the real tensor
    crop = tuple(slice(0, b - a) for a, b in logical)
    return logical, p.tensor[crop] if logical != tuple(p.box) else p.tensor


def piece_entry(p: Piece, box: tuple, key: str, crc: list[int]) -> dict[str, Any]:
    return {
        "name": p.name,
        "dtype": dtype_name(p.tensor.dtype),
        "global_shape": list(p.global_shape),
        "box": [list(r) for r in box],
        "flat": list(p.flat) if p.flat is not None else None,
        "key": key,
        "crc32": crc,
    }


def build(
    tag: str, meta: dict, infos: list[dict], created: float, versions: dict, step: int | None
) -> dict:
    """The manifest from every rank's file info, sealed (``seal``); pieces of one name must
    agree on dtype and global shape."""
    files, tensors = {}, {}
    for info in infos:
        file = info["file"]
        files[file] = {k: info[k] for k in FILE_KEYS}
        for e in info["pieces"]:
            t = tensors.setdefault(
                e["name"], {"dtype": e["dtype"], "global_shape": e["global_shape"], "pieces": []}
            )
            if (t["dtype"], t["global_shape"]) != (e["dtype"], e["global_shape"]):
                first = t["pieces"][0]["file"] if t["pieces"] else "?"
                raise CheckpointError(
                    f"tensor {e['name']!r}: {file} saves it as {e['dtype']} "
                    f"{e['global_shape']} but {first} as {t['dtype']} {t['global_shape']}"
                )
            t["pieces"].append({k: e[k] for k in ("box", "flat", "key", "crc32")} | {"file": file})
    return seal(
        {
            "format": FORMAT,
            "version": VERSION,
            "crc_chunk": CRC_CHUNK,
            "tag": tag,
            "step": step,
            "created": created,
            "world_size": len(infos),
            "versions": versions,
            "meta": meta,
            "files": files,
            "tensors": tensors,
        }
    )


def _checksum(m: dict) -> int:
    body = {k: v for k, v in m.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return zlib.crc32(text.encode())


def seal(m: dict) -> dict:
    """``m`` with its ``manifest_crc32`` (the CRC-32 of its canonical JSON without that key)."""
    return {**m, CHECKSUM_KEY: _checksum(m)}


def parse(text: bytes, where: str, verify: bool = True) -> dict:
    """Load and check a manifest (JSON only): its checksum (``verify``), its structure, and
    that every tensor's pieces fit its global shape; errors name ``where``."""
    try:
        m = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not JSON ({e}): corrupted, or not a checkpoint") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a shardwise checkpoint manifest (no format {FORMAT!r})"
        )
    if m.get("version") not in READ_VERSIONS or m.get("crc_chunk") != CRC_CHUNK:
        raise CheckpointError(
            f"{where}: format version {m.get('version')!r} with checksums per "
            f"{m.get('crc_chunk')!r} bytes; we read versions {READ_VERSIONS}, {CRC_CHUNK}"
        )
    if verify and m["version"] >= 2 and m.get(CHECKSUM_KEY) != _checksum(m):
        raise CheckpointError(
            f"{where}: manifest checksum mismatch ({CHECKSUM_KEY} {m.get(CHECKSUM_KEY)!r}, "
            f"content {_checksum(m)}): the manifest was corrupted or edited after the save"
        )
    try:
        _check_files(m["files"], m["world_size"])
        if m.setdefault("step", None) is not None and not isinstance(m["step"], int):
            raise TypeError(f"step {m['step']!r} is not an integer")
        if not all(isinstance(m[k], dict) for k in ("meta", "files", "tensors", "versions")):
            raise TypeError("meta, files, tensors and versions must be JSON objects")
        for name in m["tensors"]:
            pieces_of(m, name)
    except (KeyError, TypeError, ValueError, FormatError) as e:
        raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e
    return m


def _check_files(files: dict, world_size: int) -> None:
    ranks = sorted(int(f["rank"]) for f in files.values())
    if ranks != list(range(world_size)):
        raise ValueError(f"files cover ranks {ranks}, world size is {world_size}")
    for name, f in files.items():
        if not FILE_RE.fullmatch(name) or name != rank_file(f["rank"]):
            raise ValueError(f"file name {name!r} is not rank_NNNNN.safetensors of its rank")
        for k in ("size", "header_bytes", "header_crc32"):
            if not isinstance(f[k], int):
                raise ValueError(f"{name}: {k} is not an integer")
        for crcs in f["state_crc32"].values():
            _crcs(crcs)


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    out = tuple((int(a), int(b)) for a, b in value)
    if any(not 0 <= a <= b for a, b in out):
        raise ValueError(f"bad ranges {value!r}")
    return out


def _crcs(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) for v in value):
        raise ValueError(f"checksums {value!r} are not a list of integers")
    return tuple(value)


def pieces_of(m: dict, name: str) -> list[SavedPiece]:
    """The saved pieces of tensor ``name``, checked against its global shape: a whole-box piece
    lies inside it, a flat range inside its box, and the pieces hold at least as many elements
    as the shape has (an inflated shape is refused before anyone allocates it)."""
    t = m["tensors"][name]
    dtype = dtype_from_name(t["dtype"])
    shape = tuple(int(n) for n in t["global_shape"])
    if any(n < 0 for n in shape) or not t["pieces"]:
        raise ValueError(f"tensor {name!r}: global_shape {list(shape)} or no pieces")
    out, held = [], 0
    for p in t["pieces"]:
        box = _ranges(p["box"])
        flat = None if p["flat"] is None else _ranges([p["flat"]])[0]
        if p["file"] not in m["files"] or len(box) != len(shape):
            raise ValueError(f"tensor {name!r}: piece {p!r} names an unknown file or bad box")
        size = math.prod(b - a for a, b in box)
        if flat is None and any(b > n for (_, b), n in zip(box, shape, strict=True)):
            raise ValueError(f"tensor {name!r}: box {p['box']} exceeds global_shape {list(shape)}")
        if flat is not None and flat[1] > size:
            raise ValueError(f"tensor {name!r}: flat {p['flat']} exceeds its box {p['box']}")
        held += size if flat is None else flat[1] - flat[0]
        crcs = _crcs(p["crc32"])
        out.append(SavedPiece(name, dtype, shape, box, flat, p["file"], str(p["key"]), crcs))
    if held < math.prod(shape):
        raise ValueError(
            f"tensor {name!r}: global_shape {list(shape)} has {math.prod(shape)} elements, "
            f"its pieces hold {held}"
        )
    return out
