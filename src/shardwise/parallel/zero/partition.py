"""Parameters partitioned at construction: DeepSpeed's ``zero.Init`` builds a model already
partitioned, ``GatheredParameters`` shows (and lets one rank change) whole parameters of a
partitioned model (both re-exported by ``shardwise.zero`` under DeepSpeed's names).

A parameter partitioned by ``Init`` carries DeepSpeed's attributes:

    p.data                  an empty tensor: ``p.numel() == 0`` outside a gather
    p.ds_shape, p.ds_numel  the whole parameter's shape and number of elements
    p.ds_tensor             this rank's shard: p flattened, zero-padded to N*S elements with
                            S = ceil(numel / N), split on that axis; rank r keeps [r*S, (r+1)*S)

``shardwise.initialize`` with ZeRO stage 3 moves the shards into the strategy's flat units
(``ds_tensor`` goes away, ``p._shardwise_unit`` names the unit); ``GatheredParameters`` works on
both kinds, and on whole parameters (a no-op, or a broadcast with ``modifier_rank``).

How ``Init`` partitions (and what it means for the random number generator):
- On entry every rank takes rank 0's CPU RNG state, so all ranks draw the same initial values
  without sending any parameter (on exit a rank whose state differed gets its own back).
- Modules are built for real, one at a time: a module's parameters are cut to this rank's
  shard once its *parent* is complete (when the parent is assigned to its own parent) or when
  the block ends. The constructor of a module may therefore still change its children's
  parameters (``nn.init.zeros_(self.proj.bias)``, tying ``self.head.weight =
  self.embed.weight``). Later, ``module.apply(fn)`` gathers each module's parameters around
  ``fn``, and an in-place function given a partitioned parameter itself (``nn.init.normal_(p)``
  in nanoGPT's loop over ``named_parameters()``, ``p.fill_(0)``) runs on the whole value; every
  rank computes the same values and keeps its shard. The random draws then happen in the same
  order as in a normal construction: the values equal a model built without ``Init`` from the
  same seed. Writes that bypass the parameter object outside ``apply`` (``p.data.normal_()``,
  through a view ``p[:3]``) are not seen: use ``GatheredParameters(p, modifier_rank=0)``.
- A model built on the meta device has no values to keep: ``Init(module=model)`` (or
  ``shardwise.initialize`` itself) materializes it module by module, in ``model.modules()``
  order, with each module's ``reset_parameters()`` drawing in fp32 from the RNG as it stands
  (rank 0's). That equals a normal construction from the same seed only when every
  parameterized module initializes itself in ``reset_parameters`` and the constructor ran its
  modules' initializations in that same order; custom initializations are lost.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardwise import comm
from shardwise.config import parse_config
from shardwise.launch.env import init_distributed
from shardwise.parallel.flat import ceil_div
from shardwise.parallel.zero.materialize import materialize_meta, sync_rng
from shardwise.precision import compute_dtype

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

__all__ = ["GatheredParameters", "Init", "full_value", "is_partitioned"]


# ----------------------------------------------------------------------------- one parameter
def is_partitioned(p: torch.Tensor) -> bool:
    """True when ``p`` holds only this rank's ``ds_tensor`` shard (built under ``Init``)."""
    return hasattr(p, "ds_tensor")


def partition(
    p: nn.Parameter, group: ProcessGroup | None = None, dtype: torch.dtype | None = None
) -> None:
    """Keep only this rank's shard of ``p`` (see the module docstring for the layout)."""
    if is_partitioned(p):
        return
    n, r = comm.get_world_size(group), comm.get_rank(group)
    flat, numel = p.data.reshape(-1), p.numel()
    s = ceil_div(numel, n)
    lo, hi = min(r * s, numel), min((r + 1) * s, numel)
    dtype = dtype or p.dtype
    shard = torch.zeros(s, dtype=dtype, device=p.device)
    shard[: hi - lo] = flat[lo:hi]
    p.ds_tensor, p.ds_shape, p.ds_numel, p.ds_group = shard, p.shape, numel, group
    p.data = torch.empty(0, dtype=dtype, device=p.device)


def numel(p: nn.Parameter) -> int:
    """Elements of ``p`` whole (a partitioned parameter's ``ds_numel``)."""
    return p.ds_numel if is_partitioned(p) else p.numel()


