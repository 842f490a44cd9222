"""The lookup half of the checkpoint reader interface, shared by every format's reader.

A reader keeps ``_pieces``: tensor name -> the pieces the files hold of it (each a box of the
whole tensor, checkpoint/reshard.py). ``names``, ``in`` and ``pieces`` answer from it; a name
it lacks is a ``CheckpointError`` worded by the reader's ``_missing``.
"""

from __future__ import annotations

from typing import Any

from shardwise.checkpoint.manifest import CheckpointError


class PieceIndex:
    """``names`` / ``__contains__`` / ``pieces`` over ``self._pieces``."""

    _pieces: dict[str, list[Any]]
    path: Any

    def names(self) -> list[str]:
        return list(self._pieces)

    def __contains__(self, name: str) -> bool:
        return name in self._pieces

    def pieces(self, name: str) -> list[Any]:
        if name not in self._pieces:
            raise CheckpointError(self._missing(name))
        return list(self._pieces[name])

    def _missing(self, name: str) -> str:
        return f"tensor {name!r} is not in {self.path}"
