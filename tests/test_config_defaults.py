"""The DeepSpeed-named config blocks have DeepSpeed 0.19's defaults (docs/config.md).

One table per block: (key, DeepSpeed 0.19.8's code default, where it comes from). Paths are
DeepSpeed's source files under ``deepspeed/``; ``ZC`` = runtime/zero/config.py
(``DeepSpeedZeroConfig``), ``OC`` = runtime/zero/offload_config.py, ``PC`` =
runtime/precision_config.py (``DeepSpeedFP16Config``, ``DeepSpeedBF16Config``), ``MC`` =
monitor/config.py, ``CONST`` = runtime/constants.py. A row whose fourth value is not ``SAME`` is a
deliberate difference: it gives shardwise's value and docs/config.md gives the reason.
"""

from __future__ import annotations

import dataclasses
import warnings
from operator import attrgetter

import pytest

from shardwise.config import (
    BF16Config,
    ConfigWarning,
    DeepSpeedDifferenceWarning,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    parse_config,
)
from shardwise.config.schema import is_key
from shardwise.parallel.strategy_contract import bucket_elements
from shardwise.precision import LossScaler

SAME = object()  # shardwise's value is DeepSpeed's
ZC, OC, PC = (
    "runtime/zero/config.py",
    "runtime/zero/offload_config.py",
    "runtime/precision_config.py",
)
MC, CONST = "monitor/config.py", "runtime/constants.py"
REMOVED = "runtime/zero/config.py of 0.19.5 (0.19.8 removed the key; still accepted here)"

