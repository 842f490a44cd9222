"""``Config`` and ``parse_config``: a DeepSpeed JSON config, typed and validated once.

``parse_config`` checks everything that does not depend on the world size; ``Config.resolve_batch``
does the batch arithmetic once the data-parallel size is known. Policies (docs/config.md):

- Unknown keys are refused at every level, the top level included (DeepSpeed ignores unknown
  top-level keys, which hid the typo ``grandient_accumulation_steps`` in one of its own tests).
  Known DeepSpeed keys that shardwise does not read are accepted with one warning
  (:mod:`shardwise.config.keys`); features it lacks are refused with the reason.
- ``"auto"`` outside ``optimizer.params`` / ``scheduler.params`` means "the default" (batch keys:
  "not given", so they are worked out from the others). Inside those params it is kept and resolved
  (or refused) by ``build_optimizer`` / ``build_scheduler``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardwise.config.batch import GAS, MB, TB, BatchSizes, resolve_batch
from shardwise.config.checkpoint import CheckpointConfig, parse_checkpoint
from shardwise.config.comms import CommsConfig
from shardwise.config.compile import CompileConfig, parse_compile
from shardwise.config.errors import ConfigError, Notes, fail
from shardwise.config.keys import IGNORED, UNSUPPORTED, is_disabled
from shardwise.config.loader import load_source
from shardwise.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    FlopsProfilerConfig,
    MonitorConfig,
    WandbConfig,
)
from shardwise.config.optim_blocks import OptimizerConfig, SchedulerConfig, parse_optimizer
from shardwise.config.parallel import (
    ActivationCheckpointingConfig,
    ContextParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
    parse_activation_checkpointing,
    parse_pipeline,
    parse_tensor_parallel,
)
from shardwise.config.precision import BF16Config, FP16Config
from shardwise.config.scheduler_params import parse_scheduler
from shardwise.config.schema import AUTO, build, check_keys, schema_keys, spec
from shardwise.config.zero import ZeroConfig, parse_zero

_INTERNAL = {"internal": True}
# DeepSpeed 0.19.3 changed its gradient_clipping default from 0 to 1.0; shardwise keeps 0.
_NO_CLIPPING = (
    "gradient_clipping left out: no clipping (DeepSpeed 0.19.3 and later clip the gradient norm "
    "at 1.0 by default, earlier versions do not)"
)
_TOP_LEVEL_POLICY = (
    " (shardwise refuses unknown keys at every level; DeepSpeed silently ignores unknown "
    "top-level keys, so a misspelt key there has no effect. Remove or correct it)"
)


@dataclass(frozen=True)
class Config:
    """A validated config. Field names are DeepSpeed's JSON keys; see docs/config.md for each."""

    train_batch_size: int | None = spec(None, ge=1)
    train_micro_batch_size_per_gpu: int | None = spec(None, ge=1)
    gradient_accumulation_steps: int | None = spec(None, ge=1)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = spec(
        0.0, ge=0
    )  # max global grad norm; 0 = off (DeepSpeed's code default)
    steps_per_print: int | None = spec(None, ge=1)  # None: no step line (DeepSpeed's)
    seed: int | None = spec(None, ge=0)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comms: CommsConfig = field(default_factory=CommsConfig)  # shardwise's own: timeouts, hangs
    compile: CompileConfig = field(default_factory=CompileConfig)  # torch.compile per block
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    wall_clock_breakdown: bool = False  # log fwd / bwd / step times every steps_per_print
    memory_breakdown: bool = False  # log engine.memory_breakdown() every steps_per_print
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    zero_allow_untested_optimizer: bool = (
        False  # no effect: any torch optimizer works with ZeRO here
    )
    dataloader_drop_last: bool = False
    # Bookkeeping, not keys: the source dict, ignored top-level keys, and paths whose "auto" fell back.
    raw: dict[str, Any] = field(default_factory=dict, metadata=_INTERNAL)
    ignored: dict[str, Any] = field(default_factory=dict, metadata=_INTERNAL)
    auto_defaults: tuple[str, ...] = field(default=(), metadata=_INTERNAL)

    def get(self, key: str, default: Any = None) -> Any:
        """The source dict's ``key``: DeepSpeed's ``engine.config`` is that dict, and the
        Trainer reads it so (``engine.config.get("zero_optimization", {}).get("stage")``)."""
        return self.raw.get(key, default)

    def resolve_batch(self, dp_world_size: int) -> BatchSizes:
        """The batch triplet for ``dp_world_size`` data-parallel ranks (rules: :mod:`.batch`)."""
        return resolve_batch(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            dp_world_size,
            tuple(k for k in self.auto_defaults if k in (TB, MB, GAS)),
        )

    def with_values(self, updates: Mapping[str, Any]) -> Config:
        """A new Config with dotted-path values replaced in ``raw``, e.g. to fill in "auto":
        ``cfg.with_values({"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4})``.
        """
        raw = copy.deepcopy(self.raw)
        for dotted, value in updates.items():
            node = raw
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(
                        f"{dotted}: '{part}' is not an object in this config", key=dotted
                    )
            node[last] = value
        return parse_config(raw)


