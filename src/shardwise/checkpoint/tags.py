"""Checkpoint tags: the names a save directory's checkpoints go by, and ``latest``.

A tag is one path component of letters, digits and ``_ . + = -`` (not starting with ``.``,
which marks the hidden directories of saves in progress, nor ``-``), never ``latest``: the
file ``<save_dir>/latest`` holds the tag of the newest complete checkpoint.
"""

from __future__ import annotations

import os
import re

from shardwise.checkpoint.manifest import CheckpointError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name for the newest universal folder
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(
            f"tag {tag!r}: use letters, digits and _ . + = - (not starting with '.' or '-', "
            f"not {LATEST!r}), e.g. 'global_step100'"
        )


def latest_tag(load_dir: str, name: str = LATEST) -> str | None:
    """The tag ``<load_dir>/latest`` names (or the file ``name``: DeepSpeed's universal
    folders are named by ``latest_universal``), or None when there is no such file."""
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        tag = f.read().strip()
    try:
        check_tag(tag)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return tag
