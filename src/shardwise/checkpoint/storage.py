"""Sharded, atomic checkpoint storage: every rank writes its pieces, rank 0 publishes.

    <save_dir>/latest                     the newest tag (text, DeepSpeed's convention)
    <save_dir>/<tag>/manifest.json        see manifest.py
    <save_dir>/<tag>/rank_00000.safetensors, rank_00001.safetensors, ...

A save, collective over ``group``:
  0. rank 0 takes the directory's lock (lock.py: one job per save directory) and refuses a
     directory holding checkpoints of later steps than ``step`` unless ``allow_newer``
     (rotation.py); the outcome is broadcast, so every rank stops before writing anything;
  1. every rank writes ``rank_{r:05d}.safetensors`` (its pieces, one key each, and its rank
     state) into the hidden ``<save_dir>/.<tag>.tmp-<nonce>/`` and fsyncs it;
  2. the file records (size, CRC-32s, pieces, and the CRC-32s of the replicated copies the
     rank did not write) are all-gathered as JSON bytes: this is also the barrier after which
     every file is on disk (a rank that failed sends its error instead);
  3. rank 0 checks that replicated copies agree (replica_checksums.py), writes manifest.json, fsyncs it
     and the directory, renames the directory to ``<tag>`` (an existing ``<tag>`` is renamed
     away first, then deleted), then replaces ``latest`` through a temporary file; then
     rotation (``keep_last``, by step: rotation.py);
  4. rank 0 broadcasts the outcome, so every rank returns (or raises) together.
A process killed at any point before the rename leaves only a hidden directory: the previous
checkpoint and ``latest`` are untouched. Killed between the two renames of an overwrite, it
leaves ``<tag>`` missing and the previous one at ``.<tag>.old-<nonce>``: loading that tag, or
the next save, renames it back (``recover``). The filesystem must be shared by all ranks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import safetensors
import torch

from shardwise import comm
from shardwise.checkpoint import lock, replica_checksums, rotation
from shardwise.checkpoint import manifest as mf
from shardwise.checkpoint.gather import all_gather_json, broadcast_json, shared_nonce
from shardwise.checkpoint.manifest import CheckpointError, rank_file
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reader import CheckpointReader  # noqa: F401 - part of this API
from shardwise.checkpoint.rotation import rotate  # noqa: F401 - part of this API
from shardwise.checkpoint.safetensors_file import FormatError, write_tensors
from shardwise.checkpoint.state_codec import StateError, encode
from shardwise.checkpoint.tags import LATEST, check_tag, latest_tag  # noqa: F401 - part of this API
from shardwise.version import __version__

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

RANK_STATE_KEY = "shardwise.rank_state"
logger = logging.getLogger("shardwise")
_OLD_RE = re.compile(r"\.(.+)\.old-\d+")  # a replaced <tag>, kept until its successor is in


def save_pieces(
    save_dir: str,
    tag: str,
    pieces: list[Piece],
    rank_state: dict,
    meta: dict,
    *,
    group: ProcessGroup | None = None,
    save_latest: bool = True,
    keep_last: int | None = None,
    tag_validation: str = "Warn",
    step: int | None = None,
    allow_newer: bool = False,
) -> str:
    """Save this rank's ``pieces`` (those with ``save=True``) and ``rank_state``; rank 0's
    ``meta`` goes in the manifest. Collective over ``group``; returns ``<save_dir>/<tag>``.

    The checkpoint is saved under rank 0's ``tag``; ``tag_validation`` (DeepSpeed's config key)
    says what a rank passing another tag does: "Fail" raises on every rank, "Warn" logs it on
    rank 0, "Ignore" says nothing. ``step`` (the training step, recorded in the manifest)
    orders rotation (``keep_last``, which needs it) and refuses a directory holding later
    steps unless ``allow_newer`` (rotation.py)."""
    plan = begin_save(save_dir, tag, group, keep_last, tag_validation, step, allow_newer)
    return finish_save(plan, pieces, rank_state, meta, group, save_latest)


@dataclass(frozen=True)
class SavePlan:
    """A save that may start writing: its tag agreed, the directory locked and checked, its
    hidden directory named (steps 0 of the module docstring)."""

    save_dir: str
    tag: str
    tmp: str
    keep_last: int | None
    step: int | None


def begin_save(
    save_dir: str,
    tag: str,
    group: ProcessGroup | None = None,
    keep_last: int | None = None,
    tag_validation: str = "Warn",
    step: int | None = None,
    allow_newer: bool = False,
) -> SavePlan:
    """Step 0, collective over ``group``: every rank returns the same plan or raises."""
    tag = _agreed_tag(tag, tag_validation, group, save_dir)
    check_tag(tag)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r}: give a number of checkpoints >= 1")
    if keep_last is not None and step is None:
        raise CheckpointError(
            "keep_last needs the step of the checkpoint (step=...): rotation keeps the highest"
        )
    status = _prepare(save_dir, tag, step, allow_newer) if comm.get_rank(group) == 0 else ""
    status = broadcast_json(status, group)
    if status:
        raise CheckpointError(f"checkpoint {tag!r} in {save_dir} not saved: {status}")
    tmp = os.path.join(save_dir, f".{tag}.tmp-{shared_nonce(group)}")
    return SavePlan(save_dir, tag, tmp, keep_last, step)


def finish_save(
    plan: SavePlan,
    pieces: list[Piece],
    rank_state: dict,
    meta: dict,
    group: ProcessGroup | None = None,
    save_latest: bool = True,
) -> str:
    """Steps 1-4, collective over ``group`` (any group of the same ranks, in the same order:
    an asynchronous save runs them on its own): write, gather, publish, agree."""
    rank, save_dir, tag, tmp = comm.get_rank(group), plan.save_dir, plan.tag, plan.tmp
    try:
        os.makedirs(tmp, exist_ok=True)
        info = _write_rank_file(tmp, rank, pieces, rank_state)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather, or the others hang
        failure: BaseException | None = e
        info = {"error": f"rank {rank}, {rank_file(rank)}: {type(e).__name__}: {e}"}
    else:
        failure = None
    infos = all_gather_json(info, group)
    status = ""
    if rank == 0:
        try:
            status = _publish(
                save_dir, tag, tmp, infos, meta, save_latest, plan.keep_last, plan.step
            )
        except Exception as e:  # noqa: BLE001 - reported to every rank just below
            status = f"{type(e).__name__}: {e}"
    status = broadcast_json(status, group)
    if status:
        raise CheckpointError(f"checkpoint {tag!r} in {save_dir} not saved: {status}") from failure
    return os.path.join(save_dir, tag)


def _prepare(save_dir: str, tag: str, step: int | None, allow_newer: bool) -> str:
    """Rank 0, before anyone writes: the directory's lock, and no newer checkpoints there
    (unless ``allow_newer``). '' when the save may go on, else why not."""
    try:
        lock.acquire(save_dir)
        if step is not None and not allow_newer:
            rotation.refuse_newer(save_dir, tag, step)
    except (CheckpointError, OSError) as e:
        return str(e)
    return ""


def _agreed_tag(tag: str, mode: str, group: ProcessGroup | None, save_dir: str = "") -> str:
    """Rank 0's tag on every rank, after comparing the others' with it (``mode``). The save
    directories must be one: ranks writing to different directories would each publish a part
    of a checkpoint that no load finds whole, so that fails on every rank, naming both."""
    if mode not in ("Warn", "Ignore", "Fail"):
        raise CheckpointError(f'tag_validation={mode!r}: use "Warn", "Ignore" or "Fail"')
    if comm.get_world_size(group) == 1:
        return tag
    pairs = all_gather_json([tag, os.path.abspath(save_dir)], group)
    tags, dirs = [t for t, _ in pairs], [d for _, d in pairs]
    odd = next((r for r, d in enumerate(dirs) if d != dirs[0]), None)
    if odd is not None:
        raise CheckpointError(
            f"ranks passed different save_dir values: rank 0 {dirs[0]!r}, rank {odd} "
            f"{dirs[odd]!r}; pass one directory on every rank (e.g. build its name on rank 0 "
            "and broadcast it)"
        )
    others = {r: t for r, t in enumerate(tags) if t != tags[0]}
    if others and mode != "Ignore":
        what = f"ranks passed different checkpoint tags: rank 0 {tags[0]!r}, " + ", ".join(
            f"rank {r} {t!r}" for r, t in others.items()
        )
        if mode == "Fail":
            raise CheckpointError(f"{what}; pass one tag on every rank (tag_validation='Fail')")
        if comm.get_rank(group) == 0:
            logger.warning("%s; saving under rank 0's tag (tag_validation='Warn')", what)
    return tags[0]


def _write_rank_file(tmp: str, rank: int, pieces: list[Piece], rank_state: dict) -> dict:
    """Write this rank's file; return its record for the manifest."""
    items, entries, used = [], [], set()
    for p in pieces:
        if not p.save:
            continue
        stored = mf.stored_piece(p)
        if stored is None:
            continue
        box, tensor = stored
        key, n = p.name, 0
        while key in used:  # a rank holding two pieces of one tensor
            n += 1
            key = f"{p.name}#{n}"
        used.add(key)
        items.append((key, tensor))
        entries.append((p, box, key))
    tensors: dict[str, torch.Tensor] = {}
    try:
        state = json.dumps(encode(rank_state, tensors), allow_nan=True)
    except StateError as e:
        raise CheckpointError(str(e)) from e
    items += list(tensors.items())
    try:
        record = write_tensors(os.path.join(tmp, rank_file(rank)), items, {RANK_STATE_KEY: state})
    except FormatError as e:
        raise CheckpointError(str(e)) from e  # finish_save names the rank and the file
    return {
        "file": rank_file(rank),
        "rank": rank,
        "size": record.size,
        "header_bytes": record.header_bytes,
        "header_crc32": record.header_crc32,
        "state_crc32": {key: record.crc32[key] for key in tensors},
        "pieces": [mf.piece_entry(p, box, key, record.crc32[key]) for p, box, key in entries],
        "replicas": replica_checksums.records(pieces, only_unsaved=True),
    }


