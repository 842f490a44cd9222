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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardwise.parallel.flat import ceil_div
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

    @property
    def params(self) -> list[ParamInfo]:
        out = [p for ps in self.tied.values() for p in ps]
        return out + [p for layer in self.layers for p in layer.params]

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


def _params_of(
    module: nn.Module, prefix: str, styles: dict[str, str], seen: set[int]
) -> list[ParamInfo]:
    out = []
    for sub, m in module.named_modules():
        name = f"{prefix}.{sub}".strip(".") if prefix else sub
        style = styles.get(name)
        for attr, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: counted with its first module
            seen.add(id(p))
            split = _split_dim(m, attr, style)
            sp = style == "sequence_parallel"
            out.append(ParamInfo(tuple(p.shape), name, split, p.requires_grad, sp))
    return out


def read_model(model: nn.Module, plan: dict[str, str] | None = None, name: str = "") -> ModelShape:
    """The planner's view of ``model``; ``plan`` overrides the model's own TP plan."""
    funcs, pipeline = _layers(model)
    try:
        styles = match_plan(model, resolve_plan(model, plan))
    except ValueError:
        styles = {}  # no plan: tensor parallelism is not an option for this model
    names = {id(m): n for n, m in model.named_modules()}
    seen: set[int] = set()
    layers, tied = [], {}
    for fn, key in funcs:
        if not isinstance(fn, nn.Module):
            layers.append(LayerInfo(getattr(fn, "__name__", type(fn).__name__), [], key))
            continue
        prefix = names.get(id(fn), "")
        params = _params_of(fn, prefix, styles, seen)
        if key is not None:
            tied.setdefault(key, []).extend(params)
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
    )
