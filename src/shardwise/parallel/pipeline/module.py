"""``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``: a model as a list of layers cut into stages.

The model is ``x = layer(x)`` over the list (a layer may take and return a tuple of tensors).
The list holds ``LayerSpec(cls, *args, **kwargs)`` (built only on the stage that owns it),
``TiedLayerSpec(key, cls, ...)`` (one module per stage shared by every layer with that key; its
``tied_weight_attr`` parameters are kept identical across stages: their gradients are summed
over the stages that hold them), ``nn.Module`` instances and plain callables.

Which stage am I? Ranks are ordered pipeline-outermost (topology.py), so stage
``rank // (world / num_stages)``: the module builds its stage in the constructor when
torch.distributed is running (call ``shardwise.init_distributed()`` first, as DeepSpeed
requires), so that ``model.parameters()`` can be handed to an optimizer before ``initialize``.
Built before the processes exist, or with ``num_stages=None`` (then ``pipeline.stages`` of the
config decides), it builds when ``initialize`` binds it to the mesh, from the random state it
was constructed with.

Weights: without ``seed_layers`` every rank replays the whole list in order, building and
dropping the layers of other stages, so each stage's weights are exactly those of building the
model in one process (the layers of other stages cost time, one at a time, not memory). With
``seed_layers=True`` layer i is built after seeding ``base_seed + i`` (DeepSpeed's rule) and
other stages' layers are skipped.

State-dict names are the layer index (``"3.weight"``) and ``"tied_modules.<key>.<name>"``, the
names of a ``num_stages=1`` PipelineModule (and of an ``nn.Sequential`` of the same layers).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.pipeline import partition as part

logger = logging.getLogger("shardwise")


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(
                f"LayerSpec only supports torch.nn.Module types, got {typename!r}; put a plain "
                "function in the layer list directly instead"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec with the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` (an input embedding reused as the output
    projection: ``lambda emb, h: h @ emb.weight.t()``). ``tied_weight_attr``: the parameter
    names (dotted paths are fine) kept identical on every stage that holds the key."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _count_params(layer: Any) -> int:
    """Trainable parameters of a layer, a spec built on the meta device (no memory, no
    random numbers drawn; a layer that cannot build there is built for real, RNG restored)."""
    if isinstance(layer, nn.Module):
        return _trainable(layer)
    if not isinstance(layer, LayerSpec):
        return 0
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return _trainable(layer.build())
        except Exception:  # noqa: BLE001 - a layer that needs real tensors to initialize
            return _trainable(layer.build())


def _get_attr(module: nn.Module, dotted: str) -> torch.nn.Parameter:
    target: Any = module
    for name in dotted.split("."):
        target = getattr(target, name)
    if not isinstance(target, torch.nn.Parameter):
        raise TypeError(f"tied_weight_attr {dotted!r} of {type(module).__name__} is no parameter")
    return target


class PipelineModule(nn.Module):
    """DeepSpeed's PipelineModule: ``layers`` cut into ``num_stages`` stages (see the module doc)."""

    def __init__(
        self,
        layers: Sequence[Any] | nn.Sequential,
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable | None = None,
        base_seed: int = 1234,
        partition_method: str | None = None,
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        if not specs:
            raise ValueError("PipelineModule(layers=...) needs at least one layer")
        for i, layer in enumerate(specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(
                    f"layers[{i}] is a {type(layer).__name__}: expected a LayerSpec, an "
                    "nn.Module or a callable"
                )
        if topology is not None:
            num_stages = getattr(topology, "pp", None) or topology.get_dim("pipe")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.class_names = [_class_name(x) for x in specs]
        self._specs = specs
        self._rng_state = torch.get_rng_state()  # a deferred build starts from here
        self.stage_id: int | None = None
        self.parts: list[int] = []
        if num_stages is not None and (num_stages == 1 or comm.is_initialized()):
            self._build(self._own_stage(num_stages), partition_method or "parameters")

    # ------------------------------------------------------------------ building
    @staticmethod
    def _own_stage(num_stages: int) -> int:
        world = comm.get_world_size()
        if world % num_stages:
            raise ValueError(
                f"num_stages={num_stages} does not divide the world size {world}: launch a "
                f"multiple of {num_stages} processes"
            )
        return comm.get_rank() // (world // num_stages)

    @property
    def built(self) -> bool:
        return self.stage_id is not None

    def build_stage(self, num_stages: int, stage_id: int, partition_method: str) -> None:
        """Build this rank's stage (what the constructor does when it knows its stage)."""
        if self.built:
            raise RuntimeError("this PipelineModule already built its stage")
        self.num_stages = num_stages
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state)
            self._build(stage_id, self.partition_method or partition_method)

    def _build(self, stage_id: int, method: str) -> None:
        counts = [_count_params(x) for x in self._specs]
        self.param_counts = counts
        self.parts = part.partition(method, self.num_stages, self.class_names, counts)
        self.partition_used = method
        self._check_every_stage_trains()
        self.stage_id = stage_id
        lo, hi = self.parts[stage_id], self.parts[stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.tied_stages = self._tied_stages()
        self._funcs: list[tuple[int, Callable]] = []
        for idx, spec in enumerate(self._specs):
            own = lo <= idx < hi
            if isinstance(spec, TiedLayerSpec):
                self._build_tied(idx, spec, own)
            elif isinstance(spec, LayerSpec):
                if own or not self.seed_layers:
                    module = self._make(idx, spec)  # built and dropped when not own: RNG replay
                    if own:
                        self.add_module(str(idx), module)
                        self._funcs.append((idx, module))
            elif own:
                if isinstance(spec, nn.Module):
                    self.add_module(str(idx), spec)
                self._funcs.append((idx, spec))
        # Other stages' modules are dropped here; the list keeps names and specs only.
        self._specs = [
            x if lo <= i < hi or not isinstance(x, nn.Module) else None
            for i, x in enumerate(self._specs)
        ]

    def _check_every_stage_trains(self) -> None:
        """A stage without trainable parameters has nothing for its optimizer: refuse it on
        every rank alike (the partition is the same everywhere), before any collective."""
        if self.num_stages == 1:
            return
        for s in range(self.num_stages):
            a, b = self.parts[s], self.parts[s + 1]
            if sum(self.param_counts[a:b]) == 0:
                raise part.PartitionError(
                    f"stage {s} would hold no trainable parameter (layers {a}-{b - 1}: "
                    f"{', '.join(self.class_names[a:b])}); use fewer stages or another "
                    f"partition_method than {self.partition_used!r}\n{self.describe()}"
                )

    def _make(self, idx: int, spec: LayerSpec) -> nn.Module:
        if self.seed_layers:
            seed = self.base_seed + idx
            if self.seed_fn is not None:
                self.seed_fn(seed)
            else:
                from shardwise.utils import set_random_seed

                set_random_seed(seed)
        return spec.build()

    def _build_tied(self, idx: int, spec: TiedLayerSpec, own: bool) -> None:
        """The first occurrence of a key builds its module (as one process would); this stage
        keeps it if any of its layers uses the key."""
        key = spec.key
        here = self.stage_id in self.tied_stages[key]
        if key not in self.tied_weight_attrs:
            self.tied_weight_attrs[key] = spec.tied_weight_attr
            if here or not self.seed_layers:
                module = self._make(idx, spec)
                if here:
                    self.tied_modules[key] = module
        if own:
            module = self.tied_modules[key]
            fn = functools.partial(spec.forward_fn, module) if spec.forward_fn else module
            self._funcs.append((idx, fn))

    def _tied_stages(self) -> dict[str, list[int]]:
        """For every tied key, the stages holding a layer that uses it (the same on all ranks)."""
        out: dict[str, list[int]] = {}
        for idx, spec in enumerate(self._specs):
            if isinstance(spec, TiedLayerSpec):
                stage = self.stage_of(idx)
                if stage not in out.setdefault(spec.key, []):
                    out[spec.key].append(stage)
        return out

    def stage_of(self, layer_idx: int) -> int:
        """The stage that owns layer ``layer_idx``."""
        for s in range(self.num_stages):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return s
        raise IndexError(f"layer {layer_idx} outside 0..{len(self.class_names) - 1}")

    def tied_parameters(self) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """This stage's tied parameters by key: [(state-dict name, parameter)], keys sorted."""
        out = {}
        for key in sorted(self.tied_modules.keys()):
            attrs = self.tied_weight_attrs[key]
            out[key] = [
                (f"tied_modules.{key}.{a}", _get_attr(self.tied_modules[key], a)) for a in attrs
            ]
        return out

    def describe(self) -> str:
        """The partition as a table (stage, layers, parameters)."""
        return part.describe(self.parts, self.class_names, self.param_counts, self.partition_used)

    # ------------------------------------------------------------------ running
    def forward(self, *inputs: Any) -> Any:
        """This stage's layers in order; several inputs travel as one tuple, as between stages."""
        if not self.built:
            raise RuntimeError(
                "this PipelineModule has not built its stage yet: pass it to shardwise.initialize "
                "(or build it after shardwise.init_distributed() with num_stages=...)"
            )
        x = inputs[0] if len(inputs) == 1 else inputs
        interval = self.activation_checkpoint_interval
        funcs = [fn for _, fn in self._funcs]
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return _run(funcs, x)
        for start in range(0, len(funcs), interval):
            chunk = funcs[start : start + interval]
            x = self._checkpointed(chunk, x) if self._checkpointable(chunk) else _run(chunk, x)
        return x

    def _checkpointable(self, chunk: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return any(_class_name(f) in self.checkpointable_layers for f in chunk)
        return any(isinstance(f, nn.Module) and _trainable(f) > 0 for f in chunk)

    def _checkpointed(self, chunk: list[Callable], x: Any) -> Any:
        """Run ``chunk`` without keeping its inner activations; backward recomputes them."""
        packed = isinstance(x, tuple)
        args = x if packed else (x,)

        def run(*a: Any) -> Any:
            return _run(chunk, a if packed else a[0])

        func = self.activation_checkpoint_func
        if func is None:
            from torch.utils.checkpoint import checkpoint

            func = functools.partial(checkpoint, use_reentrant=False)
        return func(run, *args)


def _run(funcs: list[Callable], x: Any) -> Any:
    for fn in funcs:
        x = fn(x)
    return x
