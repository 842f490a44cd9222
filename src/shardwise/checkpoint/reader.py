"""Open a checkpoint, check it, and read only the slices a rank needs.

On open: manifest.json parses, is ours and matches its own checksum (unless ``verify=False``),
and its pieces fit their tensors' shapes (manifest.py); every rank's file exists with the recorded size;
its header (which holds the rank state) matches its CRC-32 and lists every piece with the
recorded dtype and shape. On read: the bytes of the slice asked (for a box piece: the rows of
dim 0 it spans) and, with ``verify=True``, the rest of the 1 MiB checksum chunks they touch,
each chunk checked against its CRC-32 the first time it is read. Every error is a ``CheckpointError`` naming the file
and the tensor. Nothing is unpickled: JSON and raw bytes only.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any

import torch

from shardwise.checkpoint import manifest as mf
from shardwise.checkpoint.manifest import CheckpointError, SavedPiece, rank_file
from shardwise.checkpoint.piece_index import PieceIndex
from shardwise.checkpoint.safetensors_file import (
    CRC_CHUNK,
    FormatError,
    Header,
    dtype_code,
    dtype_from_code,
    read_header,
    read_range,
)
from shardwise.checkpoint.state_codec import StateError, decode

RANK_STATE_KEY = "shardwise.rank_state"
_WINDOW = 64  # checksum chunks check() reads at a time
Index = tuple[slice, ...] | slice | None


class CheckpointReader(PieceIndex):
    """A checked, read-only view of the checkpoint in directory ``path``."""

    def __init__(self, path: str, verify: bool = True) -> None:
        self.path = path
        self.verify = verify
        where = os.path.join(path, mf.MANIFEST)
        if not os.path.isfile(where):
            raise CheckpointError(
                f"{where} does not exist: {path} is not a checkpoint, or its save did not finish"
            )
        with open(where, "rb") as f:
            self.manifest = mf.parse(f.read(), where, verify=verify)
        self._pieces = {
            name: mf.pieces_of(self.manifest, name) for name in self.manifest["tensors"]
        }
        self._headers: dict[str, Header] = {}
        self._handles: dict[str, Any] = {}
        self._verified: set[tuple[str, str, int]] = set()
        self._scratch: torch.Tensor | None = None  # check()'s reading buffer
        for file, record in self.manifest["files"].items():
            self._headers[file] = self._check_file(file, record)
        for pieces in self._pieces.values():
            for p in pieces:
                self._entry(p.file, p.key, p.dtype, p.shape)

    # ------------------------------------------------------------------ what it holds

    @property
    def meta(self) -> dict:
        return self.manifest["meta"]

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def tag(self) -> str:
        return str(self.manifest["tag"])

    def _missing(self, name: str) -> str:
        some = ", ".join(list(self._pieces)[:5])
        return (
            f"tensor {name!r} is not in checkpoint {self.path} ({len(self._pieces)} tensors: "
            f"{some}, ...): was it saved from another model?"
        )

    # ------------------------------------------------------------------ reading

    def read(
        self, piece: SavedPiece, index: Index = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The stored tensor of ``piece`` (shape ``piece.shape``), or its part ``index``: a tuple
        of unit-step slices for a whole-box piece, one slice for a flat piece. A fresh tensor,
        or ``out`` filled (same shape) when given (read straight into it when it is a
        contiguous CPU tensor of the piece's dtype; its contents are undefined after an error).

        Reads the elements from the first to the last of ``index`` in row-major order (for a
        box piece: the rows of dim 0 it spans), plus, with ``verify``, the rest of the checksum
        chunks they touch, unless those were checked already."""
        where = f"{os.path.join(self.path, piece.file)} tensor {piece.key!r}"
        index = _normalize(index, piece, where)
        shape, numel = piece.shape, math.prod(piece.shape)
        inner = math.prod(shape[1:]) if shape else 1
        rows = index[0] if index else slice(0, shape[0] if shape else 1)
        rest = (
            index[1:]
            if any((s.start, s.stop) != (0, n) for s, n in zip(index[1:], shape[1:], strict=False))
            else ()
        )
        lo, hi = rows.start * inner, rows.stop * inner
        direct = (
            out is not None and (lo, hi) == (0, numel) and not rest and out.is_contiguous()
            and out.dtype == piece.dtype and tuple(out.shape) == shape and out.device.type == "cpu"
        )  # fmt: skip
        try:
            flat = self._elements(piece.file, piece.key, piece.dtype, piece.crc32, lo, hi,
                                  out.view(-1) if direct else None)  # fmt: skip
        except FormatError as e:
            raise CheckpointError(f"{where}: {e}") from e
        if direct:
            return out
        part = flat.view(rows.stop - rows.start, *shape[1:]) if shape else flat.view(())
        if rest:
            part = part[(slice(None), *rest)]
        return _deliver(part, out)

    def _elements(
        self,
        file: str,
        key: str,
        dtype: torch.dtype,
        crcs: tuple[int, ...],
        lo: int,
        hi: int,
        out: torch.Tensor | None = None,
        force: bool = False,
    ) -> torch.Tensor:
        """Elements [lo, hi) of stored tensor ``key`` as a 1-D tensor (``out`` if given, else
        possibly a view of a larger buffer), the checksum chunks they touch checked once."""
        header = self._headers[file]
        begin, end = header.entries[key]["data_offsets"]
        size, per_chunk = dtype.itemsize, CRC_CHUNK // dtype.itemsize
        numel = (end - begin) // size
        first, stop = lo // per_chunk, max(-(-hi // per_chunk), lo // per_chunk + 1)
        todo = (self.verify or force) and any(
            (file, key, c) not in self._verified for c in range(first, stop)
        )
        a, b = (first * per_chunk, min(stop * per_chunk, numel)) if todo else (lo, hi)
        buf = out if out is not None and (a, b) == (lo, hi) else None
        buf = read_range(self._handle(file), header.data_start, begin + a * size, begin + b * size,
                         dtype, buf)  # fmt: skip
        if todo:
            raw = memoryview(buf.view(torch.uint8).numpy()) if buf.numel() else memoryview(b"")
            for c in range(first, stop):
                chunk = raw[(c - first) * CRC_CHUNK : (c - first + 1) * CRC_CHUNK]
                if c >= len(crcs) or zlib.crc32(chunk) != crcs[c]:
                    raise CheckpointError(
                        f"{os.path.join(self.path, file)} tensor {key!r}: checksum mismatch in "
                        f"bytes {c * CRC_CHUNK}..{c * CRC_CHUNK + len(chunk)}, the file is corrupted"
                    )
                self._verified.add((file, key, c))
        part = buf[lo - a : hi - a]
        if out is not None and part.data_ptr() != out.data_ptr():
            out.copy_(part)
            return out
        return part

    def check(self, piece: SavedPiece, lo: int, hi: int) -> None:
        """With ``verify``: check the checksum chunks holding elements [lo, hi) of ``piece``'s
        stored tensor not checked yet, reading them 64 at a time into one reused buffer, so
        that a later ``read`` of that range reads only what it returns (a load checks
        everything before it assigns anything)."""
        if not self.verify or lo >= hi:
            return
        size = piece.dtype.itemsize
        per_chunk = CRC_CHUNK // size
        begin, end = self._headers[piece.file].entries[piece.key]["data_offsets"]
        numel = (end - begin) // size
        first, stop = lo // per_chunk, -(-hi // per_chunk)
        if self._scratch is None:
            self._scratch = torch.empty(_WINDOW * CRC_CHUNK, dtype=torch.uint8)
        where = f"{os.path.join(self.path, piece.file)} tensor {piece.key!r}"
        for c in range(first, stop, _WINDOW):
            c1 = min(c + _WINDOW, stop)
            if all((piece.file, piece.key, k) in self._verified for k in range(c, c1)):
                continue
            a, b = c * per_chunk, min(c1 * per_chunk, numel)
            out = self._scratch[: (b - a) * size].view(piece.dtype)
            try:
                self._elements(piece.file, piece.key, piece.dtype, piece.crc32, a, b, out)
            except FormatError as e:
                raise CheckpointError(f"{where}: {e}") from e

    def rank_state(self, rank: int) -> dict:
        """What rank ``rank`` saved as its rank state, tensors restored."""
        file = rank_file(rank)
        if file not in self._headers:
            raise CheckpointError(f"{self.path} has no rank {rank} (world size {self.world_size})")
        where = os.path.join(self.path, file)
        try:
            state = json.loads(self._headers[file].metadata[RANK_STATE_KEY])
            return decode(state, lambda key: self._state_tensor(file, key))
        except (KeyError, TypeError, ValueError, StateError) as e:
            raise CheckpointError(
                f"{where}: unreadable rank state ({type(e).__name__}: {e})"
            ) from e

    def _state_tensor(self, file: str, key: str) -> torch.Tensor:
        crc = self.manifest["files"][file]["state_crc32"].get(key)
        entry = self._headers[file].entries.get(key)
        if crc is None or entry is None:
            raise CheckpointError(f"{os.path.join(self.path, file)}: no rank-state tensor {key!r}")
        dtype, shape = dtype_from_code(entry["dtype"]), tuple(entry["shape"])
        self._entry(file, key, dtype, shape)
        crcs = tuple(crc)
        return self._elements(file, key, dtype, crcs, 0, math.prod(shape), force=True).view(shape)

    def verify_all(self) -> int:
        """Read every stored tensor and check its CRC-32s; return the bytes checked."""
        self._verified.clear()
        total = 0
        for pieces in self._pieces.values():
            for p in pieces:
                n = math.prod(p.shape)
                self._elements(p.file, p.key, p.dtype, p.crc32, 0, n, force=True)
                total += n * p.dtype.itemsize
        for rank in range(self.world_size):
            self.rank_state(rank)
        return total

    # ------------------------------------------------------------------ files

    def _check_file(self, file: str, record: dict) -> Header:
        path = os.path.join(self.path, file)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path} is missing (the file of rank {record['rank']}): the checkpoint is "
                "incomplete"
            )
        size = os.path.getsize(path)
        if size != record["size"]:
            raise CheckpointError(
                f"{path} has {size} bytes, the manifest says {record['size']}: truncated or "
                "overwritten"
            )
        try:
            header = read_header(path, size)
        except FormatError as e:
            raise CheckpointError(f"{path}: {e}") from e
        if header.data_start != record["header_bytes"] or (
            self.verify and header.crc32 != record["header_crc32"]
        ):
            raise CheckpointError(f"{path}: header checksum mismatch, the file is corrupted")
        return header

    def _entry(self, file: str, key: str, dtype: torch.dtype, shape: tuple) -> None:
        """Check that ``file`` holds ``key`` as the manifest says."""
        header = self._headers[file]
        entry = header.entries.get(key)
        path = os.path.join(self.path, file)
        if entry is None:
            raise CheckpointError(f"{path} has no tensor {key!r}, which the manifest lists")
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            ok = entry["dtype"] == dtype_code(dtype) and tuple(entry["shape"]) == tuple(shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        ok = ok and 0 <= begin and end - begin == math.prod(shape) * dtype.itemsize
        if not ok or header.data_start + end > record_size(self.manifest, file):
            raise CheckpointError(
                f"{path} tensor {key!r}: stored as {entry}, the manifest says {dtype} {shape}"
            )

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = open(os.path.join(self.path, file), "rb")  # noqa: SIM115
        return self._handles[file]

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()
        self._scratch = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_size(manifest: dict, file: str) -> int:
    return int(manifest["files"][file]["size"])


def _normalize(index: Index, piece: SavedPiece, where: str) -> tuple:
    """``index`` as a tuple of unit-step slices over the stored tensor (() = all of it)."""
    if index is None:
        return ()
    if piece.flat is not None and isinstance(index, slice):
        index = (index,)
    if not isinstance(index, tuple):
        index = (index,)
    shape = piece.shape
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise CheckpointError(f"{where}: index {index!r} is not {len(shape)} slices")
    if any(s.indices(n)[2] != 1 for s, n in zip(index, shape, strict=False)):
        raise CheckpointError(f"{where}: index {index!r} has a step; only unit steps are read")
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _deliver(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:  # a fresh tensor, not a view that keeps a larger buffer alive
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        return t if whole else t.clone()
    if tuple(out.shape) != tuple(t.shape):
        raise CheckpointError(f"out has shape {tuple(out.shape)}, the slice read {tuple(t.shape)}")
    return out.copy_(t)
