"""``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``: a model as a list of layers cut into stages.

The model is ``x = layer(x)`` over the list (a layer may take and return a tuple of tensors).
The list holds ``LayerSpec(cls, *args, **kwargs)`` (built only on the stage that owns it),
``TiedLayerSpec(key, cls, ...)`` (one module per stage shared by every layer with that key; its
``tied_weight_attr`` parameters are kept identical across stages: their gradients are summed
over the stages that hold them), ``nn.Module`` instances and plain callables.

Which stage am I? Ranks are ordered pipeline-outermost (topology.py), so stage ``rank //
(world / num_stages)``: the module builds its stage in the constructor when torch.distributed
runs (``shardwise.init_distributed()`` first, as DeepSpeed requires), so that
``model.parameters()`` can go to an optimizer before ``initialize``. Built before the processes
exist, or with ``num_stages=None`` (``pipeline.stages`` decides), it builds when ``initialize``
binds it to the mesh, from the random state it was constructed with.

Weights: without ``seed_layers`` every rank replays the whole list in order, building and
dropping other stages' layers (time, one at a time, not memory), so each stage's weights are
those of building the model in one process. With ``seed_layers=True`` layer i is built after
seeding ``base_seed + i`` (DeepSpeed's rule) and other stages' layers are skipped.

State-dict names are the layer index (``"3.weight"``) and ``"tied_modules.<key>.<name>"``, the
names of a ``num_stages=1`` PipelineModule (and of an ``nn.Sequential`` of the same layers).
With ``layer_names`` (one dotted name per layer, e.g. ``"model.layers.2"``) each layer sits
under its name, so a pipeline cut from a model keeps its state-dict keys
(``shardwise.integrations.huggingface.causal_lm_pipeline``); a tied module sits under the name
of each of its layers on the stage (``model.embed_tokens`` on the first, ``lm_head`` on the
last; in one stage ``state_dict()`` lists the shared weight under both, as the model does).

Chunks: with ``chunks=v`` the layers are cut into p v virtual stages, this stage running v of
them as ``placement`` says (instructions.py): ``"loop"`` (interleaved: chunk c is virtual stage
c p + s) or ``"v"`` (zbv, dualpipev, v = 2: chunk 1 is 2p-1-s; stage 0 runs both ends).

``aux_loss_fn(layer)``: a layer's auxiliary loss (an MoE load-balancing loss), added to the
training loss on the layer's stage (aux_loss.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.activation.recompute import run_checkpointed
from shardwise.parallel.activation.selective import GroupRef
from shardwise.parallel.pipeline import partition as part
from shardwise.parallel.pipeline.instructions import PLACEMENTS, stage_and_chunk, virtual_stage
from shardwise.parallel.pipeline.specs import (
    LayerSpec,
    TiedLayerSpec,
    add_module_names,
    check_layer_names,
    class_name,
    count_params,
    get_attr,
    trainable,
)
from shardwise.seeding import set_random_seed

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

logger = logging.getLogger("shardwise")


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
        chunks: int | None = None,
        layer_names: Sequence[str] | None = None,
        placement: str | None = None,
        aux_loss_fn: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        super().__init__()
        specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        if not specs:
            raise ValueError("PipelineModule(layers=...) needs at least one layer")
        self._layer_names = check_layer_names(layer_names, len(specs))
        for i, layer in enumerate(specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(
                    f"layers[{i}] is a {type(layer).__name__}: expected a LayerSpec, an "
                    "nn.Module or a callable"
                )
        self._topo = topology  # a DeepSpeed ProcessTopology: initialize checks it (prepare.py)
        if topology is not None:
            num_stages = getattr(topology, "pp", None) or topology.get_dim("pipe")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1")
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks={chunks!r} must be an integer >= 1")
        if placement not in (None, *PLACEMENTS):
            raise ValueError(f"placement={placement!r}: expected one of {PLACEMENTS}")
        self.num_stages = num_stages
        self.chunks = chunks
        self.placement = placement  # of the chunks on the stages (instructions.py); None: loop
        self.loss_fn, self.aux_loss_fn = loss_fn, aux_loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        # partition_activations' tensor-parallel group, set by initialize (None: inputs kept whole)
        self.activation_partition = GroupRef(None)
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.class_names = [class_name(x) for x in specs]
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

    def build_stage(
        self,
        num_stages: int,
        stage_id: int,
        partition_method: str,
        chunks: int = 1,
        placement: str = "loop",
    ) -> None:
        """Build this rank's stage (what the constructor does when it knows its stage);
        ``chunks`` and ``placement`` apply when the module was not given them."""
        if self.built:
            raise RuntimeError("this PipelineModule already built its stage")
        self.num_stages = num_stages
        self.chunks = self.chunks or chunks
        self.placement = self.placement or placement
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state)
            self._build(stage_id, self.partition_method or partition_method)

    def _build(self, stage_id: int, method: str) -> None:
        self.chunks = self.chunks or 1
        self.placement = self.placement or "loop"
        if self.placement == "v" and self.chunks != 2:
            raise ValueError(f'placement="v" needs chunks=2 (a V of two chunks), got {self.chunks}')
        counts = [count_params(x) for x in self._specs]
        self.param_counts = counts
        virtual = self.num_stages * self.chunks  # virtual stage w: see instructions.py
        self.parts = part.partition(method, virtual, self.class_names, counts)
        self.partition_used = method
        self._check_every_stage_trains()
        self.stage_id = stage_id
        self.tied_modules = nn.ModuleDict()  # stays empty with layer_names (module doc)
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.tied_stages = self._tied_stages()
        self._funcs: list[tuple[int, Callable, int]] = []  # (layer index, callable, chunk)
        self._tied_layers: dict[int, tuple[str, Callable | None]] = {}  # idx -> (key, forward_fn)
        self._tied_home: dict[str, int] = {}  # key -> its first layer on this stage
        tied_built: dict[str, nn.Module] = {}
        # Module names of every stage's layers, when every layer is seen here (None: not).
        names: list[str] | None = []
        for idx, spec in enumerate(self._specs):
            chunk = self._chunk_of(idx)
            module = spec if isinstance(spec, nn.Module) else None
            if isinstance(spec, TiedLayerSpec):
                self._build_tied(idx, spec, chunk, tied_built)
            elif isinstance(spec, LayerSpec):
                if chunk is not None or not self.seed_layers:
                    module = self._make(idx, spec)  # built and dropped when not own: RNG replay
                    if chunk is not None:
                        self._register(idx, module)
                        self._funcs.append((idx, module, chunk))
            elif chunk is not None:
                if isinstance(spec, nn.Module):
                    self._register(idx, spec)
                self._funcs.append((idx, spec, chunk))
            names = add_module_names(names, self._name_of(idx), spec, module)
        self.all_stage_module_names = names
        # Other stages' modules are dropped here; the list keeps names and specs only.
        self._specs = [
            x if self._chunk_of(i) is not None or not isinstance(x, nn.Module) else None
            for i, x in enumerate(self._specs)
        ]

    def virtual_stage(self, chunk: int) -> int:
        """The position in the whole pipeline of this rank's ``chunk`` (loop: chunk * stages +
        stage; V: chunk 1 of stage s is 2 stages - 1 - s)."""
        return virtual_stage(self.num_stages, self.stage_id, chunk, self.placement)

    def _chunk_of(self, idx: int) -> int | None:
        """Which of this rank's chunks runs layer ``idx`` (None: another stage)."""
        stage, chunk = stage_and_chunk(self.num_stages, self.virtual_of(idx), self.placement)
        return chunk if stage == self.stage_id else None

    def virtual_of(self, layer_idx: int) -> int:
        """The virtual stage that owns layer ``layer_idx``."""
        for w in range(len(self.parts) - 1):
            if self.parts[w] <= layer_idx < self.parts[w + 1]:
                return w
        raise IndexError(f"layer {layer_idx} outside 0..{len(self.class_names) - 1}")

    def _check_every_stage_trains(self) -> None:
        """A stage without trainable parameters has nothing for its optimizer: refuse it on
        every rank alike (the partition is the same everywhere), before any collective."""
        if self.num_stages * self.chunks == 1:
            return
        for w in range(len(self.parts) - 1):
            a, b = self.parts[w], self.parts[w + 1]
            if sum(self.param_counts[a:b]) == 0:
                raise part.PartitionError(
                    f"{self._label(w)} would hold no trainable parameter (layers {a}-{b - 1}: "
                    f"{', '.join(self.class_names[a:b])}); use fewer stages or another "
                    f"partition_method than {self.partition_used!r}\n{self.describe()}"
                )

    def _make(self, idx: int, spec: LayerSpec) -> nn.Module:
        if self.seed_layers:
            seed = self.base_seed + idx
            if self.seed_fn is not None:
                self.seed_fn(seed)
            else:
                set_random_seed(seed)
        return spec.build()

    def _label(self, virtual: int) -> str:
        if self.chunks == 1:
            return f"stage {virtual}"
        return "stage {} chunk {}".format(
            *stage_and_chunk(self.num_stages, virtual, self.placement)
        )

    def _build_tied(
        self, idx: int, spec: TiedLayerSpec, chunk: int | None, built: dict[str, nn.Module]
    ) -> None:
        """The first occurrence of a key builds its module (as one process would); this stage
        keeps it if any of its layers uses the key: under ``tied_modules.<key>``, or with
        ``layer_names`` under the name of each of its layers here (module doc)."""
        key = spec.key
        here = self.stage_id in self.tied_stages[key]
        if key not in self.tied_weight_attrs:
            self.tied_weight_attrs[key] = spec.tied_weight_attr
            if here or not self.seed_layers:
                module = self._make(idx, spec)
                if here:
                    built[key] = module
                    if not self._layer_names:
                        self.tied_modules[key] = module
        if chunk is not None:
            self._tied_layers[idx] = (key, spec.forward_fn)
            self._tied_home.setdefault(key, idx)
            if self._layer_names:
                self._register(idx, built[key])
            self._funcs.append((idx, built[key], chunk))

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
        """The stage that runs layer ``layer_idx``."""
        return stage_and_chunk(self.num_stages, self.virtual_of(layer_idx), self.placement)[0]

    def tied_module(self, key: str) -> nn.Module:
        """This stage's module of tied ``key``, as the tree holds it now (tensor parallelism
        may have replaced it since the stage was built)."""
        if self._layer_names:
            return self.get_submodule(self._name_of(self._tied_home[key]))
        return self.tied_modules[key]

    def tied_parameters(self) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """This stage's tied parameters by key: [(state-dict name, parameter)], keys sorted."""
        out = {}
        for key in sorted(self._tied_home):
            home = (
                self._name_of(self._tied_home[key]) if self._layer_names else f"tied_modules.{key}"
            )
            module = self.tied_module(key)
            out[key] = [(f"{home}.{a}", get_attr(module, a)) for a in self.tied_weight_attrs[key]]
        return out

    def describe(self) -> str:
        """The partition as a table (stage, layers, parameters)."""
        labels = [self._label(w) for w in range(len(self.parts) - 1)]
        return part.describe(
            self.parts, self.class_names, self.param_counts, self.partition_used, labels
        )

    # ------------------------------------------------------------------ running
    def forward(self, *inputs: Any, chunk: int | None = None) -> Any:
        """This stage's layers in order (those of ``chunk`` only, when given: the interleaved
        schedule runs a stage's chunks separately); several inputs travel as one tuple, as
        between stages."""
        if not self.built:
            raise RuntimeError(
                "this PipelineModule has not built its stage yet: pass it to shardwise.initialize "
                "(or build it after shardwise.init_distributed() with num_stages=...)"
            )
        x = inputs[0] if len(inputs) == 1 else inputs
        interval = self.activation_checkpoint_interval
        funcs = [self._current(i, fn) for i, fn, c in self._funcs if chunk is None or c == chunk]
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return _run(funcs, x)
        for start in range(0, len(funcs), interval):
            run = funcs[start : start + interval]
            x = self._checkpointed(run, x) if self._checkpointable(run) else _run(run, x)
        return x

    def stage_modules(self, chunk: int | None = None) -> list[tuple[str, nn.Module]]:
        """This stage's layer modules (of ``chunk`` only, when given) as (name, module), in
        order (what compile regions are)."""
        funcs = [(i, fn) for i, fn, c in self._funcs if chunk is None or c == chunk]
        found = [(self._name_of(i), self._current(i, fn)) for i, fn in funcs]
        return [(n, m) for n, m in found if isinstance(m, nn.Module)]

    def compute_loss(self, outputs: Any, labels: Any) -> Any:
        """``loss_fn(outputs, labels)`` with the loss_fn the module holds now (a tensor-parallel
        plan may swap a loss module in place after the stage was built)."""
        return self.loss_fn(outputs, labels)

    def _current(self, idx: int, fn: Callable) -> Callable:
        """Layer ``idx`` as the module tree holds it now: tensor parallelism (or any user)
        may have replaced a layer module in place since the stage was built."""
        if idx in self._tied_layers:
            key, forward_fn = self._tied_layers[idx]
            module = self.tied_module(key)
            return functools.partial(forward_fn, module) if forward_fn else module
        if isinstance(fn, nn.Module):
            try:
                return self.get_submodule(self._name_of(idx))
            except AttributeError:
                return fn
        return fn

    def _name_of(self, idx: int) -> str:
        return self._layer_names[idx] if self._layer_names else str(idx)

    def _register(self, idx: int, module: nn.Module) -> None:
        """Layer ``idx`` under its name: the index, or ``layer_names[idx]`` (dotted names get
        empty parent modules, so the stage's state-dict keys are the original model's)."""
        *parents, leaf = self._name_of(idx).split(".")
        owner: nn.Module = self
        for child in parents:
            if not hasattr(owner, child):
                owner.add_module(child, nn.Module())
            owner = getattr(owner, child)
        owner.add_module(leaf, module)

    def _checkpointable(self, chunk: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return any(class_name(f) in self.checkpointable_layers for f in chunk)
        return any(isinstance(f, nn.Module) and trainable(f) > 0 for f in chunk)

    def _checkpointed(self, chunk: list[Callable], x: Any) -> Any:
        """Run ``chunk`` without keeping its inner activations; backward recomputes them."""
        packed = isinstance(x, tuple)
        args = x if packed else (x,)

        def run(*a: Any) -> Any:
            return _run(chunk, a if packed else a[0])

        func = self.activation_checkpoint_func
        if func is None:  # shardwise's: replays the TP trackers' streams, partitions if asked
            return run_checkpointed(run, args, {}, self.activation_partition.group)
        return func(run, *args)


def _run(funcs: list[Callable], x: Any) -> Any:
    for fn in funcs:
        x = fn(x)
    return x
