"""DeepSpeed's ``.deepspeed_env``: ``NAME=VALUE`` lines exported to every rank on every host.

DeepSpeed's launcher (``deepspeed/launcher/runner.py``, 0.19) looks for a file named
``$DS_ENV_FILE`` (default ``.deepspeed_env``) in the home directory, then in the current
directory, and exports the variables of each file it finds, in that order, so the current
directory's value of a name wins over the home directory's. Each line is split at its first
``=``; the name and the value are stripped of surrounding white space. ``shardwise run`` reads
the same files and gives their variables to the workers it starts (and to torchrun's agent).

Differences, all on the side of saying more (docs/launch.md):
- DeepSpeed reads the files only when it starts ranks on other hosts (its pdsh/MPI/Slurm
  exports); every node runs its own ``shardwise run``, which reads them on one node too.
- Blank lines and ``#`` comments are skipped (DeepSpeed fails on a line without ``=``); a line
  without ``=``, or whose name is not a variable name (``export A=1``), is a ``ValueError``
  naming the file and line (DeepSpeed: an unpacking error, or a broken remote command).
- Values are taken as written: no quote removal and no ``$VAR`` expansion (DeepSpeed's pdsh
  runner hands them to the remote shell inside double quotes, which expands ``$VAR``; its MPI
  runners pass them as written).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

FILE_VAR = "DS_ENV_FILE"  # DeepSpeed's: another name for the file
DEFAULT_NAME = ".deepspeed_env"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def file_name(environ: Mapping[str, str]) -> str:
    """The file's name: ``$DS_ENV_FILE``, else ``.deepspeed_env`` (an absolute path is used as
    it is, in both places, as ``os.path.join`` does in DeepSpeed's lookup)."""
    return environ.get(FILE_VAR, DEFAULT_NAME)


def parse(text: str, source: str) -> dict[str, str]:
    """``{name: value}`` of one file's ``NAME=VALUE`` lines (``source`` names it in errors)."""
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, eq, value = line.partition("=")
        name = name.strip()
        if not eq or not _NAME.match(name):
            raise ValueError(
                f"{source}, line {number}: {line.strip()!r} is not NAME=VALUE (DeepSpeed's "
                "launcher exports each line of this file as a variable: write one NAME=VALUE a "
                "line, without `export`; # starts a comment)"
            )
        found[name] = value.strip()
    return found


def exports(
    environ: Mapping[str, str], home: str | None = None, cwd: str | None = None
) -> tuple[dict[str, str], list[Path]]:
    """The variables to export and the files they came from: the home directory's file, then
    the current directory's, a later value of a name replacing an earlier one."""
    name = file_name(environ)
    places = (home or os.path.expanduser("~"), cwd or os.getcwd())
    files: list[Path] = []
    for path in (Path(place, name) for place in places):
        if path.is_file() and path.resolve() not in {f.resolve() for f in files}:
            files.append(path)
    found: dict[str, str] = {}
    for path in files:
        try:
            found.update(parse(path.read_text(), str(path)))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read it ({e}); fix or remove it") from None
    return found, files