def _publish(
    save_dir: str,
    tag: str,
    tmp: str,
    infos: list[dict],
    meta: dict,
    save_latest: bool,
    keep_last: int | None,
    step: int | None,
) -> str:
    """Rank 0: replicas agree, manifest, rename into place, ``latest``, rotation. '' on
    success, else why (nothing published then)."""
    errors = [i["error"] for i in infos if "error" in i]
    if not errors:
        errors = [e for e in [replica_checksums.disagreements_in_save(infos)] if e]
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        return "; ".join(errors) + " (nothing was written: the previous checkpoints are intact)"
    for info in infos:
        del info["replicas"]
    try:
        manifest = mf.build(tag, meta, infos, time.time(), _versions(), step)
        text = json.dumps(manifest, indent=1).encode()
    except (TypeError, ValueError) as e:  # meta not JSON-able, or pieces that disagree
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"manifest: {e}") from e
    _write_synced(os.path.join(tmp, mf.MANIFEST), text)
    install(save_dir, tag, tmp, LATEST if save_latest else None, keep_last, step)
    return ""


def install(
    save_dir: str, tag: str, tmp: str, latest: str | None, keep_last: int | None, step: int | None
) -> None:
    """Rank 0, the last steps of a save (3 of the module docstring): the complete hidden
    directory ``tmp`` renamed to ``<tag>``, the file ``latest`` (a name, or None) pointing at
    it, rotation, leftovers removed. Saves of other formats end here too (save_foreign.py)."""
    _fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):
        old = os.path.join(save_dir, f".{tag}.old-{os.path.basename(tmp).rsplit('-', 1)[1]}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    if latest is not None:
        latest_tmp = os.path.join(save_dir, f".{latest}.tmp-{os.getpid()}")
        _write_synced(latest_tmp, tag.encode())
        os.replace(latest_tmp, os.path.join(save_dir, latest))
        _fsync_dir(save_dir)
    if keep_last is not None:
        rotation.rotate(save_dir, keep_last, step, keep=tag)
    _remove_leftovers(save_dir)


def _remove_leftovers(save_dir: str) -> None:
    """Delete hidden directories that saves killed midway left behind (saves into one
    directory are sequential: a job's next save finds no other save running). A previous
    ``<tag>`` whose replacement never arrived is renamed back instead (``recover``)."""
    for name in os.listdir(save_dir):
        old = _OLD_RE.fullmatch(name)
        if old and recover(save_dir, old.group(1)):
            continue
        if name.startswith(".") and re.search(r"\.(tmp|old|deleting)-\d+$", name):
            path = os.path.join(save_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)


def recover(save_dir: str, tag: str) -> bool:
    """Put back ``<tag>`` if a save that overwrote it was killed between its two renames
    (``<tag>`` gone, the complete previous one still at ``.<tag>.old-<nonce>``); True if
    ``<tag>`` exists afterwards. Safe to call from every rank at once."""
    final = os.path.join(save_dir, tag)
    if os.path.exists(final) or not os.path.isdir(save_dir):
        return os.path.exists(final)
    for name in sorted(os.listdir(save_dir)):
        old = _OLD_RE.fullmatch(name)
        if (
            old
            and old.group(1) == tag
            and os.path.isfile(os.path.join(save_dir, name, mf.MANIFEST))
        ):
            try:
                os.rename(os.path.join(save_dir, name), final)
                logger.warning(
                    "%s: a save replacing it was interrupted; restored the previous %s", final, tag
                )
            except OSError:  # another rank put it back first
                pass
            break
    return os.path.exists(final)


def resolve(path: str, tag: str | None = None) -> str:
    """The checkpoint directory meant by ``path``: ``path/tag`` if a tag is given, ``path``
    itself if it holds a manifest, else the tag ``path/latest`` names."""
    if tag is not None:
        check_tag(tag)
        recover(path, tag)
        return os.path.join(path, tag)
    if os.path.isfile(os.path.join(path, mf.MANIFEST)):
        return path
    found = latest_tag(path) if os.path.isdir(path) else None
    if found is None:
        raise CheckpointError(
            f"{path}: neither a checkpoint (no {mf.MANIFEST}) nor a save directory with a "
            f"'{LATEST}' file; pass a tag"
        )
    recover(path, found)
    return os.path.join(path, found)


# ----------------------------------------------------------------------------- helpers


def _versions() -> dict[str, str]:

    return {
        "shardwise": __version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
