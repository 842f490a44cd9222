"""Typed config blocks from dicts: the type annotations of a dataclass are the schema.

A block is a frozen dataclass whose field names are the DeepSpeed JSON keys. :func:`build` checks a
raw dict against it with these rules:

- Unknown keys are errors naming the key path, with a "did you mean" for a likely typo. A class may
  list keys it accepts but ignores (``IGNORED_KEYS``: key -> reason); they are noted, not stored.
- Types are strict: ``int`` takes an int or an integral float (``2e8``), never a bool, a string or
  ``2.5``; ``float`` takes an int or float (finite), never a bool or a string; ``bool`` takes only
  true/false. Nothing is coerced from a string.
- ``"auto"`` (the Hugging Face placeholder) given to a field whose type does not list ``"auto"``
  means "use the default", as DeepSpeed's pydantic models do; the path is noted.
- Bounds come from field metadata: ``ge``/``gt``/``le`` (see :func:`spec`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from shardwise.config.errors import ConfigError, Notes, did_you_mean, fail, join, show

AUTO = "auto"
_MISSING = dataclasses.MISSING


def spec(
    default: Any = _MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    factory: Any = _MISSING,
) -> Any:
    """A dataclass field with bounds: ``x: int = spec(0, ge=0)``."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def describe(tp: Any) -> str:
    """What a type accepts, in words: ``"an integer"``, ``'one of "fp16", "bf16"'``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        words = [f'"{a}"' if isinstance(a, str) else show(a) for a in get_args(tp)]
        return words[0] if len(words) == 1 else "one of " + ", ".join(words)
    if dataclasses.is_dataclass(tp):
        return f"an object like {getattr(tp, 'EXAMPLE', '{...}')}"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "an object"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def allows_auto(tp: Any) -> bool:
    """True when ``"auto"`` is itself a legal value of this type (e.g. ``int | Literal["auto"]``)."""
    if get_origin(tp) is Literal:
        return AUTO in get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return any(allows_auto(a) for a in get_args(tp))
    return False


def convert(value: object, tp: Any, path: str, notes: Notes | None = None) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in canonical form (2e8 -> 200000000)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(value, tp, path, notes)
    if origin is Literal:
        return _convert_literal(value, tp, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail(path, f"expected {describe(tp)}, got {show(value)}")
        return build(tp, value, path, notes if notes is not None else Notes())
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_list(value, tp, path, notes)
    if origin is dict or tp is dict:
        return _convert_dict(value, tp, path, notes)
    if tp is Any:
        return value
    return _convert_scalar(value, tp, path)


def _convert_scalar(value: object, tp: type, path: str) -> Any:
    expected = f"expected {describe(tp)}, got {show(value)}"
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value):
            if value.is_integer():
                return int(value)
            raise fail(path, f"expected an integer, got {value!r} (not a whole number)")
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise fail(path, f"expected a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    raise fail(path, expected)


def _convert_union(value: object, tp: Any, path: str, notes: Notes | None) -> Any:
    options = [o for o in get_args(tp) if o is not type(None)]
    if value is None and len(options) < len(get_args(tp)):
        return None
    if len(options) == 1:  # Optional[X]: X's own message ("expected an integer, got ...")
        return convert(value, options[0], path, notes)
    for option in options:
        try:
            return convert(value, option, path, notes)
        except ConfigError:
            if dataclasses.is_dataclass(option) and isinstance(value, dict):
                raise  # the object was right, something inside it was not: report that
    choices = [
        c for o in options if get_origin(o) is Literal for c in get_args(o) if isinstance(c, str)
    ]
    hint = did_you_mean(value, choices) if isinstance(value, str) else ""
    raise fail(path, f"expected {describe(tp)}, got {show(value)}{hint}")


def _convert_literal(value: object, tp: Any, path: str) -> Any:
    choices = get_args(tp)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    hint = (
        did_you_mean(value, [c for c in choices if isinstance(c, str)])
        if isinstance(value, str)
        else ""
    )
    raise fail(path, f"expected {describe(tp)}, got {show(value)}{hint}")


def _convert_list(value: object, tp: Any, path: str, notes: Notes | None) -> Any:
    if not isinstance(value, (list, tuple)):
        raise fail(path, f"expected {describe(tp)}, got {show(value)}")
    args = get_args(tp)
    if get_origin(tp) is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise fail(
                path, f"expected a list of {len(args)} values, got {len(value)}: {list(value)!r}"
            )
        return tuple(
            convert(v, a, f"{path}[{i}]", notes)
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    item = args[0] if args else Any
    items = [convert(v, item, f"{path}[{i}]", notes) for i, v in enumerate(value)]
    return tuple(items) if get_origin(tp) is tuple else items


def _convert_dict(value: object, tp: Any, path: str, notes: Notes | None) -> Any:
    if not isinstance(value, dict):
        raise fail(path, f"expected an object, got {show(value)}")
    args = get_args(tp)
    if not args:
        return dict(value)
    return {str(k): convert(v, args[1], join(path, str(k)), notes) for k, v in value.items()}


def check_bounds(value: object, meta: Mapping[str, Any], path: str) -> None:
    """Apply ``ge``/``gt``/``le`` from field metadata to a number (strings like "auto" pass)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if "ge" in meta and value < meta["ge"]:
        raise fail(path, f"must be >= {meta['ge']}, got {value!r}")
    if "gt" in meta and value <= meta["gt"]:
        raise fail(path, f"must be > {meta['gt']}, got {value!r}")
    if "le" in meta and value > meta["le"]:
        raise fail(path, f"must be <= {meta['le']}, got {value!r}")


