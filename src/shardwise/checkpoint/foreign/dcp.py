"""A ``torch.distributed.checkpoint`` (DCP) directory read as a shardwise checkpoint.

DCP (torchtitan's checkpoints, ``dcp.save``) writes ``.metadata`` (which tensor chunk or object
is where) and ``__R_0.distcp`` files of ``torch.save``-d chunks. torch's own reader unpickles
``.metadata`` with plain ``pickle.load``; here it is unpickled with an allow-list of DCP's own
inert dataclasses (Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...), torch.Size,
dtypes and paths, anything else refused naming it; every chunk and object is read with
``torch.load(weights_only=True)``. Keys, as torchtitan and ``get_state_dict`` flatten them:

    model.<p>                             "model/<p>", each saved chunk a box piece
    optimizer.state.<p>.<key>             "optim/<key>/<p>" (exp_avg, exp_avg_sq; step 0-dim)
    optimizer.param_groups.<i>.<k>        meta["param_groups"][i][k] (``params`` dropped: names)
    lr_scheduler.<k>                      rank state "lr_scheduler" {k: ...}
    train_state.step                      meta["counters"] (global_steps; global_samples =
                                          steps x the loading run's batch, DCP saves none)
    dataloader.*, anything else           dropped (listed by ``describe``)
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.piece_index import PieceIndex
from shardwise.checkpoint.reshard import HeldPiece

_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )  # fmt: skip
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _Metadata(pickle.Unpickler):
    """``.metadata``'s unpickler: DCP's dataclasses and a few torch values, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _ALLOWED and not dtype:
            raise CheckpointError(
                f"refused: .metadata holds a pickled '{module}.{name}', not one of DCP's own "
                "metadata classes; nothing of the file was run"
            )
        return getattr(importlib.import_module(module), name)


def is_dcp(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


class DcpReader(PieceIndex):
    """The DCP checkpoint in directory ``path`` (module docstring)."""

    format = "dcp"

    def __init__(self, path: str, samples_per_step: int = 0) -> None:
        self.path, self.tag = path, os.path.basename(os.path.normpath(path))
        with open(os.path.join(path, ".metadata"), "rb") as f:
            try:
                md = _Metadata(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
                raise CheckpointError(f"{path}/.metadata: unreadable ({e})") from None
        self._storage = md.storage_data
        self._where = {(i.fqn, tuple(i.offset or ())): i for i in self._storage}
        self._pieces: dict[str, list[HeldPiece]] = {}
        objects, self.dropped = {}, {}
        for fqn, item in md.state_dict_metadata.items():
            if hasattr(item, "chunks"):
                self._add_tensor(fqn, item)
            else:
                objects[fqn] = item
        self.meta, self._shared = self._objects(objects, samples_per_step)

    def _add_tensor(self, fqn: str, item: Any) -> None:
        name = _name(fqn)
        if name is None:
            self.dropped[fqn] = "a tensor outside model and optimizer state"
            return
        shape = tuple(int(n) for n in item.size)
        for chunk in item.chunks:
            box = tuple(
                (int(o), int(o) + int(s)) for o, s in zip(chunk.offsets, chunk.sizes, strict=True)
            )
            piece = HeldPiece(name, item.properties.dtype, shape, box, None, None)
            piece.index = self._index(fqn, tuple(chunk.offsets))
            self._pieces.setdefault(name, []).append(piece)

    def _index(self, fqn: str, offsets: tuple) -> Any:
        index = self._where.get((fqn, tuple(offsets)))
        if index is None:
            raise CheckpointError(f"{self.path}: no data for {fqn!r} at {offsets}")
        return index

    def _load(self, index: Any) -> Any:
        info = self._storage[index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.path}: {index.fqn!r} is stored transformed "
                                  f"({info.transform_descriptors}): not read")  # fmt: skip
        with open(os.path.join(self.path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)

    def _objects(self, objects: dict, samples_per_step: int) -> tuple[dict, dict]:
        groups: dict[int, dict] = {}
        sched, client = {}, {}
        for fqn in objects:
            index = self._index(fqn, ())
            if fqn.startswith("optimizer.param_groups."):
                i, _, key = fqn.removeprefix("optimizer.param_groups.").partition(".")
                if key != "params":
                    groups.setdefault(int(i), {})[key] = self._load(index)
            elif fqn.startswith("lr_scheduler."):
                sched[fqn.removeprefix("lr_scheduler.")] = self._load(index)
            elif fqn.startswith("train_state."):
                client[fqn.removeprefix("train_state.")] = self._load(index)
            else:
                self.dropped[fqn] = "not model, optimizer, scheduler or train state"
        steps = int(client.get("step", 0))
        counters = {"micro_steps": steps, "global_steps": steps,
                    "global_samples": steps * samples_per_step, "skipped_steps": 0}  # fmt: skip
        scaler = {"scale": 1.0, "cur_hysteresis": 2, "cur_iter": 0, "last_overflow_iter": -1}
        meta = {"counters": counters, "loss_scaler": scaler}
        if groups:
            meta["param_groups"] = [groups[i] for i in sorted(groups)]
        return meta, {"lr_scheduler": sched or None, "client_state": {}}

    def _missing(self, name: str) -> str:
        return f"tensor {name!r} is not in the DCP checkpoint {self.path}"

    def read(self, piece: Any, index: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk of ``piece`` (or its part ``index``), into ``out`` (cast) when given."""
        t = self._load(piece.index).reshape(tuple(b - a for a, b in piece.box))
        t = t if index is None else t[index]
        return t.clone() if out is None else out.copy_(t)

    @property
    def world_size(self) -> int:
        return 1

    def rank_state(self, rank: int) -> dict:
        return dict(self._shared)

    def describe(self) -> dict[str, Any]:
        files = sorted({info.relative_path for info in self._storage.values()})
        layout = {"files": len(files), "tensors": len(self._pieces)}
        return {"format": "torch.distributed.checkpoint (DCP)", "layout": layout,
                "dropped": dict(self.dropped)}  # fmt: skip

    def close(self) -> None:
        pass

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(fqn: str) -> str | None:
    """The piece name of a DCP tensor key (module docstring), None if not state."""
    if fqn.startswith("model."):
        return f"model/{fqn.removeprefix('model.')}"
    if fqn.startswith("optimizer.state."):
        param, _, key = fqn.removeprefix("optimizer.state.").rpartition(".")
        return f"optim/{key}/{param}"
    return None
