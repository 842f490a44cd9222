"""The config error and the notes gathered while a config is parsed.

Every user mistake in a config raises :class:`ConfigError`, a ``ValueError`` that carries the dotted
path of the offending key in ``.key`` (``""`` when the problem is the whole file). Things that are
accepted but deserve a word (ignored keys, deprecated names, ``"auto"`` replaced by a default) are
collected in :class:`Notes` and reported as one :class:`ConfigWarning` per kind at the end of
``parse_config``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardwise.errors import ConfigWarning, DeepSpeedDifferenceWarning


class ConfigError(ValueError):
    """A config value shardwise refuses. ``key`` is the dotted path, e.g. ``"zero_optimization.stage"``."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


def join(path: str, key: str) -> str:
    """Dotted path of ``key`` inside the block at ``path`` (``""`` is the top level)."""
    return f"{path}.{key}" if path else key


def fail(path: str, message: str) -> ConfigError:
    """A ConfigError whose text starts with the key path: ``"<path>: <message>"``."""
    return ConfigError(f"{path}: {message}" if path else message, key=path)


def closest(word: str, candidates: Iterable[str]) -> list[str]:
    """The candidates most like ``word`` (difflib ratio >= 0.6; all of them on a tie), sorted."""
    scored = [(difflib.SequenceMatcher(None, word, c).ratio(), c) for c in set(candidates)]
    best = max((score for score, _ in scored), default=0.0)
    return sorted(c for score, c in scored if score >= 0.6 and score == best)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` (or ``'x' or 'y'`` on a tie) for a likely typo, else ``""``."""
    matches = closest(word, candidates)
    return "; did you mean " + " or ".join(f"'{m}'" for m in matches) + "?" if matches else ""


def show(value: object) -> str:
    """A value as a user wrote it in JSON, with its kind: ``the string "8"``, ``true``, ``a list [1, 2]``."""
    if isinstance(value, str):
        return f'the string "{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object {...}"
    if isinstance(value, (list, tuple)):
        return f"a list {list(value)!r}"
    return repr(value)


@dataclass
class Notes:
    """What parsing accepted without complaint but the user should hear about."""

    ignored: list[str] = field(default_factory=list)  # dotted paths of keys shardwise does not read
    deprecated: list[str] = field(default_factory=list)  # one sentence per deprecated key
    auto_defaults: list[str] = field(
        default_factory=list
    )  # dotted paths whose "auto" became a default
    differences: list[str] = field(default_factory=list)  # defaults unlike DeepSpeed 0.19's

    def emit(self) -> None:
        """One ConfigWarning per non-empty kind (so a config produces at most four warnings)."""
        if self.ignored:
            warnings.warn(
                "shardwise accepts but ignores these DeepSpeed config keys (no effect here; "
                f"see docs/config.md): {', '.join(self.ignored)}",
                ConfigWarning,
                stacklevel=3,
            )
        if self.deprecated:
            warnings.warn(
                "deprecated config keys: " + "; ".join(self.deprecated), ConfigWarning, stacklevel=3
            )
        if self.differences:
            warnings.warn(
                "defaults that differ from DeepSpeed 0.19 (docs/config.md says why; give the key "
                "to choose): " + "; ".join(self.differences),
                DeepSpeedDifferenceWarning,
                stacklevel=3,
            )
        if self.auto_defaults:
            warnings.warn(
                '"auto" values replaced by shardwise defaults (batch keys: worked out from the '
                f"others): {', '.join(self.auto_defaults)}",
                ConfigWarning,
                stacklevel=3,
            )
