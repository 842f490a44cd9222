"""torch.compile, one region per block, with every collective outside the regions or opaque.

torchtitan's recipe (``apply_compile``: each transformer block compiled on its own): a region
is one entry of the model's block list (its shallowest ``nn.ModuleList``: GPT's ``blocks``,
Hugging Face's ``model.layers``), or, for a ``PipelineModule``, each layer module of this
rank's stage; a model without a block list is one region. Each block compiles once and every
block of the same code and shapes reuses its graph (dynamo's cache is per code object).

Regions exist for what must run eagerly between blocks: ZeRO-3's gathers, checkpoints, a
pipeline's sends. A layout with none of them (``whole=True``: DP, ZeRO-1/2, whose hooks are
on parameters; TP, whose collectives are custom ops; a ZeRO-3 that gathers nothing,
training/compiling.py) and a model with no module hook (but ``traceable`` ones) or
checkpoint compiles the whole model as one region, as DeepSpeed's ``engine.compile``
(``module.compile()``) does: the embedding, the final norm, the head and the loss fuse too,
and the Python and guard cost paid at each block's entry and exit is paid once
(benchmarks/README.md measured -6% CPU on the example GPT's DP step against -1% per block).
The price: dynamo traces every block instead of reusing one block's graph, so compile time
grows with the depth.

What is compiled is the region's ``forward``, replaced on the instance, not its ``__call__``:
hooks registered on the region module itself run eagerly around the compiled code. That is
where shardwise's communication stays, layout by layout (docs/compile.md):

    DP, ZeRO-1/2   post-accumulate-grad hooks on parameters: autograd runs them after the
                   compiled backward has written the gradients; nothing to trace
    ZeRO-3         the units of a region's modules are gathered by hooks on the region
                   (stage3 lifts them, ``region_of``), released after it, gathered again
                   when backward reaches it: per-block units, FSDP's granularity
    TP, SP         the collectives are custom ops (parallel/tensor/comm_ops.py): one opaque
                   node each in the graph, running shardwise.comm eagerly
    PP             send/receive between stages run by the executor, outside every layer
    activation     a checkpointed region's inner forward is compiled; the checkpoint (and its
    checkpointing  recompute) stays eager around it

Dynamo guards on parameter shapes: a ZeRO-3 parameter is whole whenever its region runs, so
its guards hold and nothing recompiles after the first step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from shardwise.config.compile import check_compile_kwargs
from shardwise.parallel.activation import selective

_COMPILED = "_shardwise_compiled"  # on a region's instance: the forward it replaced
_TRACEABLE = "_shardwise_traceable"  # on a hook dynamo may trace inside a region


def traceable(hook: Callable) -> Callable:
    """Mark a module hook as one a compiled region may run inside itself (it does nothing
    dynamo cannot trace, or breaks the graph only where the eager work is needed anyway):
    it does not make the model compile per block (``needs_blocks``)."""
    setattr(hook, _TRACEABLE, True)
    return hook


def compile_regions(model: nn.Module, whole: bool = False) -> list[tuple[str, nn.Module]]:
    """The regions of ``model`` as (name, module): a pipeline stage's layer modules, else the
    whole model ("") when ``whole`` and nothing inside it must stay eager (``needs_blocks``),
    else the entries of the block list, else the whole model."""
    stage = getattr(model, "stage_modules", None)
    if callable(stage):
        return [(n, m) for n, m in stage() if any(True for _ in m.parameters())]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists or (whole and not needs_blocks(model)):
        return [("", model)]
    name, blocks = selective.block_list(model, key="compile")
    return [(f"{name}.{i}" if name else str(i), b) for i, b in enumerate(blocks)]


def needs_blocks(model: nn.Module) -> bool:
    """True when something inside ``model`` must run eagerly around a block: a forward hook
    (ZeRO-3's gathers, a user's; not one marked ``traceable``) or an activation checkpoint."""
    return any(
        selective.is_checkpointed(m)
        or any(
            not getattr(h, _TRACEABLE, False)
            for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        )
        for m in model.modules()
        if m is not model
    )


def compile_blocks(
    model: nn.Module, backend: str | Callable = "inductor", kwargs: Any = None, whole: bool = False
) -> list[str]:
    """Compile each region of ``model`` (``compile_regions(model, whole)``) with
    ``torch.compile(forward, backend=backend, **kwargs)``; regions already compiled are left
    as they are. Returns the names of the regions compiled now."""
    kwargs = dict(kwargs or {})
    check_compile_kwargs(kwargs, "compile_kwargs")
    fn = resolve_backend(backend)
    done = []
    for name, module in compile_regions(model, whole):
        if is_compiled(module):
            continue
        # A checkpointed region: its inner forward is compiled, the checkpoint stays eager.
        key = selective.INNER if selective.is_checkpointed(module) else "forward"
        inner = module.__dict__[key] if key in module.__dict__ else module.forward
        module.__dict__[_COMPILED] = inner
        module.__dict__[key] = torch.compile(inner, backend=fn, **kwargs)
        shared = [m.shared_input for m in module.modules() if hasattr(m, "shared_input")]
        if shared:  # TP's per-forward cache of a prepared input: empty at each entry, so
            # that dynamo's guard on it holds every call (no recompile at the second step)
            module.register_forward_pre_hook(
                partial(_clear, list({id(s): s for s in shared}.values()))
            )
        done.append(name)
    return done


def _clear(caches: list[Any], module: nn.Module, args: Any) -> None:
    for cache in caches:
        cache.clear()


def is_compiled(module: nn.Module) -> bool:
    """True when ``module`` is a compiled region."""
    return _COMPILED in module.__dict__


def region_of(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module inside a compiled region of ``root`` -> that region (itself included)."""
    out: dict[nn.Module, nn.Module] = {}
    for module in root.modules():
        if is_compiled(module):
            out.update({m: module for m in module.modules()})
    return out


def resolve_backend(backend: str | Callable) -> str | Callable:
    """A dynamo backend name, or a dotted path ``package.module.fn`` imported here (DeepSpeed's
    rule); ValueError naming ``compile.backend`` when it is neither."""
    if callable(backend):
        return backend
    if not isinstance(backend, str):
        raise ValueError(f"compile.backend: expected a name or a callable, got {backend!r}")
    if backend in torch._dynamo.list_backends(exclude_tags=()):
        return backend
    module_name, _, fn_name = backend.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError, ValueError):
        known = ", ".join(torch._dynamo.list_backends())
        raise ValueError(
            f"compile.backend: {backend!r} is neither a dynamo backend ({known}) nor an "
            "importable package.module.function"
        ) from None
