"""The ``zero_optimization`` block: DeepSpeed's keys with DeepSpeed 0.19.8's code defaults
(deepspeed/runtime/zero/config.py and offload_config.py; pinned by tests/test_config_defaults.py).

Deprecated spellings still work, with a warning: ``cpu_offload: true`` becomes
``offload_optimizer: {"device": "cpu"}``, ``cpu_offload_param: true`` becomes
``offload_param: {"device": "cpu"}``, ``stage3_gather_fp16_weights_on_model_save`` becomes
``stage3_gather_16bit_weights_on_model_save``, and the old boolean form ``"zero_optimization": true``
means stage 1. An offload block with ``"device": "none"`` is stored as ``None`` (no offload).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from shardwise.config.errors import Notes, fail, join, show
from shardwise.config.schema import AUTO, build, check_keys, schema_keys, spec

# Keys whose non-default value asks for a GPU feature shardwise does not have: key -> (reason, default).
_UNSUPPORTED_WHEN_SET: dict[str, tuple[str, Any]] = {
    "zero_quantized_nontrainable_weights": ("ZeRO++ quantized frozen weights (GPU kernels)", False),
    "zenflow": ("ZenFlow's asynchronous offloaded optimizer step", None),
}
_OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


@dataclass(frozen=True)
class OffloadConfig:
    """Keys shared by ``offload_optimizer`` and ``offload_param``.

    Only ``"cpu"`` is a real device here; ``"nvme"`` (ZeRO-Infinity) is refused. On a CPU run the
    state already lives in host memory, so offloading to the CPU changes nothing.
    """

    EXAMPLE: ClassVar[str] = '{"device": "cpu"}'

    device: Literal["cpu", "none", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = spec(5, ge=0)  # NVMe staging buffers: no effect here
    pin_memory: bool = True  # page-locked host copies (DeepSpeed 0.19.5+; a CPU run has none)


@dataclass(frozen=True)
class OffloadOptimizerConfig(OffloadConfig):
    """``zero_optimization.offload_optimizer``: optimizer state (and step) in host memory."""

    buffer_count: int = spec(4, ge=0)  # DeepSpeed's default here is 4, not offload_param's 5
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = spec(1.0, gt=0, le=1)  # fraction offloaded; < 1 needs ZeRO stage 3
    super_offload: bool = False  # DeepSpeed's GPU/CPU overlap of the offloaded step: no effect
    cpuadam_cores_perc: float = spec(
        0.8, ge=0, le=1
    )  # cores for SuperOffload's CPU Adam: no effect


@dataclass(frozen=True)
class OffloadParamConfig(OffloadConfig):
    """``zero_optimization.offload_param``: ZeRO-3 parameters in host memory."""

    buffer_size: int = spec(100_000_000, ge=0)
    max_in_cpu: int = spec(1_000_000_000, ge=0)


@dataclass(frozen=True)
class ZeroConfig:
    """``"zero_optimization": {...}``: which model states are sharded across data-parallel ranks.

    stage 0: nothing sharded; 1: optimizer states; 2: + gradients; 3: + parameters.
    """

    EXAMPLE: ClassVar[str] = '{"stage": 2}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {"cpu_offload_use_pin_memory": "deprecated, no effect"}
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = spec(500_000_000, ge=0)  # elements per gradient bucket
    allgather_partitions: bool = True
    allgather_bucket_size: int = spec(500_000_000, ge=0)  # elements per parameter all-gather
    overlap_comm: bool | None = None  # None: DeepSpeed turns it on for stage 3 only
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    sub_group_size: int = spec(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = spec(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = spec(100_000, ge=0)
    stage3_model_persistence_threshold: int = spec(sys.maxsize, ge=0)
    stage3_max_live_parameters: int = spec(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = spec(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = spec(0, ge=0)
    stage3_use_all_reduce_for_fetch_params: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    use_multi_rank_bucket_allreduce: bool = True
    zero_hpz_partition_size: int = spec(1, ge=0)  # hpZ: ranks per secondary group; <= 1 off
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_shard_size: int = -1  # MiCS / HSDP: ranks per shard group; <= 0 off (DeepSpeed: > 0)
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    # Keys of DeepSpeed 0.19 with no effect here (docs/config.md says why for each).
    compute_grad_norm: bool = True
    parameter_alignment: bool = False
    stage3_allgather_sequential: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] = field(default_factory=dict)
    zenflow: dict[str, Any] | None = None

    @property
    def mics_shard(self) -> int:
        """Ranks per ZeRO shard group under MiCS (topology.py cuts the data ranks into them);
        0 when off: ZeRO shards over every data rank."""
        return max(self.mics_shard_size, 0)


def parse_zero(raw: object, notes: Notes) -> ZeroConfig:
    """Build ``ZeroConfig`` from the ``zero_optimization`` value (an object, or the old bool form)."""
    path = "zero_optimization"
    if isinstance(raw, bool):
        notes.deprecated.append(
            f'"zero_optimization": {show(raw)} means {{"stage": {int(raw)}}}; write that'
        )
        raw = {"stage": int(raw)}
    if not isinstance(raw, dict):
        raise fail(path, f"expected an object like {ZeroConfig.EXAMPLE}, got {show(raw)}")
    check_keys(raw, schema_keys(ZeroConfig), path)
    raw = _rename_deprecated(dict(raw), notes)
    offloads = {key: _parse_offload(raw.pop(key, None), key, notes) for key in _OFFLOAD_KEYS}
    zero = dataclasses.replace(build(ZeroConfig, raw, path, notes), **offloads)
    _check_zero(zero)
    return zero


def _rename_deprecated(raw: dict[str, Any], notes: Notes) -> dict[str, Any]:
    for old, new in ZeroConfig.RENAMED_KEYS.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        if new in raw:
            raise fail(
                join("zero_optimization", old),
                f"give either '{old}' (deprecated) or '{new}', not both",
            )
        if old.startswith("cpu_offload"):
            if not isinstance(value, bool):
                raise fail(
                    join("zero_optimization", old), f"expected true or false, got {show(value)}"
                )
            # Say what the value means: false must not read as if offload were now on.
            meaning = '{"device": "cpu"}' if value else "absent (no offload)"
            notes.deprecated.append(
                f"zero_optimization.{old}: {show(value)} means {new}: {meaning}; write that instead"
            )
            if value:
                raw[new] = {"device": "cpu"}
        else:
            notes.deprecated.append(f"zero_optimization.{old} -> {new}")
            raw[new] = value
    return raw


def _parse_offload(value: object, key: str, notes: Notes) -> Any:
    """The offload block as a dataclass, None for absent / ``device: "none"``; nvme is refused."""
    path = join("zero_optimization", key)
    if value == AUTO:
        notes.auto_defaults.append(path)
    if value is None or value == AUTO:
        return None
    cls = OffloadOptimizerConfig if key == "offload_optimizer" else OffloadParamConfig
    if not isinstance(value, dict):
        raise fail(path, f'must be an object like {{"device": "cpu"}}, got {show(value)}')
    offload = build(cls, value, path, notes)
    if offload.device == "nvme":
        raise fail(
            join(path, "device"),
            '"nvme" (ZeRO-Infinity) is not supported by shardwise: it needs NVMe drives and the '
            'DeepSpeed async-io extension; use "cpu" or "none"',
        )
    return None if offload.device == "none" else offload


def _check_zero(zero: ZeroConfig) -> None:
    path = "zero_optimization"
    if zero.stage not in (0, 1, 2, 3):
        raise fail(join(path, "stage"), f"must be 0, 1, 2 or 3, got {zero.stage}")
    for key, (feature, default) in _UNSUPPORTED_WHEN_SET.items():
        if getattr(zero, key) != default:
            raise fail(join(path, key), f"{feature} is not supported by shardwise; remove the key")
    _check_mics(zero)
    _check_hpz(zero)
    _check_quantized(zero)
    if zero.offload_param is not None and zero.stage != 3:
        raise fail(join(path, "offload_param"), f"needs ZeRO stage 3 (stage is {zero.stage})")
    if zero.offload_optimizer is not None:
        if zero.stage == 0:
            raise fail(join(path, "offload_optimizer"), "needs ZeRO stage 1, 2 or 3 (stage is 0)")
        if zero.offload_optimizer.ratio < 1 and zero.stage != 3:
            raise fail(
                join(path, "offload_optimizer.ratio"),
                f"partial offloading is only supported with ZeRO stage 3 (stage is {zero.stage})",
            )


def _check_mics(zero: ZeroConfig) -> None:
    """MiCS shards ZeRO's states within groups of ``mics_shard_size`` ranks: stage 0 has none."""
    path = "zero_optimization"
    if zero.mics_shard and zero.stage == 0:
        raise fail(
            join(path, "mics_shard_size"),
            f"{zero.mics_shard_size} shards ZeRO states within groups of that many ranks and "
            'needs "stage": 1, 2 or 3 (stage is 0); set a stage or remove the key',
        )
    if zero.mics_hierarchical_params_gather and (not zero.mics_shard or zero.stage != 3):
        raise fail(
            join(path, "mics_hierarchical_params_gather"),
            "gathers ZeRO-3 parameters of a MiCS shard group in two hops and needs "
            '"stage": 3 and mics_shard_size > 0; set them or remove the key',
        )