def gathers_nothing(model: nn.Module, threshold: int, budget: int) -> bool:
    """True when ZeRO-3 keeps every trained parameter of ``model`` whole (stage3's ``_plan``
    rule: each under ``threshold`` elements, all within ``budget``): no unit is ever
    gathered, so no hook has to run between the model's blocks."""
    sizes = [numel(p) for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    return all(n < threshold for n in sizes) and sum(sizes) <= budget


def full_value(p: nn.Parameter) -> torch.Tensor:
    """The whole value of ``p``: all-gathered from the shards when partitioned."""
    if not is_partitioned(p):
        return p.data
    group = p.ds_group
    out = p.ds_tensor.new_empty(p.ds_tensor.numel() * comm.get_world_size(group))
    comm.all_gather_into_tensor(out, p.ds_tensor, group=group)
    return out[: p.ds_numel].view(p.ds_shape)


def unpartition(p: nn.Parameter) -> None:
    """Make ``p`` whole again (a parameter shardwise will not manage, e.g. a frozen one)."""
    if not is_partitioned(p):
        return
    value = full_value(p).clone()
    for name in ("ds_tensor", "ds_group"):
        delattr(p, name)
    p.data = value


def _repartition(p: nn.Parameter) -> None:
    """Cut ``p``'s current whole ``data`` again (after every rank changed it identically)."""
    group = p.ds_group
    del p.ds_tensor
    partition(p, group)


# ----------------------------------------------------------------------------- writes
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


def _writes(func: Callable[..., Any]) -> bool:
    """In-place by PyTorch's naming: ``normal_``, ``Tensor.fill_``, ``p[i] = x``..."""
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _released(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and is_partitioned(t) and t.numel() == 0


class _WriteThrough(TorchFunctionMode):
    """Under ``Init``: an in-place function given a partitioned parameter
    (``nn.init.normal_(p)``, ``p.fill_(0)``, ``p[0] = 1``) runs on its whole value, then every
    rank keeps its shard. Every rank runs the same constructor, so every rank draws the same
    numbers; only writes are caught (a read on one rank alone must not start a collective)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        hit = list({id(t): t for t in tree_leaves((args, kwargs)) if _released(t)}.values())
        if not hit or not _writes(func):
            return func(*args, **kwargs)
        for p in hit:
            p.data = full_value(p).clone()
        try:
            return func(*args, **kwargs)
        finally:
            for p in hit:
                _repartition(p)


# ----------------------------------------------------------------------------- Init
class Init:
    """DeepSpeed's ``zero.Init``: a context under which modules are built partitioned (or,
    with ``module=``, a call that partitions an existing or meta-device model).

    ``data_parallel_group``: the ranks the shards are spread over (default: the world).
    ``config_dict_or_path`` / ``config``: a shardwise/DeepSpeed config; its 16-bit setting is
    the parameters' dtype unless ``dtype`` is given. ``mem_efficient_linear``, ``pin_memory``
    and ``remote_device=None/"cpu"`` are accepted and change nothing here (shards stay on the
    device they were built on); NVMe, quantized weights and a parameter swapper are refused.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: ProcessGroup | None = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: ProcessGroup | None = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "remote_device='nvme'": remote_device == "nvme",
            "zero_quantized_weights": zero_quantized_weights,
            "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights,
            "param_swapper": param_swapper is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
        }
        if any(refused.values()):
            names = ", ".join(k for k, v in refused.items() if v)
            raise ValueError(
                f"shardwise.parallel.zero.partition.Init does not support {names}; leave it unset"
            )
        if enabled and not comm.is_initialized():
            init_distributed()  # as DeepSpeed does: Init may come before initialize()
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype or _config_dtype(config_dict_or_path or config)
        self._modules: list[weakref.ref] = []
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        if module is not None and enabled:
            self._partition_existing(module)

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._own_rng = sync_rng(self.group)
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_parameter_registration_hook(self._on_parameter),
            mod.register_module_module_registration_hook(self._on_child),
        ]
        self._apply, nn.Module.apply = nn.Module.apply, _gathered_apply
        self._mode = _WriteThrough()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        self._mode.__exit__(*exc)
        nn.Module.apply = self._apply
        for h in self._handles:
            h.remove()
        if exc[0] is None:
            for ref in self._modules:
                m = ref()
                if m is not None:
                    self._partition_direct(m)
        if self._own_rng is not None:
            torch.set_rng_state(self._own_rng)
        self._modules.clear()

    # A new parameter: remember its module (in creation order) for the end of the block.
    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if id(module) not in self._seen:
            self._seen.add(id(module))
            self._modules.append(weakref.ref(module))

    # ``child`` is complete (it is being assigned to its parent): its own constructor can no
    # longer touch its children, so their parameters are cut now; ``child``'s own wait for
    # the parent to complete.
    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        for grandchild in child.children():
            for p in grandchild.parameters():
                self._partition(p)

    def _partition(self, p: nn.Parameter) -> None:
        if not p.is_meta:
            partition(p, self.group, self.dtype)

    def _partition_direct(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            self._partition(p)

    def _partition_existing(self, model: nn.Module) -> None:
        """``Init(module=model)``: materialize meta modules, take rank 0's values, partition."""
        own_rng = sync_rng(self.group)
        root = comm.get_global_rank(self.group, 0)
        with torch.no_grad():
            for m in model.modules():
                materialize_meta(m)
                for p in m.parameters(recurse=False):
                    if not is_partitioned(p):
                        comm.broadcast(p.data, src=root, group=self.group)
                        partition(p, self.group, self.dtype)
        if own_rng is not None:
            torch.set_rng_state(own_rng)


def _config_dtype(source: Any) -> torch.dtype | None:
    if source is None:
        return None

    return compute_dtype(parse_config(source))


def _gathered_apply(self: nn.Module, fn: Callable[..., Any]) -> nn.Module:
    """``nn.Module.apply`` under ``Init``: each module's own parameters are whole around
    ``fn(module)``; every rank computes the same values and keeps its shard of them."""
    for child in self.children():
        child.apply(fn)
    mine = [p for p in self.parameters(recurse=False) if is_partitioned(p)]
    for p in mine:
        p.data = full_value(p).clone()
    fn(self)
    for p in mine:
        _repartition(p)
    return self


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., Any], target_fp_dtype: torch.dtype | None = None, target_device: Any = None
) -> Callable[..., Any]:
    """DeepSpeed's hook for wrapping tensor constructors under ``zero.Init``. This ``Init``
    wraps none (a tensor is built where, and in the dtype, the code asks), so ``fn`` comes back
    unchanged; transformers swaps the name out and back around ``zero.Init``."""
    return fn


