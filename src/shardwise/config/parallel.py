"""The ``tensor_parallel``, ``context_parallel``, ``pipeline`` and ``activation_checkpointing``
blocks.

``pipeline`` and ``activation_checkpointing`` keep DeepSpeed's keys; ``tensor_parallel``,
``context_parallel``, the pipeline ``schedule``, ``chunks`` and ``overlap_forward_backward``, and
``activation_checkpointing.checkpoint_layers`` are shardwise's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from shardwise.config.errors import Notes, fail, join, show
from shardwise.config.schema import build, spec
from shardwise.parallel.tensor.styles import style_problem

PARTITION_METHODS = ("parameters", "uniform", "best")  # plus "type:<regex>"


@dataclass(frozen=True)
class TensorParallelConfig:
    """``"tensor_parallel": {"size": 2, "plan": {"layers.*.q_proj": "colwise", ...}}``.

    ``plan`` maps module-name patterns to a style: shardwise's names or Hugging Face's (4.57 and
    5.x), all in one table (``shardwise.parallel.tensor.styles``; docs/tensor-parallel.md): e.g.
    colwise (split the output features), rowwise (split the input features, all-reduce the
    output), vocab (split the embedding rows), sequence_parallel (norms on sequence shards).
    A refused or unknown name is an error here; whether a style fits its module is checked on
    the model. Without a plan the model's own ``tp_plan`` is used, if it has one.
    """

    EXAMPLE: ClassVar[str] = '{"size": 2}'

    size: int = spec(1, ge=1)
    plan: dict[str, str] | None = None
    sequence_parallel: bool = False


@dataclass(frozen=True)
class ContextParallelConfig:
    """``"context_parallel": {"size": 2, "method": "ring"}``: split every sequence over ``size``
    ranks (docs/context-parallel.md). ``ring`` passes K/V blocks around the context ranks;
    ``ulysses`` (DeepSpeed-Ulysses) trades the sequence split for a head split by all-to-all and
    needs the attention heads (per tensor-parallel rank) divisible by ``size``."""

    EXAMPLE: ClassVar[str] = '{"size": 2, "method": "ring"}'

    size: int = spec(1, ge=1)
    method: Literal["ring", "ulysses"] = "ring"


@dataclass(frozen=True)
class PipelineConfig:
    """``"pipeline": {...}``: DeepSpeed's keys plus ``schedule``, ``chunks`` and
    ``overlap_forward_backward``.

    ``stages`` defaults to 1 here (DeepSpeed: "auto"); "auto" means "as many as the PipelineModule
    was built with". ``partition`` is DeepSpeed's config name for the PipelineModule argument
    ``partition_method`` (either key is accepted): "parameters", "uniform", "type:<regex>", or
    "best" (DeepSpeed's config default, which its engine never reads; treated as "parameters").
    ``overlap_forward_backward`` (DeepSpeed has no such key; DeepSeek's DualPipe hook is
    ``overlaped_forward_backward``, torch's action ``OVERLAP_F_B``): in "dualpipev"'s F&B steps,
    overlap one unit's messages with the other's compute (true), or run the pair's units one
    after the other (false); the results are equal bit for bit. Given with another schedule it
    is refused: no other schedule has F&B steps.
    """

    EXAMPLE: ClassVar[str] = '{"stages": 2, "schedule": "1f1b"}'
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"partition_method": "partition"}

    stages: int | Literal["auto"] = 1
    partition: str = "parameters"
    seed_layers: bool = False
    activation_checkpoint_interval: int = spec(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"] = "1f1b"
    chunks: int = spec(1, ge=1)  # model chunks per stage: interleaved v, zbv / dualpipev 2
    overlap_forward_backward: bool = True  # dualpipev's F&B steps (executor.py)


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``"activation_checkpointing": {...}``: DeepSpeed's keys plus ``checkpoint_layers``.

    ``checkpoint_layers`` chooses the modules whose forward is recomputed in backward:
    "all" (every block of the model's block list: its shallowest ``nn.ModuleList``), or a list
    of block indices (integers >= 0, into that list) and module names or patterns (strings,
    matched one dotted component at a time; ``*`` stands for one component: "blocks.*" is every
    block, "blocks.*.mlp" every block's MLP). None (default) checkpoints nothing unless the
    model or the pipeline's ``activation_checkpoint_interval`` asks for it. Patterns are checked
    against the model by ``shardwise.parallel.activation.selective.apply_activation_checkpointing``.
    """

    EXAMPLE: ClassVar[str] = '{"checkpoint_layers": "all"}'

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = spec(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    checkpoint_layers: list[str | int] | Literal["all"] | None = None


def parse_tensor_parallel(raw: object, notes: Notes) -> TensorParallelConfig:
    """Build ``TensorParallelConfig``; every plan style must be one the table runs."""
    path = "tensor_parallel"
    if not isinstance(raw, dict):
        raise fail(path, f"expected an object like {TensorParallelConfig.EXAMPLE}, got {show(raw)}")
    block = build(TensorParallelConfig, raw, path, notes)
    for pattern, style in (block.plan or {}).items():
        problem = style_problem(style)
        if problem:
            raise fail(join(join(path, "plan"), pattern), problem)
    return block


def parse_pipeline(raw: object, notes: Notes) -> PipelineConfig:
    """Build ``PipelineConfig``; accepts ``partition_method`` for ``partition``; checks the method."""
    path = "pipeline"
    if not isinstance(raw, dict):
        raise fail(path, f"expected an object like {PipelineConfig.EXAMPLE}, got {show(raw)}")
    raw = dict(raw)
    if "partition_method" in raw:
        if "partition" in raw:
            raise fail(
                join(path, "partition_method"), "give 'partition' or 'partition_method', not both"
            )
        raw["partition"] = raw.pop("partition_method")
    pipe = build(PipelineConfig, raw, path, notes)
    if isinstance(pipe.stages, int) and pipe.stages < 1:
        raise fail(join(path, "stages"), f'must be >= 1 or "auto", got {pipe.stages}')
    _check_partition(pipe.partition, join(path, "partition"))
    overlap = raw.get("overlap_forward_backward", "auto")  # "auto": the default, as anywhere
    if overlap != "auto" and pipe.schedule != "dualpipev":
        raise fail(
            join(path, "overlap_forward_backward"),
            f'only the "dualpipev" schedule pairs a forward with a backward (F&B steps), not '
            f'"{pipe.schedule}": remove the key or set "schedule": "dualpipev"',
        )
    return pipe


def _check_partition(method: str, path: str) -> None:
    lowered = method.lower()
    if lowered.startswith("type:"):
        try:
            re.compile(method[len("type:") :], re.IGNORECASE)
        except re.error as error:
            raise fail(path, f"invalid regular expression in {method!r}: {error}") from None
        return
    if lowered == "profile":
        raise fail(path, '"profile" partitioning is not implemented (DeepSpeed lacks it too)')
    if lowered not in PARTITION_METHODS:
        raise fail(
            path,
            f'expected one of "parameters", "uniform", "best" or "type:<regex>", got {show(method)}',
        )


def parse_activation_checkpointing(raw: object, notes: Notes) -> ActivationCheckpointingConfig:
    """Build ``ActivationCheckpointingConfig`` and check the form of ``checkpoint_layers``."""
    path = "activation_checkpointing"
    if not isinstance(raw, dict):
        raise fail(
            path,
            f"expected an object like {ActivationCheckpointingConfig.EXAMPLE}, got {show(raw)}",
        )
    block = build(ActivationCheckpointingConfig, raw, path, notes)
    layers = block.checkpoint_layers
    if isinstance(layers, list):
        for i, item in enumerate(layers):
            _check_layer_item(item, f"{join(path, 'checkpoint_layers')}[{i}]")
    return block


def _check_layer_item(item: str | int, path: str) -> None:
    if isinstance(item, int):
        if item < 0:
            raise fail(path, f"a block index must be >= 0, got {item}")
        return
    if item == "all":
        raise fail(path, 'write "checkpoint_layers": "all" on its own, not inside a list')
    if not item or any(part == "" for part in item.split(".")):
        raise fail(
            path,
            f'{show(item)} is not a module name: dotted names like "blocks.0" or "blocks.*.mlp"',
        )
