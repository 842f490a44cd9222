"""A stand-in for shardwise.checkpoint.storage with the same calls, until that module lands.

One torch file per rank (weights_only loading: no arbitrary unpickling), the metadata as JSON.
No atomicity, checksums or slicing reads: the real storage is tested on its own; this only lets
the layout tests run.
"""

import json
import os
from dataclasses import dataclass

import torch

from shardwise import comm


class CheckpointError(ValueError):
    pass


@dataclass
class SavedPiece:
    name: str
    dtype: torch.dtype
    global_shape: tuple
    box: tuple
    flat: tuple | None
    file: str
    key: str


def save_pieces(
    save_dir, tag, pieces, rank_state, meta, *, group=None, save_latest=True, keep_last=None
):
    path = os.path.join(save_dir, tag)
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    os.makedirs(path, exist_ok=True)
    kept = [p for p in pieces if p.save]
    records = [
        {
            "name": p.name,
            "global_shape": list(p.global_shape),
            "box": [list(b) for b in p.box],
            "flat": list(p.flat) if p.flat else None,
            "key": f"{i}",
        }
        for i, p in enumerate(kept)
    ]
    blob = {
        "records": json.dumps(records),
        "tensors": {
            r["key"]: p.tensor.detach().clone() for r, p in zip(records, kept, strict=True)
        },
        "rank_state": rank_state,
    }
    torch.save(blob, os.path.join(path, f"rank{rank}.pt"))
    comm.barrier(group)
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"meta": meta, "world_size": world}, f)
        if save_latest:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(tag)
    comm.barrier(group)
    return path


def latest_tag(load_dir):
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


class CheckpointReader:
    def __init__(self, path):
        with open(os.path.join(path, "meta.json")) as f:
            head = json.load(f)
        self.meta, self.world_size = head["meta"], head["world_size"]
        self._blobs, self._pieces = [], {}
        for r in range(self.world_size):
            file = os.path.join(path, f"rank{r}.pt")
            blob = torch.load(file, weights_only=True)
            self._blobs.append(blob)
            for rec in json.loads(blob["records"]):
                t = blob["tensors"][rec["key"]]
                sp = SavedPiece(
                    rec["name"],
                    t.dtype,
                    tuple(rec["global_shape"]),
                    tuple(tuple(b) for b in rec["box"]),
                    tuple(rec["flat"]) if rec["flat"] else None,
                    file,
                    f"{r}/{rec['key']}",
                )
                self._pieces.setdefault(rec["name"], []).append(sp)

    def names(self):
        return list(self._pieces)

    def pieces(self, name):
        return self._pieces[name]

    def read(self, piece, index=None):
        r, key = piece.key.split("/")
        t = self._blobs[int(r)]["tensors"][key]
        return (t if index is None else t[index]).clone()

    def rank_state(self, rank):
        return self._blobs[rank]["rank_state"]