# ----------------------------------------------------------------------------- gathering
class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters``: inside the block the given parameters are
    whole on every rank. On exit, if ``modifier_rank`` (a rank of the parameters' group) is
    given, that rank's values are broadcast and every rank keeps its shard of them (the fp32
    master follows); otherwise changes are discarded. ``fwd_module`` is accepted and unused."""

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        # None stands for an absent parameter (transformers passes a missing bias): skipped,
        # as DeepSpeed skips anything that is not a ZeRO parameter
        self.params = list({id(p): p for p in params if p is not None}.values())
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def __enter__(self) -> None:
        if not self.enabled:
            return
        units = [getattr(p, "_shardwise_unit", None) for p in self.params]
        self.units = list({id(u): u for u in units if u is not None}.values())
        self.loose = [p for p in self.params if is_partitioned(p)]
        self.whole = [
            p for p in self.params if not is_partitioned(p) and not hasattr(p, "_shardwise_unit")
        ]
        for u in self.units:
            u.users += 1
            u.materialize(exact=True)
        for p in self.loose:
            p.data = full_value(p).clone()

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc[0] is None
        with torch.no_grad():
            for u in self.units:
                if modify:
                    u.absorb(comm.get_global_rank(u.data_group, self.modifier_rank))
                u.users -= 1
                u.release()
            for p in self.loose:
                if modify:
                    src = comm.get_global_rank(p.ds_group, self.modifier_rank)
                    comm.broadcast(p.data, src=src, group=p.ds_group)
                    _repartition(p)
                else:
                    p.data = p.ds_tensor.new_empty(0)
            for p in self.whole if modify else []:
                comm.broadcast(p.data, src=comm.get_global_rank(None, self.modifier_rank))
