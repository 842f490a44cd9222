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

Balancing finds the smallest bottleneck B (the largest stage) by bisection, then the largest
floor L (the smallest stage) that a cut with every stage in [L, B] still meets, so that a
stage is left without weight only when no cut avoids it (a front-loaded greedy cut, bottleneck
alone, puts 5 matching layers on 4 stages as 2, 2, 0, 1; this gives 2, 1, 1, 1). Ties go to
earlier stages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

METHODS = ("parameters", "uniform", "type:<regex>")


class PartitionError(ValueError):
    """A partition that cannot be made; the message names the argument to change."""


def _check(n: int, parts: int) -> None:
    if parts < 1:
        raise PartitionError(f"num_stages={parts} must be >= 1")
    if n < parts:
        raise PartitionError(
            f"num_stages={parts} (pipeline.stages, times pipeline.chunks with several chunks a stage) is "
            f"more than the {n} layers of the PipelineModule: every stage needs at least one "
            f"layer; use at most {n} stages or split the model into more layers"
        )


def partition_uniform(n: int, parts: int) -> list[int]:
    """Boundaries giving each stage n // parts layers, the first n % parts one more."""
    _check(n, parts)
    size, extra = divmod(n, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return bounds


def _cuts(weights: Sequence[int], parts: int, low: int, high: int) -> list[int] | None:
    """The front-loaded cut with every stage non-empty and its cost in [low, high], or None.

    ``ok[k][i]``: layers i..n-1 split into k such stages; then each stage, in order, takes the
    longest run that leaves a splittable rest. O(parts * n^2), for the few hundred layers of a
    model at most."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    ok = [[False] * (n + 1) for _ in range(parts + 1)]
    ok[0][n] = True
    for k in range(1, parts + 1):
        for i in range(n):
            ok[k][i] = any(
                ok[k - 1][j] and low <= prefix[j] - prefix[i] <= high for j in range(i + 1, n + 1)
            )
    if not ok[parts][0]:
        return None
    bounds, start = [0], 0
    for s in range(parts):
        stop = max(
            j
            for j in range(start + 1, n + 1)
            if ok[parts - s - 1][j] and low <= prefix[j] - prefix[start] <= high
        )
        bounds.append(stop)
        start = stop
    return bounds


def _smallest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The smallest x in [lo, hi] with fits(x), fits being monotone and fits(hi) true."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def partition_balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries minimising the largest stage's sum of ``weights`` (contiguous, non-empty);
    among those, the one whose smallest stage is largest (no stage left without weight when
    another cut avoids it), earlier stages taking more on ties."""
    weights = [int(w) for w in weights]
    _check(len(weights), parts)
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must be >= 0, got {weights}")
    total = sum(weights)
    high = _smallest(max(weights), total, lambda b: _cuts(weights, parts, 0, b) is not None)
    # The largest feasible lower bound: bisect on -low to reuse the "smallest" search.
    low = -_smallest(-high, 0, lambda neg: _cuts(weights, parts, -neg, high) is not None)
    bounds = _cuts(weights, parts, low, high)
    assert bounds is not None  # low = 0 always fits
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
    parts: Sequence[int],
    class_names: Sequence[str],
    param_counts: Sequence[int],
    method: str,
    labels: Sequence[str] | None = None,
) -> str:
    """A printable table of the partition: one row per stage (``labels`` name the rows)."""
    n = len(parts) - 1
    labels = labels or [f"stage {s}" for s in range(n)]
    kind = "virtual stages" if any("chunk" in label for label in labels) else "stages"
    lines = [f"pipeline partition ({method}): {n} {kind}, {len(class_names)} layers"]
    for s in range(n):
        a, b = parts[s], parts[s + 1]
        names = ", ".join(f"{i}:{class_names[i]}" for i in range(a, b))
        lines.append(
            f"  {labels[s]}: layers {a}-{b - 1} ({sum(param_counts[a:b]):,} params) {names}"
        )
    return "\n".join(lines)
