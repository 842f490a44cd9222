"""Replicas must agree: one tensor held by several ranks (data-parallel copies, tensor-parallel
replicated norms, ZeRO-3 persistent units) must be bit for bit the same on each of them.

A checkpoint stores each replicated tensor once, from one rank (rank_pieces.py spreads them over
the ranks), so replicas that drifted apart (a rank that skipped an ``engine.step()``, a weight
changed in place on one rank) would give a checkpoint equal to no rank's model. Two checks:

- **At every save** (storage.save_pieces): each rank that holds a copy it does not write sends
  the copy's CRC-32s (one per MiB, as the file records the written copy's); rank 0 compares
  them with the written copy's before publishing. A mismatch fails the save on every rank,
  naming the tensor and which ranks hold which value; nothing is written (the previous
  checkpoints and ``latest`` stay as they were).
- **Every N steps of training**, optionally (``"checkpoint": {"replica_check_interval": N}``;
  training/checkpoints/replica_watch.py):
  every rank sends the CRC-32s of every piece it holds; a mismatch raises
  ``ReplicaMismatchError`` on every rank. It runs at the start of the backward that reduces the
  gradients of the step after each N-th (with a pipeline: after the train_batch of each N-th
  step), a point that every rank reaches together even when one of them skipped a step.

Pieces marked ``verify_replicas=False`` are not compared: buffers, whose copies may differ by
design (each rank's BatchNorm running statistics, without SyncBatchNorm).
"""

from __future__ import annotations

import logging
from typing import Any

from shardwise.checkpoint import manifest as mf
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.safetensors_file import tensor_crcs

logger = logging.getLogger("shardwise")


_KINDS = ("model/", "master/", "optim/")  # the order in which differing tensors are listed


def _rank_of_kind(key: str) -> int:
    kind = key.partition("/")[0] + "/"
    return _KINDS.index(kind) if kind in _KINDS else len(_KINDS)


class ReplicaMismatchError(RuntimeError):
    """Copies of one tensor differ between ranks; the message names the tensor and ranks."""


def _key(name: str, box: Any, flat: Any) -> str:
    """``name[0:32, 0:16]``: the tensor and the box of its copy (`` flat a:b`` of a shard)."""
    where = ", ".join(f"{a}:{b}" for a, b in box)
    return f"{name}[{where}]" + (f" flat {flat[0]}:{flat[1]}" if flat else "")


def records(pieces: list[Piece], only_unsaved: bool) -> list[list]:
    """``[key, crc32s]`` of the checked pieces (of those this rank does not write when
    ``only_unsaved``), computed over the bytes a checkpoint stores (``mf.stored_piece``)."""
    out = []
    for p in pieces:
        if not p.verify_replicas or (only_unsaved and p.save):
            continue
        stored = mf.stored_piece(p)
        if stored is not None:
            box, tensor = stored
            out.append([_key(p.name, box, p.flat), tensor_crcs(tensor)])
    return out


def disagreements(per_rank: list[list[list]]) -> str:
    """'' when every key's copies agree, else what differs: tensor, and the ranks holding
    each value (``per_rank[r]``: rank r's ``[key, crc32s]`` records)."""
    values: dict[str, dict[tuple, list[int]]] = {}
    for rank, recs in enumerate(per_rank):
        for key, crcs in recs:
            values.setdefault(key, {}).setdefault(tuple(crcs), []).append(rank)
    bad = [(k, v) for k, v in values.items() if len(v) > 1]
    if not bad:
        return ""
    bad.sort(key=lambda kv: (_rank_of_kind(kv[0]), kv[0]))
    lines = [
        f"{key}: " + " vs ".join(f"ranks {ranks}" for ranks in v.values()) for key, v in bad[:4]
    ]
    more = f" (and {len(bad) - 4} more tensors)" if len(bad) > 4 else ""
    return (
        f"replicas of {len(bad)} tensors differ between ranks: " + "; ".join(lines) + more + ". "
        "The ranks trained apart (did a rank skip engine.step() or engine.backward(), or "
        "change weights on its own?): no rank's model is the run's"
    )


def disagreements_in_save(infos: list[dict]) -> str:
    """``disagreements`` over a save's gathered file records: each rank's ``replicas`` (the
    copies it did not write) and the CRC-32s of the pieces it wrote."""
    per_rank = []
    for info in infos:
        written = [[_key(e["name"], e["box"], e["flat"]), e["crc32"]] for e in info["pieces"]]
        per_rank.append(info["replicas"] + written)
    return disagreements(per_rank)
