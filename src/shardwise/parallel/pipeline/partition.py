"""Cutting a list of n layers into p contiguous stages.

A partition is the list of boundaries ``parts`` of length p+1: stage s owns layers
``[parts[s], parts[s+1])``, ``parts[0] = 0``, ``parts[p] = n``. Every stage gets at least one
layer (a stage with nothing to run would only forward its input: a configuration mistake).

    uniform      by layer count: n // p each, the first n % p stages one more (DeepSpeed's
                 partition_uniform)
    parameters   balanced by trainable parameter count: the contiguous cut that minimises the
                 largest stage's count (DeepSpeed's partition_balanced)
    type:REGEX   balanced by the number of layers whose class name matches REGEX
                 (case-insensitive), e.g. "type:Block" for a transformer's blocks

Balancing finds the smallest bottleneck B by bisection over the candidate costs; for a given B
the greedy cut (each stage takes as many layers as fit in B, leaving one per later stage) is
feasible whenever any cut is, so the result is optimal. Ties go to earlier stages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

METHODS = ("parameters", "uniform", "type:<regex>")


class PartitionError(ValueError):
    """A partition that cannot be made; the message names the argument to change."""


def _check(n: int, parts: int) -> None:
    if parts < 1:
        raise PartitionError(f"num_stages={parts} must be >= 1")
    if n < parts:
        raise PartitionError(
            f"num_stages={parts} is more than the {n} layers of the PipelineModule: every stage "
            f"needs at least one layer; use at most {n} stages or split the model into more layers"
        )


def partition_uniform(n: int, parts: int) -> list[int]:
    """Boundaries giving each stage n // parts layers, the first n % parts one more."""
    _check(n, parts)
    size, extra = divmod(n, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return bounds


def _greedy(weights: Sequence[int], parts: int, bottleneck: int) -> list[int] | None:
    """The front-loaded cut with every stage's cost <= bottleneck, or None if there is none."""
    n = len(weights)
    bounds, start = [0], 0
    for s in range(parts):
        stop, cost = start, 0
        cap = n - (parts - s - 1)  # leave one layer for each later stage
        while stop < cap and cost + weights[stop] <= bottleneck:
            cost += weights[stop]
            stop += 1
        if (s == parts - 1 and stop < n) or stop == start:
            return None
        bounds.append(stop)
        start = stop
    return bounds


def partition_balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries minimising the largest stage's sum of ``weights`` (contiguous, non-empty)."""
    weights = [int(w) for w in weights]
    _check(len(weights), parts)
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must be >= 0, got {weights}")
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # the smallest feasible bottleneck, by bisection on the integer cost
        mid = (lo + hi) // 2
        if _greedy(weights, parts, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = _greedy(weights, parts, lo)
    assert bounds is not None  # the total always fits
    return bounds


def type_weights(class_names: Sequence[str], method: str) -> list[int]:
    """1 for each layer whose class name matches the regex of ``type:REGEX``, else 0."""
    pattern = method[len("type:") :]
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise PartitionError(f"partition_method={method!r}: invalid regex: {error}") from None
    weights = [1 if regex.search(name) else 0 for name in class_names]
    if not any(weights):
        raise PartitionError(
            f"partition_method={method!r} matches no layer; the layer classes are "
            f"{sorted(set(class_names))}"
        )
    return weights


def partition(
    method: str, parts: int, class_names: Sequence[str], param_counts: Sequence[int]
) -> list[int]:
    """Boundaries for ``method`` ("parameters", "uniform", "type:REGEX"; case-insensitive;
    "best", DeepSpeed's config default, means "parameters")."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(class_names), parts)
    if lowered in ("parameters", "best"):
        return partition_balanced(param_counts, parts)
    if lowered.startswith("type:"):
        return partition_balanced(type_weights(class_names, method), parts)
    raise PartitionError(
        f'partition_method={method!r}: expected "parameters", "uniform" or "type:<regex>"'
    )


def describe(
    parts: Sequence[int], class_names: Sequence[str], param_counts: Sequence[int], method: str
) -> str:
    """A printable table of the partition: one row per stage."""
    lines = [f"pipeline partition ({method}): {len(parts) - 1} stages, {len(class_names)} layers"]
    for s in range(len(parts) - 1):
        a, b = parts[s], parts[s + 1]
        names = ", ".join(f"{i}:{class_names[i]}" for i in range(a, b))
        lines.append(f"  stage {s}: layers {a}-{b - 1} ({sum(param_counts[a:b]):,} params) {names}")
    return "\n".join(lines)