def check_keys(raw: Mapping[str, Any], known: set[str], path: str, suffix: str = "") -> None:
    """Refuse keys not in ``known``, naming the full path and the closest valid key."""
    for key in raw:
        if key not in known:
            where = join(path, str(key))
            hint = did_you_mean(str(key), known)
            raise ConfigError(f"unknown key '{where}'{hint}{suffix}", key=where)


def is_key(f: dataclasses.Field) -> bool:
    """A field that is a config key (not bookkeeping marked ``metadata={"internal": True}``)."""
    return f.init and not f.metadata.get("internal", False)


def key_of(f: dataclasses.Field) -> str:
    """The JSON key of a field: its name, or ``metadata["key"]`` where the key is no Python
    name (``"async"``)."""
    return f.metadata.get("key", f.name)


def schema_keys(cls: type) -> set[str]:
    """Every key a block accepts: its fields plus its ignored and renamed keys."""
    names = {key_of(f) for f in dataclasses.fields(cls) if is_key(f)}
    return names | set(getattr(cls, "IGNORED_KEYS", {})) | set(getattr(cls, "RENAMED_KEYS", {}))


def build(cls: type, raw: Mapping[str, Any], path: str, notes: Notes) -> Any:
    """Build the dataclass ``cls`` from ``raw`` by the rules in the module docstring."""
    check_keys(raw, schema_keys(cls), path)
    hints = typing.get_type_hints(cls)
    ignored = getattr(cls, "IGNORED_KEYS", {})
    notes.ignored.extend(join(path, k) for k in raw if k in ignored)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not is_key(f) or key_of(f) not in raw:
            if is_key(f) and f.default is _MISSING and f.default_factory is _MISSING:
                raise fail(join(path, key_of(f)), "this key is required")
            continue
        key_path, value = join(path, key_of(f)), raw[key_of(f)]
        if isinstance(value, str) and value == AUTO and not allows_auto(hints[f.name]):
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise fail(key_path, '"auto" needs a value here: shardwise has no default for it')
            notes.auto_defaults.append(key_path)
            continue
        values[f.name] = convert(value, hints[f.name], key_path, notes)
        check_bounds(values[f.name], f.metadata, key_path)
    return cls(**values)
