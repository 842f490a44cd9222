"""Values for a model built on the meta device: drawn module by module, from one RNG state.

``sync_rng`` gives every rank of a group its rank 0's CPU RNG state; ``materialize_meta``
gives one module's own meta tensors storage and values (its ``reset_parameters()``);
``materialize_model`` does it for every module a rank keeps once pipeline and tensor
parallelism have cut the model (``initialize`` with ZeRO stages 0-2; ZeRO-3 and ``zero.Init``
materialize module by module into shards themselves, partition.py and stage3.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import comm


def sync_rng(group: ProcessGroup | None = None) -> torch.Tensor | None:
    """Every rank takes the CPU RNG state of the group's rank 0. Returns this rank's previous
    state if it differed (so that a caller can give it back), else None."""
    if comm.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return None  # nothing to agree on (the fake backend of plan/simulate.py moves no data)
    own = torch.get_rng_state()
    common = own.clone()
    comm.broadcast(common, src=comm.get_global_rank(group, 0), group=group)
    torch.set_rng_state(common)
    return None if torch.equal(own, common) else own


def materialize_meta(module: nn.Module, device: torch.device | None = None) -> None:
    """Give ``module``'s own meta-device tensors real storage and values (reset_parameters()).

    Parameters keep their identity (``torch.utils.swap_tensors``), so an optimizer built over
    them still refers to them. Floating tensors are drawn in fp32 and then cast to the meta
    tensor's dtype, as a model built in fp32 and then converted would be."""
    metas = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta]
    metas_b = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
    if not metas and not metas_b:
        return
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device but no reset_parameters() "
            "to create their values: build the model under shardwise.parallel.zero.partition.Init() instead"
        )
    device = device or torch.device("cpu")
    dtypes = {}
    for name, p in metas:
        dtypes[name] = p.dtype
        draw = torch.get_default_dtype() if p.is_floating_point() else p.dtype
        real = nn.Parameter(torch.empty(p.shape, dtype=draw, device=device), p.requires_grad)
        try:
            torch.utils.swap_tensors(p, real)
        except RuntimeError:  # a subclass that cannot swap (a fake tensor: plan/simulate.py)
            setattr(module, name, real)
    for name in metas_b:
        b = module._buffers[name]
        module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    with torch.no_grad():
        reset()
    for name, dtype in dtypes.items():  # by name: a split layer's reset replaces its parameters
        p = module._parameters[name]
        p.data = p.data.to(dtype)


def materialize_model(model: nn.Module, group: ProcessGroup | None = None) -> bool:
    """Give a meta-device model (or what is left of one) its values, module by module, after
    pipeline and tensor parallelism cut it: each rank draws only the modules it keeps, at
    their split shapes (a split layer's ``reset_parameters`` draws the whole weight once,
    keeps its slice and drops the rest), from ``group``'s rank 0 RNG state, so that ranks
    holding the same modules hold the same values. Returns whether there was anything to do.

    The values are each module's ``reset_parameters()`` in ``model.modules()`` order: not a
    one-process build's (which draws every layer in constructor order), but the same on
    every layout that cuts the model alike."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return False
    own = sync_rng(group)
    for module in model.modules():
        materialize_meta(module)
    if own is not None:
        torch.set_rng_state(own)
    return True
