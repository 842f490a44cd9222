"""Save checkpoint ``step1``, then die in the middle of saving ``step2`` (test_checkpoint_storage).

    python ckpt_kill.py SAVE_DIR STORE_FILE RANK WORLD PHASE

PHASE ``write``: the last rank exits (code 17, no cleanup, like a SIGKILL) after it wrote part
of its step2 file, while the other ranks wait for it. PHASE ``publish``: rank 0 exits when it
is about to rename the finished step2 directory into place (everything written and synced).
PHASE ``overwrite``: the second save writes ``step1`` again; rank 0 exits between moving the
old ``step1`` aside and renaming the new one into place.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

from shardwise.checkpoint import safetensors_file, storage
from shardwise.checkpoint.pieces import Piece

ROWS = 2000  # 64 KB per rank: larger than Python's write buffer, so part of it reaches the disk


def pieces(rank: int, world: int, step: int) -> list[Piece]:
    w = torch.full((ROWS, 8), float(step)) + rank
    box = ((rank * ROWS, (rank + 1) * ROWS), (0, 8))
    return [
        Piece("model/w", (world * ROWS, 8), box, None, w),
        Piece("model/v", (world * ROWS,), box[:1], None, w[:, 0].clone()),
        Piece("model/b", (100,), ((0, 100),), None, torch.arange(100.0) * step, save=rank == 0),
    ]


def die_after_first_tensor() -> None:
    original, calls = safetensors_file._bytes_view, [0]

    def dying(t: torch.Tensor) -> memoryview:
        calls[0] += 1
        if calls[0] == 2:  # the header and the first tensor are written
            os._exit(17)
        return original(t)

    safetensors_file._bytes_view = dying


def main() -> None:
    save_dir, store, rank, world, phase = sys.argv[1:]
    rank, world = int(rank), int(world)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
    storage.save_pieces(save_dir, "step1", pieces(rank, world, 1), {"rank": rank}, {"step": 1})
    if phase == "write" and rank == world - 1:
        die_after_first_tensor()
    if phase == "publish" and rank == 0:
        os.rename = lambda *args: os._exit(17)
    if phase == "overwrite" and rank == 0:
        rename = os.rename
        os.rename = lambda a, b: rename(a, b) if ".old-" in b else os._exit(17)
    tag = "step1" if phase == "overwrite" else "step2"
    storage.save_pieces(save_dir, tag, pieces(rank, world, 2), {"rank": rank}, {"step": 2})


if __name__ == "__main__":
    main()