# fmt: off
ZERO = [  # zero_optimization.<key>
    ("stage", 0, ZC, SAME),
    ("contiguous_gradients", True, ZC, SAME),
    ("reduce_scatter", True, ZC, SAME),
    ("reduce_bucket_size", 500_000_000, ZC, SAME),  # the effective bucket: see below
    ("use_multi_rank_bucket_allreduce", True, ZC, SAME),
    ("allgather_partitions", True, ZC, SAME),
    ("allgather_bucket_size", 500_000_000, ZC, SAME),
    ("overlap_comm", None, ZC, SAME),  # None: DeepSpeed's validator then sets stage == 3
    ("compute_grad_norm", True, ZC, SAME),
    ("load_from_fp32_weights", True, ZC, SAME),
    ("elastic_checkpoint", False, ZC, SAME),
    ("offload_param", None, ZC, SAME),
    ("offload_optimizer", None, ZC, SAME),
    ("zenflow", None, ZC, SAME),
    ("sub_group_size", 1_000_000_000, ZC, SAME),
    ("stage3_prefetch_bucket_size", 50_000_000, ZC, SAME),
    ("stage3_param_persistence_threshold", 100_000, ZC, SAME),
    ("stage3_model_persistence_threshold", 2**63 - 1, ZC, SAME),  # sys.maxsize
    ("stage3_max_live_parameters", 1_000_000_000, ZC, SAME),
    ("stage3_max_reuse_distance", 1_000_000_000, ZC, SAME),
    ("stage3_gather_16bit_weights_on_model_save", False, ZC, SAME),
    ("stage3_module_granularity_threshold", 0, ZC, SAME),
    ("stage3_use_all_reduce_for_fetch_params", False, ZC, SAME),
    ("stage3_allgather_sequential", False, ZC, SAME),
    ("ignore_unused_parameters", True, ZC, SAME),
    ("legacy_stage1", False, ZC, SAME),
    ("round_robin_gradients", False, ZC, SAME),
    ("parameter_alignment", False, ZC, SAME),
    ("zero_hpz_partition_size", 1, ZC, SAME),
    ("zero_quantized_weights", False, ZC, SAME),
    ("zero_quantized_nontrainable_weights", False, ZC, SAME),
    ("zero_quantized_gradients", False, ZC, SAME),
    ("memory_efficient_linear", True, ZC, SAME),
    ("pipeline_loading_checkpoint", False, ZC, SAME),
    ("override_module_apply", True, ZC, SAME),
    ("log_trace_cache_warnings", False, ZC, SAME),
    ("enable_sanity_checks", False, ZC, SAME),
    ("save_muon_momentum_buffer_in_memory", False, ZC, SAME),
    ("leaf_module", {}, ZC, SAME),  # DeepSpeedZeroLeafModuleConfig(): nothing listed
    ("zeropp_loco_param", None, REMOVED, SAME),
    ("mics_shard_size", -1, REMOVED, SAME),
    ("mics_hierarchical_params_gather", False, REMOVED, SAME),
]
OFFLOAD = [  # (block, key, DeepSpeed's, source, ours)
    ("offload_param", "device", "cpu", OC, SAME),  # given: "none" is stored as no block
    ("offload_param", "nvme_path", None, OC, SAME),
    ("offload_param", "buffer_count", 5, OC, SAME),
    ("offload_param", "buffer_size", 100_000_000, OC, SAME),
    ("offload_param", "max_in_cpu", 1_000_000_000, OC, SAME),
    ("offload_param", "pin_memory", True, OC, SAME),  # fixed here (was False: DeepSpeed < 0.19.5)
    ("offload_optimizer", "device", "cpu", OC, SAME),
    ("offload_optimizer", "nvme_path", None, OC, SAME),
    ("offload_optimizer", "buffer_count", 4, OC, SAME),  # fixed here (was offload_param's 5)
    ("offload_optimizer", "pin_memory", True, OC, SAME),  # fixed here (was False)
    ("offload_optimizer", "pipeline_read", False, OC, SAME),
    ("offload_optimizer", "pipeline_write", False, OC, SAME),
    ("offload_optimizer", "fast_init", False, OC, SAME),
    ("offload_optimizer", "ratio", 1.0, OC, SAME),
    ("offload_optimizer", "super_offload", False, OC, SAME),
    ("offload_optimizer", "cpuadam_cores_perc", 0.8, OC, SAME),
]
PRECISION = [  # (block.key, DeepSpeed's, source, ours); "ignored": accepted, no effect
    ("fp16.enabled", False, PC, SAME),
    ("fp16.auto_cast", False, PC, SAME),
    ("fp16.loss_scale", 0, PC, SAME),  # 0: dynamic loss scaling
    ("fp16.initial_scale_power", 16, PC, SAME),
    ("fp16.loss_scale_window", 1000, PC, SAME),
    ("fp16.hysteresis", 2, PC, SAME),
    ("fp16.consecutive_hysteresis", False, PC, SAME),
    ("fp16.min_loss_scale", 1, PC, SAME),
    ("fp16.fp16_master_weights_and_grads", False, PC, SAME),
    ("bf16.enabled", False, PC, SAME),
    ("bf16.bf16_master_weights_and_grads", False, PC, SAME),
    ("bf16.bf16_optimizer_states", False, PC, SAME),
    ("bf16.immediate_grad_update", False, PC, "ignored"),  # DeepSpeed's BF16_Optimizer detail
    ("bf16.check_grad_overflow", True, PC, "ignored"),
]
TOP_LEVEL = [
    # 0.19.3 changed it from 0 to 1.0 (GRADIENT_CLIPPING_DEFAULT); shardwise keeps 0, and warns
    ("gradient_clipping", 1.0, CONST, 0.0),
    ("steps_per_print", None, CONST, SAME),
]
MONITORS = [
    *[(f"{block}.{key}", value, MC, SAME) for block in ("tensorboard", "csv_monitor")
      for key, value in (("enabled", False), ("output_path", ""), ("job_name", "DeepSpeedJobName"))],
    ("wandb.enabled", False, MC, SAME),
    ("wandb.group", None, MC, SAME),
    ("wandb.team", None, MC, SAME),
    ("wandb.project", "deepspeed", MC, SAME),
    ("comet.enabled", False, MC, SAME),
    ("comet.samples_log_interval", 100, MC, SAME),
    *[(f"comet.{key}", None, MC, SAME) for key in
      ("project", "workspace", "api_key", "experiment_name", "experiment_key", "online", "mode")],
]
# fmt: on
DOTTED = [(f"zero_optimization.{k}", v, src, ours) for k, v, src, ours in ZERO] + [
    *PRECISION,
    *TOP_LEVEL,
    *MONITORS,
]


