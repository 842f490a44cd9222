"""Where a Ray worker's shardwise checkpoint is written before Ray uploads it.

shardwise's save is collective over one directory every rank sees (rank 0 publishes the
manifest and renames the directory into place: checkpoint/storage.py), so each save is staged
in a fresh directory shared by every worker:

    <stage>/latest                               the tag (rank 0)
    <stage>/<tag>/manifest.json                  rank 0
    <stage>/<tag>/rank_00000.safetensors ...     one per rank, written by that rank
    <stage>/.upload-rank<r>/                     hard links to what rank r uploads

Ray merges the directories its workers report into one checkpoint directory, so each worker
uploads the file it wrote (rank 0 also the manifest and ``latest``): a checkpoint crosses the
network once, in parallel, from the workers that hold it. With every worker on one node the
default stage (the system's temporary directory) is shared; across nodes, ``staging_dir``
names a shared filesystem, and a worker that does not see the stage fails every rank with a
``ValueError`` before anything is written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile

from shardwise import comm
from shardwise.checkpoint.gather import all_gather_json, broadcast_json
from shardwise.checkpoint.tags import LATEST, latest_tag

_TOKEN = ".shardwise-stage"  # proves that every rank sees the same directory
_RANK_FILE = re.compile(r"rank_(\d+)\.safetensors")


def make_stage(staging_dir: str | None) -> str:
    """A new directory under ``staging_dir`` (default: the temporary directory) that every
    rank sees; collective. Raises ValueError on every rank if some rank does not see it."""
    made = None
    if comm.get_rank() == 0:
        root = staging_dir if staging_dir is not None else tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        path = tempfile.mkdtemp(prefix="shardwise-ray-", dir=root)
        made = [path, secrets.token_hex(16)]
        with open(os.path.join(path, _TOKEN), "w") as f:
            f.write(made[1])
    stage, token = broadcast_json(made)
    seen = all_gather_json(_read(os.path.join(stage, _TOKEN)) == token)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if comm.get_rank() == 0:
        os.remove(os.path.join(stage, _TOKEN))  # every rank has looked (the all-gather)
        if blind:
            shutil.rmtree(stage, ignore_errors=True)
    if blind:
        raise ValueError(
            f"staging_dir: ranks {blind} do not see {stage}, where every rank writes its part "
            "of the checkpoint; pass report(..., staging_dir=) a directory on a filesystem "
            "all workers share"
        )
    return stage


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def upload_view(stage: str, rank: int) -> str | None:
    """A directory of hard links to what ``rank`` uploads from the saved ``stage``: its own
    ``rank_<r>`` file; rank 0 also every other file of the tag and ``latest``. None when the
    rank has nothing to upload."""
    tag = latest_tag(stage)
    assert tag is not None, f"{stage}: a save that published no tag"  # storage.py writes it
    mine = [LATEST] if rank == 0 else []
    for name in sorted(os.listdir(os.path.join(stage, tag))):
        owner = _RANK_FILE.fullmatch(name)
        if (int(owner.group(1)) if owner else 0) == rank:
            mine.append(os.path.join(tag, name))
    if not mine:
        return None
    view = os.path.join(stage, f".upload-rank{rank}")
    for rel in mine:
        target = os.path.join(view, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(os.path.join(stage, rel), target)  # no copy: the same inode
        except OSError:  # a filesystem without hard links
            shutil.copy2(os.path.join(stage, rel), target)
    return view


def remove_stage(stage: str, wait: bool = True) -> None:
    """Delete ``stage`` (rank 0), once every rank's upload is done: with ``wait`` after a
    barrier (collective); without, at once (after a failure, which other ranks may not share)."""
    if wait:
        comm.barrier()
    if comm.get_rank() == 0:
        shutil.rmtree(stage, ignore_errors=True)