def _check_hpz(zero: ZeroConfig) -> None:
    """hpZ keeps secondary shards of ZeRO-3's parameters: no other stage has parameter shards,
    and MiCS keeps its gathers inside its shard group already (zero/hpz.py)."""
    path, size = "zero_optimization", zero.zero_hpz_partition_size
    if size > 1 and zero.stage != 3:
        raise fail(
            join(path, "zero_hpz_partition_size"),
            f"{size} keeps a secondary copy of ZeRO-3's parameter shards within groups of that "
            f'many ranks and needs "stage": 3 (stage is {zero.stage}); set "stage": 3, or 1 '
            "to turn hpZ off",
        )
    if size > 1 and zero.mics_shard:
        raise fail(
            join(path, "zero_hpz_partition_size"),
            f"{size} with mics_shard_size={zero.mics_shard_size}: MiCS already keeps every "
            "gather inside its shard group; use one of the two (remove a key)",
        )
    if size > 1 and zero.zero_quantized_weights:
        # Not yet composed: hpZ's secondary gathers and the int8 gathers are separate hooks on
        # a unit's gather (zero/hpz.py, zero/quantized_comm.py), untested together.
        raise fail(
            join(path, "zero_hpz_partition_size"),
            f"{size} with zero_quantized_weights: the two do not combine yet in shardwise; "
            "remove one of the keys",
        )


def _check_quantized(zero: ZeroConfig) -> None:
    """ZeRO++ quantizes the stage-3 parameter all-gather, and the gradient reduce-scatter of
    the stages that shard gradients (DeepSpeed 0.19 acts at stage 3 only, and ignores the keys
    elsewhere; stage 2's reduce-scatter takes the same scheme here)."""
    path = "zero_optimization"
    if zero.zero_quantized_weights and zero.stage != 3:
        raise fail(
            join(path, "zero_quantized_weights"),
            'quantizes the ZeRO-3 parameter all-gather and needs "stage": 3 '
            f"(stage is {zero.stage}); set the stage or remove the key",
        )
    if zero.zero_quantized_gradients and zero.stage not in (2, 3):
        raise fail(
            join(path, "zero_quantized_gradients"),
            "quantizes the gradient reduce-scatter of ZeRO stage 2 or 3 "
            f"(stage is {zero.stage}); set one or remove the key",
        )
