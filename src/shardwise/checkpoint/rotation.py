"""What a save directory holds, ordered by training step: rotation and the runs it protects.

Every complete shardwise checkpoint records the step it saved (manifest ``step``). Two rules
follow from it, both applied by rank 0 of a save (storage.save_pieces):

- **A save never starts over newer checkpoints.** If the directory holds checkpoints of later
  steps than the one being saved, the run is not their continuation (typically: ``latest`` was
  lost, ``load_checkpoint`` found nothing and training restarted from step 0); writing would
  overwrite their tags and mix two runs. The save is refused before anything is written,
  unless the caller says so (``allow_newer``: the engine sets it after ``load_checkpoint`` of
  that directory, or with ``"checkpoint": {"overwrite_newer": true}``).
- **Rotation keeps the K highest steps** among the checkpoints at or below the one just
  written, never one above it (a newer checkpoint is never deleted, whatever was allowed),
  never the one just written nor the one ``latest`` names. Ties (two tags of one step) go by
  creation time. Checkpoints without a recorded step (manifest version 1) and directories
  that are not shardwise checkpoints are never touched.

A checkpoint shardwise wrote in another format (``save_checkpoint(format="deepspeed")``, ...)
has no manifest; it carries ``shardwise_save.json`` instead (``{"format", "step",
"created"}``), so the same two rules cover it. Foreign checkpoints shardwise did not write
have neither file and are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from shardwise.checkpoint import manifest as mf
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.tags import latest_tag


@dataclass(frozen=True)
class Saved:
    tag: str
    step: int | None
    created: float


def checkpoints(save_dir: str) -> list[Saved]:
    """The complete shardwise checkpoints of ``save_dir`` (a manifest that parses and checks,
    or the marker of one saved in another format)."""
    found = []
    if not os.path.isdir(save_dir):
        return found
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name, mf.MANIFEST)
        if not os.path.isfile(path):
            path = os.path.join(save_dir, name, MARKER)
        if name.startswith(".") or not os.path.isfile(path):
            continue
        saved = _read(path, name)
        if saved is not None:  # else not ours, damaged, or not complete: never delete it
            found.append(saved)
    return found


MARKER = "shardwise_save.json"  # in a checkpoint of another format that shardwise wrote


def marker(fmt: str, step: int) -> bytes:
    """The contents of ``MARKER`` for a checkpoint of format ``fmt`` at ``step``."""
    return json.dumps({"format": fmt, "step": step, "created": time.time()}).encode()


_seen: dict[str, tuple[tuple, Saved | None]] = {}  # manifest path: (its version, what it says)


def _read(path: str, tag: str) -> Saved | None:
    """The checkpoint a manifest describes, None if it does not parse and check. Remembered
    per version of the file (inode, mtime, size): a published manifest never changes (saving
    the tag again writes a new file), and every save checks the whole directory, so without
    it a save into a directory of N checkpoints parsed N manifests again: 0.15 s per save
    with 13 small ones, in the part of an asynchronous save that blocks training."""
    try:
        st = os.stat(path)
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if path in _seen and _seen[path][0] == version:
            return _seen[path][1]
        with open(path, "rb") as f:
            text = f.read()
        m = json.loads(text) if path.endswith(MARKER) else mf.parse(text, path)
        saved = Saved(tag, None if m["step"] is None else int(m["step"]), float(m["created"]))
    except (OSError, CheckpointError, ValueError, KeyError, TypeError):
        return None
    _seen[path] = (version, saved)
    return saved


def newer_than(save_dir: str, step: int) -> list[Saved]:
    """Checkpoints of ``save_dir`` saved at a later step than ``step``, highest first."""
    ahead = [c for c in checkpoints(save_dir) if c.step is not None and c.step > step]
    return sorted(ahead, key=lambda c: (c.step, c.created), reverse=True)


def refuse_newer(save_dir: str, tag: str, step: int) -> None:
    """Raise if ``save_dir`` holds checkpoints of later steps than ``step`` (module doc)."""
    ahead = newer_than(save_dir, step)
    if not ahead:
        return
    shown = ", ".join(f"{c.tag} (step {c.step})" for c in ahead[:4])
    raise CheckpointError(
        f"{save_dir} holds checkpoints of later steps than this run (step {step}, saving "
        f"{tag!r}): {shown}{' ...' if len(ahead) > 4 else ''}. Saving here would overwrite "
        "their tags and mix two runs. To continue that run, load it first "
        f"(engine.load_checkpoint({save_dir!r}, tag={ahead[0].tag!r})); to start a new run, "
        'give it another save_dir; to save here anyway, set "checkpoint": '
        '{"overwrite_newer": true} in the config (newer checkpoints are kept, never rotated '
        "away)"
    )


def rotate(save_dir: str, keep_last: int, step: int, keep: str | None = None) -> list[str]:
    """Delete all but the ``keep_last`` highest-step checkpoints at or below ``step`` (module
    doc); never ``keep`` nor the one ``latest`` names. Return the deleted tags."""
    protected = {keep, latest_tag(save_dir)}
    older = [c for c in checkpoints(save_dir) if c.step is not None and c.step <= step]
    older.sort(key=lambda c: (c.step, c.created))
    doomed = [c.tag for c in older[: max(0, len(older) - keep_last)] if c.tag not in protected]
    for name in doomed:
        # Rename first: a deletion cut short must not leave a visible, half-empty checkpoint.
        hidden = os.path.join(save_dir, f".{name}.deleting-{os.getpid()}")
        os.rename(os.path.join(save_dir, name), hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed
