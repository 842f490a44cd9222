"""Encode a rank's own state (RNG states, counters, client_state) as JSON, never pickle.

Values are JSON, and what JSON cannot say is tagged so that it round-trips exactly
(``random.setstate`` wants a tuple back, ``numpy`` an array of the same dtype):

    tuple             {"__sw_tuple__": [...]}
    torch.Tensor      {"__sw_tensor__": key}            the tensor goes in the rank's
                                                        safetensors file under ``key``
    numpy array       {"__sw_ndarray__": key, "dtype": "<u4", "shape": [...]}  (bytes as uint8)
    numpy scalar      the same, with "scalar": true
    dict whose keys are not all plain strings (optimizer state {0: ...}), or a key that starts
    with "__sw_":     {"__sw_dict__": [[key, value], ...]}

Floats are written with ``repr`` precision (JSON via Python), so they come back bit for bit.
Decoding builds only dicts, lists, tuples, numbers, strings, tensors and numeric numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

TENSOR_PREFIX = "__rank_state__/"
_TAGS = ("__sw_tuple__", "__sw_tensor__", "__sw_ndarray__", "__sw_dict__")


class StateError(ValueError):
    """A value that cannot be stored without pickle, or a stored value we cannot decode."""


def encode(value: object, tensors: dict[str, torch.Tensor], path: str = "rank_state") -> Any:
    """JSON-able form of ``value``; tensors and arrays are added to ``tensors``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__sw_tuple__": [encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return _encode_dict(value, tensors, path)
    if isinstance(value, torch.Tensor):
        key = f"{TENSOR_PREFIX}{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous()
        return {"__sw_tensor__": key}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.array(value, order="C")  # a copy; keeps a scalar 0-d
        if array.dtype.kind not in "biufc":
            raise StateError(f"{path}: numpy dtype {array.dtype} is not numeric; store it as JSON")
        key = f"{TENSOR_PREFIX}{len(tensors)}"
        tensors[key] = torch.from_numpy(array.reshape(-1).view(np.uint8).copy())
        return {
            "__sw_ndarray__": key,
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "scalar": isinstance(value, np.generic),
        }
    raise StateError(
        f"{path} is a {type(value).__name__}: a checkpoint stores JSON values, tuples, tensors "
        "and numeric numpy arrays only (nothing is pickled); convert it, e.g. to a dict"
    )


def _encode_dict(value: dict, tensors: dict[str, torch.Tensor], path: str) -> Any:
    plain = all(isinstance(k, str) and not k.startswith("__sw_") for k in value)
    if plain:
        return {k: encode(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
    return {
        "__sw_dict__": [
            [encode(k, tensors, f"{path} key {k!r}"), encode(v, tensors, f"{path}[{k!r}]")]
            for k, v in value.items()
        ]
    }


def decode(value: object, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of ``encode``; ``tensor(key)`` reads a stored tensor."""
    if isinstance(value, list):
        return [decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next((t for t in _TAGS if t in value), None)
    if tag is None:
        return {k: decode(v, tensor) for k, v in value.items()}
    if tag == "__sw_tuple__":
        return tuple(decode(v, tensor) for v in value[tag])
    if tag == "__sw_dict__":
        return {_hashable(decode(k, tensor)): decode(v, tensor) for k, v in value[tag]}
    if tag == "__sw_tensor__":
        return tensor(value[tag])
    return _decode_array(value, tensor)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _decode_array(value: dict, tensor: Callable[[str], torch.Tensor]) -> Any:
    try:
        dtype = np.dtype(value["dtype"])
        shape = tuple(int(n) for n in value["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"bad numpy entry {value!r}: {e}") from e
    if dtype.kind not in "biufc":
        raise StateError(f"numpy dtype {dtype} is not numeric: refused")
    raw = tensor(value["__sw_ndarray__"]).numpy().tobytes()
    try:
        array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except ValueError as e:
        raise StateError(f"numpy entry of shape {shape} and dtype {dtype}: {e}") from e
    return array[()] if value.get("scalar") else array