def quietly(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return parse_config(source)


def _same(got, want) -> bool:
    return got == want and (type(got) is type(want) or {type(got), type(want)} <= {int, float})


@pytest.mark.parametrize("key, deepspeeds, source, ours", DOTTED, ids=[r[0] for r in DOTTED])
def test_empty_config_has_deepspeeds_default(key, deepspeeds, source, ours):
    if ours == "ignored":
        block, name = key.split(".")
        assert name in BF16Config.IGNORED_KEYS, f"{key}: neither read nor ignored"
        quietly({block: {name: deepspeeds}})  # accepted with DeepSpeed's default value
        return
    got = attrgetter(key)(quietly({}))
    want = deepspeeds if ours is SAME else ours
    assert _same(got, want), f"{key} = {got!r}; DeepSpeed 0.19.8's is {deepspeeds!r} ({source})" + (
        "" if ours is SAME else f", shardwise's deliberate {ours!r} (docs/config.md)"
    )


@pytest.mark.parametrize(
    "block, key, deepspeeds, source, ours", OFFLOAD, ids=[f"{b}.{k}" for b, k, *_ in OFFLOAD]
)
def test_offload_blocks_have_deepspeeds_defaults(block, key, deepspeeds, source, ours):
    zero = quietly({"zero_optimization": {"stage": 3, block: {"device": "cpu"}}}).zero_optimization
    got = getattr(getattr(zero, block), key)
    assert _same(got, deepspeeds), f"{block}.{key} = {got!r}; DeepSpeed 0.19.8's is {deepspeeds!r}"


@pytest.mark.parametrize(
    "cls, rows",
    [
        (ZeroConfig, {k for k, *_ in ZERO}),
        (OffloadParamConfig, {k for b, k, *_ in OFFLOAD if b == "offload_param"}),
        (OffloadOptimizerConfig, {k for b, k, *_ in OFFLOAD if b == "offload_optimizer"}),
        (FP16Config, {k.split(".")[1] for k, *_ in PRECISION if k.startswith("fp16.")}),
        (
            BF16Config,
            {k.split(".")[1] for k, _, _, o in PRECISION if k[:4] == "bf16" and o == SAME},
        ),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_every_key_of_the_block_has_a_row(cls, rows):
    keys = {f.name for f in dataclasses.fields(cls) if is_key(f)}  # deprecated names aside
    assert keys == rows, (
        f"{cls.__name__}: no row for {sorted(keys - rows)}, rows without a key {sorted(rows - keys)}"
    )


def test_fp16_defaults_reach_the_loss_scaler():
    """The dynamic scaler DeepSpeed builds from an fp16 block of defaults (fp16/loss_scaler.py)."""
    scaler = LossScaler.from_config(quietly({"fp16": {"enabled": True}}))
    got = (scaler.scale, scaler.scale_window, scaler.delayed_shift, scaler.min_scale)
    assert got == (2.0**16, 1000, 2, 1), f"(scale, window, hysteresis, min scale) = {got}"
    assert scaler.dynamic and not scaler.consecutive_hysteresis


def test_gradient_clipping_left_out_warns_that_deepspeed_0_19_3_clips_at_1():
    with pytest.warns(DeepSpeedDifferenceWarning, match="DeepSpeed 0.19.3 and later clip"):
        assert parse_config({}).gradient_clipping == 0.0
    for given in (0.0, 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeepSpeedDifferenceWarning)
            assert parse_config({"gradient_clipping": given}).gradient_clipping == given


def test_reduce_bucket_size_left_out_means_4_mi_elements_given_means_itself():
    """docs/config.md: DeepSpeed's 5e8 elements would make one bucket of any CPU-sized model."""
    assert bucket_elements(quietly({})) == 2**22
    given = quietly({"zero_optimization": {"reduce_bucket_size": 500_000_000}})
    assert bucket_elements(given) == 500_000_000


def test_the_new_deepspeed_keys_are_refused_when_they_ask_for_a_missing_feature():
    for source, key in [
        ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ]:
        with pytest.raises(ValueError) as info:
            quietly(source)
        assert getattr(info.value, "key", None) == key, f"{source}: {info.value}"
