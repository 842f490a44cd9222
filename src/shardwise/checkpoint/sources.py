"""Which saved tensor feeds a target piece (reshard.py's module docstring has the rules):

"master/<p>"          falls back to "model/<p>" cast to fp32 (a checkpoint trained in fp32)
"model/<p>" in fp32   reads "master/<p>" first when the checkpoint has one
any "<kind>/<p>"      also "<kind>/<name>" when the checkpoint stored <p> as an alias of
                      <name> (a tied weight is stored once; meta "aliases")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.checkpoint.pieces import Piece

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.reader import CheckpointReader


def sources(target: Piece, aliases: dict[str, str] | None = None) -> list[str]:
    """The saved names that may feed ``target``, preferred first (module docstring)."""
    kind, _, param = target.name.partition("/")
    if kind == "master":
        names = [target.name, f"model/{param}"]
    elif kind == "model" and target.tensor.dtype == torch.float32:
        names = [f"master/{param}", target.name]
    else:
        names = [target.name]
    for name in list(names):
        head, _, param = name.rpartition("/")  # "optim/exp_avg/<p>": <p> is the last part
        if aliases and param in aliases:
            names.append(f"{head}/{aliases[param]}")
    return names


def saved_aliases(reader: CheckpointReader) -> dict[str, str]:
    """``{alias: saved name}`` the checkpoint records (none for a state dict)."""
    meta = getattr(reader, "meta", None)
    aliases = meta.get("aliases") if isinstance(meta, dict) else None
    return dict(aliases) if isinstance(aliases, dict) else {}
