"""One plain safetensors file of the model's weights, and a readable summary of a checkpoint.

``export_consolidated`` assembles each ``model/<name>`` global tensor from its pieces and
writes it under ``<name>``, the parameter's name in the user's unwrapped model, so that
``model.load_state_dict(safetensors.torch.load_file(out))`` works without shardwise. Tensors
are assembled and written one at a time: memory holds the largest tensor, not the model.
Every element must come from some piece; a tensor with holes is an error, never zeros.
"""

from __future__ import annotations

import datetime
import json
import math
import os

import torch

from shardwise.checkpoint.manifest import CheckpointError, SavedPiece
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.safetensors_file import FormatError, write_file
from shardwise.checkpoint.storage import resolve

MODEL, MASTER = "model/", "master/"
_EXPORT_DTYPES = (None, "fp32")


def assemble(reader: CheckpointReader, name: str) -> torch.Tensor:
    """The whole global tensor ``name``, from every saved piece (padding dropped)."""
    pieces = reader.pieces(name)
    shape, dtype = pieces[0].global_shape, pieces[0].dtype
    out = torch.zeros(shape, dtype=dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for p in pieces:
        _place(reader, p, out, covered)
    missing = int((~covered).sum())
    if missing:
        raise CheckpointError(
            f"tensor {name!r} in {reader.path}: {missing} of {covered.numel()} elements are in no "
            "piece; the checkpoint is incomplete"
        )
    return out


def _place(
    reader: CheckpointReader, p: SavedPiece, out: torch.Tensor, covered: torch.Tensor
) -> None:
    """Copy piece ``p`` into ``out`` and mark its elements in ``covered``."""
    shape = p.global_shape
    region = tuple(slice(a, min(b, n)) for (a, b), n in zip(p.box, shape, strict=True))
    crop = tuple(slice(0, min(b, n) - a) for (a, b), n in zip(p.box, shape, strict=True))
    data = reader.read(p)
    if p.flat is None:
        out[region] = data[crop]
        covered[region] = True
        return
    a, b = p.flat
    if p.box == tuple((0, n) for n in shape):  # a ZeRO shard of a whole tensor: one range
        out.view(-1)[a:b] = data
        covered.view(-1)[a:b] = True
        return
    # Flat range over a (tensor-parallel, maybe padded) box: unflatten in the box, keep the
    # elements that fall inside the global tensor.
    buf = torch.zeros(math.prod(p.box_shape), dtype=data.dtype)
    mask = torch.zeros(buf.shape, dtype=torch.bool)
    buf[a:b], mask[a:b] = data, True
    buf, mask = buf.view(p.box_shape)[crop], mask.view(p.box_shape)[crop]
    out[region][mask] = buf[mask]
    covered[region] |= mask


def export_consolidated(
    path: str, out_file: str, dtype: str | None = None, tag: str | None = None
) -> list[str]:
    """Write the model's weights of checkpoint ``path`` (a checkpoint, or a save directory with
    ``latest``; ``tag`` picks another) to ``out_file``; return the names written.

    dtype None: the model's dtype (what ``model/`` holds); "fp32": the fp32 master weights
    where the checkpoint has them, else the model weights in fp32. A manifest meta
    ``"aliases": {name: saved_name}`` (tied weights) writes ``name`` too.
    """
    if dtype not in _EXPORT_DTYPES:
        raise CheckpointError(f"dtype={dtype!r}: use None (the model's dtype) or 'fp32'")
    with CheckpointReader(resolve(path, tag)) as reader:
        sources = {n[len(MODEL) :]: n for n in reader.names() if n.startswith(MODEL)}
        if not sources:
            raise CheckpointError(f"{reader.path} holds no {MODEL}* tensors: nothing to export")
        if dtype == "fp32":
            sources = {k: MASTER + k if MASTER + k in reader else v for k, v in sources.items()}
        aliases = reader.meta.get("aliases", {}) if isinstance(reader.meta, dict) else {}
        for alias, saved in aliases.items():
            if saved not in sources:
                raise CheckpointError(f"meta aliases: {alias!r} -> {saved!r}, not a saved weight")
            sources.setdefault(alias, sources[saved])

        def out_dtype(key: str) -> torch.dtype:
            return torch.float32 if dtype == "fp32" else reader.pieces(sources[key])[0].dtype

        def produce(key: str) -> torch.Tensor:
            return assemble(reader, sources[key]).to(out_dtype(key))

        specs = [
            (k, out_dtype(k), reader.pieces(sources[k])[0].global_shape) for k in sorted(sources)
        ]
        tmp = f"{out_file}.tmp-{os.getpid()}"
        try:
            write_file(tmp, specs, produce, {"format": "pt", "source": reader.path})
            os.replace(tmp, out_file)
        except (OSError, FormatError) as e:
            raise CheckpointError(f"{out_file}: {e}") from e
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return [k for k, _, _ in specs]


def inspect(path: str, tag: str | None = None, verify: bool = False) -> str:
    """A readable summary: tag, step and layout (meta), files, tensors with shapes and sizes.
    Opening checks the manifest (its checksum too); ``verify`` also reads every tensor and
    checks its checksum."""
    with CheckpointReader(resolve(path, tag)) as r:
        m = r.manifest
        created = datetime.datetime.fromtimestamp(m["created"]).isoformat(timespec="seconds")
        versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        lines = [
            f"checkpoint {r.path}",
            f"  tag {r.tag}, step {m['step']}, saved {created} by {r.world_size} ranks "
            f"({versions})",
        ]
        lines += [f"  {k}: {_short(v)}" for k, v in r.meta.items()]
        lines.append(f"files ({len(m['files'])}):")
        lines += [f"  {f}  {_size(rec['size'])}" for f, rec in m["files"].items()]
        rows = [("tensor", "dtype", "global shape", "pieces", "stored")]
        total = 0
        for name in r.names():
            pieces = r.pieces(name)
            stored = sum(math.prod(p.shape) * p.dtype.itemsize for p in pieces)
            total += stored
            shape = "x".join(map(str, pieces[0].global_shape)) or "scalar"
            rows.append((name, str(pieces[0].dtype).removeprefix("torch."), shape,
                         str(len(pieces)), _size(stored)))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.append(f"tensors ({len(rows) - 1}, {_size(total)}):")
        lines += [
            ("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))).rstrip()
            for row in rows
        ]
        if verify:
            lines.append(f"verified: {_size(r.verify_all())} read, every checksum matches")
    return "\n".join(lines)


def _short(value: object, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
