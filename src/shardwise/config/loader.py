"""Reading a config source into a plain dict: a dict, a JSON file path, JSON text, or None.

JSON is strict (no comments). A key repeated inside one object is an error naming it, as in
DeepSpeed: JSON would silently keep the last value.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from shardwise.config.errors import ConfigError


def load_source(source: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The config as a fresh dict. A string that starts with ``{`` is read as JSON text."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return _parse_json(source, "the JSON text")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error}") from None
        return _parse_json(text, path)
    raise ConfigError(
        f"a config must be a dict, a path to a JSON file or None, got {type(source).__name__}"
    )


def _parse_json(text: str, where: str) -> dict[str, Any]:
    duplicates: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen and key not in duplicates:
                duplicates.append(key)
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=pairs_hook)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where} is not valid JSON: {error}") from None
    if duplicates:
        raise ConfigError(
            f"duplicate keys in {where}: {duplicates} (each key may appear once per object; "
            "JSON would silently keep the last value)",
            key=duplicates[0],
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object {{...}}, got {type(data).__name__}")
    return data
