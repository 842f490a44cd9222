"""Write and read safetensors files without extra copies, with a CRC-32 per tensor.

The safetensors layout (https://huggingface.co/docs/safetensors):

    [8 bytes: N, little-endian u64][N bytes: JSON header, space-padded][data bytes]
    header = {key: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
              "__metadata__": {str: str}}

Offsets are relative to the start of the data bytes; tensors are row-major and contiguous.

We write the file ourselves instead of calling ``safetensors.torch.save_file`` because that
function first copies every tensor into a Python ``bytes`` (twice the memory, one more pass);
here each tensor's memory goes straight to the file. We read with ``readinto`` into a fresh
tensor (one copy, from the page cache) instead of safetensors' mmap, whose tensors share memory
with every later read of the same key. The tests check both ways against the safetensors
library. Nothing here unpickles: the header is JSON, the data raw bytes.

Integrity: a CRC-32 of the header bytes (which also hold the rank state JSON) and one per
``CRC_CHUNK`` bytes of each tensor (so that reading a slice checks only the chunks it touches);
the manifest stores them and the reader checks them, so every byte of a file is covered.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# torch dtype -> safetensors code. Only these dtypes are stored; the manifest spells the torch
# name ("bfloat16") and the reader maps it back through this table, never through getattr.
_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {str(dt).removeprefix("torch."): dt for dt in _CODES}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
CRC_CHUNK = 2**20  # bytes per checksum: a slice read reads at most 2 chunks more than it needs


class FormatError(ValueError):
    """A file that is not the safetensors file the manifest describes (the caller names it)."""


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _CODES:
        raise FormatError(f"dtype {dtype} cannot be stored; supported: {sorted(DTYPES)}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise FormatError(f"unknown dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's row-major bytes, without a copy when it already is contiguous on the CPU."""
    t = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def dtype_from_code(code: object) -> torch.dtype:
    """The torch dtype of a safetensors dtype code ("F32")."""
    for dtype, c in _CODES.items():
        if c == code:
            return dtype
    raise FormatError(f"unsupported safetensors dtype {code!r}")


def dtype_code(dtype: torch.dtype) -> str:
    return _CODES[dtype]


def chunk_crcs(view: memoryview) -> list[int]:
    """CRC-32 of each ``CRC_CHUNK`` bytes of ``view`` (the last chunk may be shorter; an empty
    view has one, of nothing)."""
    return [zlib.crc32(view[i : i + CRC_CHUNK]) for i in range(0, max(len(view), 1), CRC_CHUNK)]


def tensor_crcs(t: torch.Tensor) -> list[int]:
    """``chunk_crcs`` of the bytes a file would store for ``t`` (what ``write_file`` records)."""
    return chunk_crcs(_bytes_view(t))


@dataclass
class FileRecord:
    """What the manifest keeps about a written file."""

    size: int
    header_bytes: int  # 8 + N: the header's share of ``size``
    header_crc32: int
    crc32: dict[str, list[int]] = field(default_factory=dict)  # key -> chunk_crcs of its bytes


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict) -> bytes:
    """The 8-byte length and the JSON header for tensors laid out in ``specs`` order."""
    header, offset = {}, 0
    for key, dtype, shape in specs:
        if dtype not in _CODES:
            raise FormatError(f"tensor {key!r}: dtype {dtype} cannot be stored")
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: str,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
    fsync: bool = True,
) -> FileRecord:
    """Write a safetensors file of the tensors ``specs`` lists (key, dtype, shape), in that
    order; ``produce(key)`` returns each one when its turn comes, so a caller can assemble
    tensors one at a time. ``fsync`` before returning."""
    head = _header(specs, metadata)
    record = FileRecord(len(head), len(head), zlib.crc32(head))
    with open(path, "wb") as f:
        f.write(head)
        for key, dtype, shape in specs:
            t = produce(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise FormatError(
                    f"tensor {key!r} is {t.dtype} {tuple(t.shape)}, not {dtype} {shape}"
                )
            view = _bytes_view(t)
            f.write(view)
            record.crc32[key] = chunk_crcs(view)  # the bytes are hot in the cache now
            record.size += view.nbytes
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return record


def write_tensors(
    path: str, items: list[tuple[str, torch.Tensor]], metadata: dict[str, str], fsync: bool = True
) -> FileRecord:
    """Write ``items`` (key, tensor), in order, as a safetensors file."""
    tensors = dict(items)
    specs = [(key, t.dtype, tuple(t.shape)) for key, t in items]
    return write_file(path, specs, tensors.__getitem__, metadata, fsync)


@dataclass
class Header:
    entries: dict[str, dict]  # key -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]
    data_start: int
    crc32: int


def read_header(path: str, size: int) -> Header:
    """Parse the header of ``path`` (``size`` bytes long), checking it fits the file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FormatError("shorter than 8 bytes: truncated or not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise FormatError(
                f"header length {n} does not fit in {size} bytes: truncated or not a "
                "safetensors file"
            )
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"header is not JSON ({e}): corrupted or not a safetensors file") from e
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object: not a safetensors file")
    metadata = header.pop("__metadata__", {}) or {}
    return Header(header, metadata, 8 + n, zlib.crc32(raw + text))


def read_range(
    f: object, data_start: int, begin: int, end: int, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """Bytes [begin, end) of the data section as a 1-D tensor of ``dtype`` (into ``out``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = (end - begin) // itemsize
    if out is None:
        out = torch.empty(numel, dtype=dtype)
    if numel == 0:
        return out
    f.seek(data_start + begin)
    got = f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
    if got != end - begin:
        raise FormatError(f"{got} of {end - begin} bytes read: the file is truncated")
    return out
