"""The installed version of shardwise, read from the package metadata (pyproject.toml's
``version``), so that no module needs the package root to know it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
