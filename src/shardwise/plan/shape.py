"""A model as the planner sees it: its layers, and each parameter's shape, owner and TP split.

``read_model(module)`` reads any ``nn.Module`` (best built on the meta device: nothing is
allocated). The layers are what a pipeline cuts into stages, in order:

    a PipelineModule          its layer list (built as one stage if it was not built)
    an nn.Sequential          its children
    pipeline_layers()         a model that lists its own layers (shardwise.plan.models)
    anything else             one layer: it trains in every layout without a pipeline

Each parameter keeps its place in ``model.parameters()`` order (the order buckets and ZeRO
units follow), the module that owns it (a ZeRO-3 unit is one module's parameters), and, from
the tensor-parallel plan, the dimension of the *stored* tensor that tensor parallelism splits:

    colwise, colwise_rep, packed_colwise, vocab (Linear)   W (out, in): dim 0; bias: dim 0
    rowwise, rowwise_split_input                          W: dim 1; bias whole
    vocab (Embedding)                                     E (V, C): dim 0
    anything else                                         whole on every TP rank

(transposed for a GPT-2 Conv1D, which stores (in, out)). A split dimension of size n holds
ceil(n / t) rows on each of the t ranks (tensor/layers.py pads the vocabulary).

Experts: a parameter of a shardwise ``MoE`` layer's experts keeps its local expert index, the
layer's local expert count L and the ``ep_size`` it was built with (a model built with
``ep_size=ep`` holds L = E / ep experts). Its copies live on the expert-data group (dp / ep
ranks), where gradients are reduced and ZeRO shards it (parallel/moe/experts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardwise.parallel.flat import ceil_div
from shardwise.parallel.moe.layer import MOELayer
from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.parallel.tensor.layers import linear_dims
from shardwise.parallel.tensor.parallelize import match_plan
from shardwise.parallel.tensor.plans import resolve_plan
from shardwise.parallel.tensor.styles import ROW

COLUMN_STYLES = ("colwise", "colwise_rep", "packed_colwise", "vocab")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: shape, owning module (name in the model read), TP split dimension."""

    shape: tuple[int, ...]
    module: str
    split: int | None = None
    trainable: bool = True
    sequence_parallel: bool = False  # its module runs on sequence shards under SP
    expert: int = -1  # local index of its expert in a MoE layer (-1: not an expert)
    experts: int = 0  # the layer's local expert count as built (E / ep_size)
    ep: int = 1  # expert-parallel size: its copies are on dp / ep data ranks
    shared_with: int = -1  # a tensor of layer i used again here (a tied head): one copy when
    # both layers are on one stage, one on each stage holding them otherwise

    @property
    def is_expert(self) -> bool:
        return self.expert >= 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape each of ``tp`` tensor-parallel ranks stores."""
        if self.split is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.split] = ceil_div(shape[self.split], tp)
        return tuple(shape)


@dataclass
class LayerInfo:
    """One pipeline layer: its class name and its own parameters (a tied layer: the key)."""

    kind: str
    params: list[ParamInfo]
    tied: str | None = None
    name: str = ""  # the layer's module name in the model read ("" for a callable)


@dataclass
class ModelShape:
    """What the planner needs of a model (see the module docstring)."""

    name: str
    layers: list[LayerInfo]
    styles: dict[str, str]  # module name -> TP style
    pipeline: bool  # the layers can be cut into stages
    tied: dict[str, list[ParamInfo]] = field(default_factory=dict)
    module: nn.Module | None = None
    callables: list[Callable[..., Any]] = field(default_factory=list)
    loss_fn: Callable[..., Any] | None = None
    dims: Any = None  # shardwise.plan.models.Dims for a model built from flags
    free_ep: bool = False  # built with ep_size=1 by the planner: any ep dividing E can be built
    context_attention: bool = False  # attends through shardwise.attention (context parallelism)

    @property
    def params(self) -> list[ParamInfo]:
        out = [p for ps in self.tied.values() for p in ps]
        return out + [p for layer in self.layers for p in layer.params if p.shared_with < 0]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def module_is_pipeline(self) -> bool:
        return isinstance(self.module, PipelineModule)

    def pipeline_plan(self) -> dict[str, str]:
        """The TP styles under the names a PipelineModule of these layers gives its modules
        (``"<layer index>.<name in the layer>"``), for a config with ``pipeline.stages``."""
        named: dict[str, str] = {}
        for name, style in self.styles.items():
            for i, layer in enumerate(self.layers):
                if layer.name and (name == layer.name or name.startswith(layer.name + ".")):
                    named[f"{i}{name[len(layer.name) :]}"] = style
                    break
            else:
                named[name] = style  # outside the layers: the loss module, named alike
        # One pattern per module of the blocks: "1.mlp.fc", "2.mlp.fc" -> "*.mlp.fc".
        groups: dict[tuple[str, str], list[str]] = {}
        for name, style in named.items():
            index, _, rest = name.partition(".")
            groups.setdefault((rest if index.isdigit() else name, style), []).append(name)
        return {
            (f"*.{rest}" if len(names) > 1 else names[0]): style
            for (rest, style), names in groups.items()
        }

    @property
    def expert_counts(self) -> set[int]:
        """Experts per MoE layer as built (E / ep_size), empty without experts."""
        return {p.experts for p in self.params if p.is_expert}

    def ep_sizes(self) -> list[int]:
        """The expert-parallel sizes a layout may take: any divisor of E for a model the
        planner builds (``free_ep``), else the ``ep_size`` the model was built with."""
        built = {p.ep for p in self.params if p.is_expert}
        if not built:
            return [1]
        if self.free_ep:
            e = min(self.expert_counts)
            return [d for d in range(1, e + 1) if all(n % d == 0 for n in self.expert_counts)]
        return [max(built)]

    def layer_counts(self) -> list[int]:
        """Trainable parameters per layer (a tied layer's module counted at each use, as
        PipelineModule's partition counts it)."""
        return [
            sum(p.numel for p in (self.tied[x.tied] if x.tied else x.params) if p.trainable)
            for x in self.layers
        ]


def _layers(model: nn.Module) -> tuple[list[tuple[Any, str | None]], bool]:
    """(layer callable, tied key) per layer, and whether a pipeline can cut them."""
    if isinstance(model, PipelineModule):
        if not model.built:
            model.build_stage(1, 0, model.partition_method or "parameters")
        tied = model._tied_layers  # idx -> (key, forward_fn)
        funcs = [(model._current(i, fn), tied.get(i, (None,))[0]) for i, fn, _ in model._funcs]
        return funcs, True
    if isinstance(model, nn.Sequential):
        return [(m, None) for m in model.children()], True
    listed = getattr(model, "pipeline_layers", None)
    if callable(listed):
        return [(m, None) for m in listed()], True
    return [(model, None)], False


def _split_dim(module: nn.Module, attr: str, style: str | None) -> int | None:
    if style is None:
        return None
    if isinstance(module, nn.Embedding):
        return 0 if style == "vocab" and attr == "weight" else None
    dims = linear_dims(module)
    if dims is None:
        return None
    transposed = dims[2]
    if style in COLUMN_STYLES:
        return (1 if transposed else 0) if attr == "weight" else 0
    if style in ROW and attr == "weight":
        return 0 if transposed else 1
    return None


def _experts_of(model: nn.Module) -> dict[int, tuple[int, int, int]]:
    """id(parameter) -> (local expert index, local expert count, ep_size) of every expert."""
    out = {}
    for m in model.modules():
        if isinstance(m, MOELayer):
            for i, expert in enumerate(m.experts.deepspeed_experts):
                for p in expert.parameters():
                    out[id(p)] = (i, m.num_local_experts, m.ep_size)
    return out


def _params_of(
    module: nn.Module,
    prefix: str,
    styles: dict[str, str],
    seen: dict[int, int],
    experts: dict[int, tuple[int, int, int]],
    layer: int = 0,
) -> list[ParamInfo]:
    """``module``'s parameters; ``seen`` maps those read already to their layer: tied within
    a layer, counted once; tied to an earlier layer, kept with ``shared_with`` set."""
    out, mine = [], set()
    for sub, m in module.named_modules():
        name = f"{prefix}.{sub}".strip(".") if prefix else sub
        style = styles.get(name)
        for attr, p in m.named_parameters(recurse=False):
            owner = seen.setdefault(id(p), layer)
            if id(p) in mine:
                continue  # tied inside the layer: counted with its first module
            mine.add(id(p))
            split = _split_dim(m, attr, style)
            sp = style == "sequence_parallel"
            e = experts.get(id(p), (-1, 0, 1))
            shared = owner if owner != layer else -1
            out.append(ParamInfo(tuple(p.shape), name, split, p.requires_grad, sp, *e, shared))
    return out


def read_model(model: nn.Module, plan: dict[str, str] | None = None, name: str = "") -> ModelShape:
    """The planner's view of ``model``; ``plan`` overrides the model's own TP plan."""
    funcs, pipeline = _layers(model)
    try:
        styles = match_plan(model, resolve_plan(model, plan))
    except ValueError:
        styles = {}  # no plan: tensor parallelism is not an option for this model
    names = {id(m): n for n, m in model.named_modules()}
    experts = _experts_of(model)
    seen: dict[int, int] = {}
    layers, tied = [], {}
    for index, (fn, key) in enumerate(funcs):
        if not isinstance(fn, nn.Module):
            layers.append(LayerInfo(getattr(fn, "__name__", type(fn).__name__), [], key))
            continue
        prefix = names.get(id(fn), "")
        params = _params_of(fn, prefix, styles, seen, experts, index)
        if key is not None:  # a TiedLayerSpec: its module's parameters, once per key
            tied.setdefault(key, []).extend(p for p in params if p.shared_with < 0)
            params = []
        layers.append(LayerInfo(type(fn).__name__, params, key, prefix))
    loss = getattr(model, "loss_fn", None)
    return ModelShape(
        name or type(model).__name__,
        layers,
        styles,
        pipeline,
        tied,
        model,
        [fn for fn, _ in funcs],
        loss,
        getattr(model, "dims", None),
        free_ep=getattr(model, "free_ep", False),
        context_attention=getattr(model, "context_attention", False),
    )
