"""Gradient hooks that do not keep their strategy alive.

A strategy registers a hook on each parameter it reduces; the hook is a bound method, so the
parameter refers to the strategy, and the strategy (its buckets, flat layouts) refers back to
the parameter. Python's collector cannot break that cycle: torch keeps a parameter's hooks out
of its sight once C++ also holds the tensor. Measured in the test harness's workers: every
engine ever built stayed alive with its process groups, each group with gloo's threads (226
threads per rank halfway through a full run, the idle ranks at 9 % of a core each). A notebook
or a sweep that builds engines one after another would keep them all. The hook here holds its
method weakly: the engine owns the strategy; once the engine is gone, the hook does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls ``method(*args, tensor)`` while ``method``'s object lives."""
    ref = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, tensor)

    return hook