_BLOCK_PARSERS: dict[str, Callable[[Any, Notes], Any]] = {
    "optimizer": parse_optimizer,
    "scheduler": parse_scheduler,
    "zero_optimization": parse_zero,
    "tensor_parallel": parse_tensor_parallel,
    "pipeline": parse_pipeline,
    "activation_checkpointing": parse_activation_checkpointing,
    "checkpoint": parse_checkpoint,
    "compile": parse_compile,
}


def parse_config(source: dict[str, Any] | str | os.PathLike[str] | None) -> Config:
    """Read and validate a config: a dict, a JSON file path (or JSON text), or None (= ``{}``).

    Raises ConfigError naming the key for anything that does not depend on the world size;
    emits at most one ConfigWarning each for ignored keys, deprecated keys and "auto" defaults.
    """
    raw = load_source(source)
    notes = Notes()
    data, ignored = _screen_top_level(raw, notes)
    if data.get("steps_per_print") == math.inf:
        # Accelerate (and so the Trainer) writes float("inf") to silence the step lines, as
        # DeepSpeed's `global_steps % inf` never reaches 0: the largest integer does the same.
        data["steps_per_print"] = sys.maxsize
    blocks = {}
    for key, parser in _BLOCK_PARSERS.items():
        value = data.pop(key, None)
        if value is not None and value != "auto":
            blocks[key] = parser(value, notes)
        elif value == "auto":
            notes.auto_defaults.append(key)
    cfg = build(Config, data, "", notes)
    if data.get("gradient_clipping", AUTO) == AUTO:
        notes.differences.append(_NO_CLIPPING)
    cfg = dataclasses.replace(
        cfg, **blocks, raw=raw, ignored=ignored, auto_defaults=tuple(notes.auto_defaults)
    )
    _check_combinations(cfg)
    notes.emit()
    return cfg


def _screen_top_level(raw: dict[str, Any], notes: Notes) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split off ignored keys, refuse unknown and unsupported ones, map ``bfloat16`` to ``bf16``."""
    check_keys(
        raw,
        schema_keys(Config) | set(IGNORED) | set(UNSUPPORTED) | {"bfloat16"},
        "",
        _TOP_LEVEL_POLICY,
    )
    data, ignored = {}, {}
    for key, value in raw.items():
        if key in UNSUPPORTED and not is_disabled(value):
            raise fail(key, f"{UNSUPPORTED[key]}; shardwise does not support it. Remove the block")
        if key in IGNORED or key in UNSUPPORTED:
            ignored[key] = value
            notes.ignored.append(key)
        else:
            data[key] = value
    if "bfloat16" in data:
        if "bf16" in data:
            raise fail("bfloat16", "give 'bf16' or its legacy name 'bfloat16', not both")
        notes.deprecated.append("bfloat16 -> bf16 (the legacy top-level name)")
        data["bf16"] = data.pop("bfloat16")
    for key in (
        "fp16",
        "bf16",
        "tensor_parallel",
        "context_parallel",
        "activation_checkpointing",
        "zero_optimization",
        "comms",
    ):
        if data.get(key, "") is None:
            del data[key]  # null block = the defaults
    return data, ignored


def _check_combinations(cfg: Config) -> None:
    """Rules that involve more than one block."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise fail(
            "fp16.enabled",
            "fp16 and bf16 cannot both be enabled (bfloat16 and fp16 modes "
            "cannot be simultaneously enabled); keep one of them",
        )
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled and cfg.fp16.fp16_master_weights_and_grads and stage != 2:
        raise fail(
            "fp16.fp16_master_weights_and_grads",
            f"only supported with ZeRO stage 2 (zero_optimization.stage is {stage})",
        )
    if cfg.fp16.enabled and cfg.fp16.fp16_master_weights_and_grads:
        offload = cfg.zero_optimization.offload_optimizer
        if offload is None or offload.device != "cpu":
            raise fail(
                "fp16.fp16_master_weights_and_grads",
                "needs ZeRO-Offload, as in DeepSpeed (fp16 masters on the CPU, stepped by "
                'DeepSpeedCPUAdam): set zero_optimization.offload_optimizer {"device": "cpu"}',
            )
    stages = cfg.pipeline.stages
    if isinstance(stages, int) and stages > 1 and stage == 3:
        # DeepSpeed refuses stage 2 as well; shardwise runs it (gradients reduce-scattered
        # every micro-batch, tests/test_pipe_equivalence.py).
        raise fail(
            "zero_optimization.stage",
            f"ZeRO-3 is incompatible with pipeline parallelism (pipeline.stages is {stages}): "
            "each stage would gather its parameters for every micro-batch; use stage 0, 1 or 2",
        )
