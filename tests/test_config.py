"""Specification of parse_config: sources, types, unknown keys, the blocks, "auto" (batch sizes:
test_config_reference.py; optimizer and scheduler blocks: test_optim.py, test_lr_schedules.py)."""

import dataclasses
import json
import warnings
from operator import attrgetter
from pathlib import Path

import pytest

import shardwise.config
from shardwise.config import BatchSizes, ConfigError, ConfigWarning, OffloadConfig, parse_config
from shardwise.config.keys import IGNORED, UNSUPPORTED
from shardwise.config.schema import schema_keys

REPO = Path(__file__).resolve().parents[1]


def parse_quietly(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return parse_config(source)


def refused(source, key: str, text: str) -> ConfigError:
    """Assert that parse_config refuses ``source`` naming ``key`` with ``text`` in the message."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ConfigError) as info:
            parse_config(source)
    assert info.value.key == key, f"{source}: error names {info.value.key!r}, expected {key!r}"
    assert text in str(info.value), f"{source}: {text!r} not in {str(info.value)!r}"
    return info.value


# --- sources ---------------------------------------------------------------------------------


# fmt: off
DEFAULTS = [  # the DeepSpeed blocks' defaults are pinned, row by row, in test_config_defaults.py
    ("raw", {}), ("optimizer", None), ("scheduler", None), ("seed", None),
    ("steps_per_print", None),  # DeepSpeed's since 0.15: no step line (docs/config.md)
    ("communication_data_type", None), ("tensor_parallel.size", 1),
    ("pipeline.stages", 1), ("pipeline.schedule", "1f1b"), ("pipeline.activation_checkpoint_interval", 0),
    ("pipeline.pipe_partitioned", True), ("pipeline.overlap_forward_backward", True),
    ("activation_checkpointing.checkpoint_layers", None),
    ("checkpoint.keep_last", None), ("checkpoint.tag_validation", "Warn"),
    ("checkpoint.load_universal", False), ("checkpoint.parallel_write.pipeline_stage", False),
    ("checkpoint.save_dir", None), ("checkpoint.save_interval_steps", None), ("checkpoint.auto_resume", False),
]
# fmt: on


@pytest.mark.parametrize("attribute, default", DEFAULTS, ids=[a for a, _ in DEFAULTS])
def test_none_is_the_empty_config_with_deepspeed_defaults(attribute, default):
    assert attrgetter(attribute)(parse_quietly(None)) == default


def test_file_path_pathlike_and_json_text_give_the_same_config(tmp_path):
    source = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(source))
    configs = [parse_config(s) for s in (source, str(path), path, json.dumps(source))]
    assert all(c == configs[0] for c in configs)


def test_raw_is_a_copy_of_the_source():
    source = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg = parse_config(source)
    source["optimizer"]["params"]["lr"] = 9.0
    assert cfg.raw["optimizer"]["params"]["lr"] == 0.1 and cfg.optimizer.params["lr"] == 0.1


def test_duplicate_keys_in_a_file_are_named(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"fp16": {"enabled": true, "enabled": false}, "train_batch_size": 1}')
    refused(str(path), "enabled", "duplicate keys in")
    refused(str(path), "enabled", "['enabled']")


@pytest.mark.parametrize(
    "text, message",
    [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")],
)
def test_unreadable_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    refused(str(path), "", message)


def test_missing_file():
    refused("/nonexistent/ds_config.json", "", "config file not found: /nonexistent/ds_config.json")


def test_config_error_is_a_value_error_with_the_key():
    error = refused(
        {"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "must be 0, 1, 2 or 3"
    )
    assert isinstance(error, ValueError)


# --- types -------------------------------------------------------------------------------------

# fmt: off
TYPE_ERRORS = [
    ({"train_micro_batch_size_per_gpu": "8"}, "train_micro_batch_size_per_gpu", 'train_micro_batch_size_per_gpu: expected an integer, got the string "8"'),
    ({"train_batch_size": 2.5}, "train_batch_size", "expected an integer, got 2.5 (not a whole number)"),
    ({"train_batch_size": True}, "train_batch_size", "expected an integer, got true"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", 'expected a number, got the string "1.0"'),
    ({"gradient_clipping": float("nan")}, "gradient_clipping", "expected a finite number"),
    ({"gradient_clipping": -1}, "gradient_clipping", "must be >= 0, got -1.0"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled", 'expected true or false, got the string "true"'),
    ({"fp16": {"enabled": 1}}, "fp16.enabled", "expected true or false, got 1"),
    ({"fp16": True}, "fp16", 'expected an object like {"enabled": true}, got true'),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", 'expected an integer, got the string "2"'),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size", "must be >= 0"),
    ({"steps_per_print": 0}, "steps_per_print", "must be >= 1, got 0"),
    ({"seed": "42"}, "seed", 'expected an integer, got the string "42"'),
    ({"tensor_parallel": {"plan": {"*.q": "colwize"}}}, "tensor_parallel.plan.*.q", "did you mean 'colwise'?"),
    ({"tensor_parallel": {"size": 0}}, "tensor_parallel.size", "must be >= 1, got 0"),
    ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule", 'expected one of "1f1b", "gpipe", "interleaved"'),
    ({"pipeline": {"stages": "two"}}, "pipeline.stages", 'expected an integer or "auto", got the string "two"'),
    ({"pipeline": {"stages": 0}}, "pipeline.stages", 'must be >= 1 or "auto", got 0'),
    ({"pipeline": {"schedule": "dualpipev", "overlap_forward_backward": "no"}}, "pipeline.overlap_forward_backward", 'expected true or false, got the string "no"'),
    ({"activation_checkpointing": {"checkpoint_layers": "some"}}, "activation_checkpointing.checkpoint_layers", 'or "all", got the string "some"'),
]
# fmt: on


@pytest.mark.parametrize("source, key, message", TYPE_ERRORS, ids=[k for _, k, _ in TYPE_ERRORS])
def test_wrong_types_are_refused_naming_the_key(source, key, message):
    refused(source, key, message)


@pytest.mark.parametrize(
    "key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
)
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_batch_values_are_refused(key, value):
    refused({key: value}, key, f"{key}: must be >= 1, got {value}")


def test_integral_floats_are_integers():
    zero = parse_config({"zero_optimization": {"reduce_bucket_size": 2e8, "sub_group_size": 1e14}})
    assert zero.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(zero.zero_optimization.sub_group_size) is int


# fmt: off
OUR_BLOCKS = {
    "tensor_parallel": {"size": 2, "plan": {"*.wq": "colwise", "*.wo": "rowwise", "tok": "vocab"}},
    "pipeline": {"stages": "auto", "partition_method": "type:Block", "schedule": "gpipe"},
    "activation_checkpointing": {"checkpoint_layers": ["blocks.0", 3], "number_checkpoints": 2},
}
# fmt: on


def test_our_blocks_accept_their_documented_values():
    cfg = parse_config(OUR_BLOCKS)
    assert cfg.tensor_parallel.plan["*.wo"] == "rowwise" and cfg.pipeline.partition == "type:Block"
    assert cfg.pipeline.stages == "auto"
    assert cfg.activation_checkpointing.checkpoint_layers == ["blocks.0", 3]


# --- unknown, ignored and unsupported keys -------------------------------------------------------

# fmt: off
UNKNOWN = [
    ({"grandient_accumulation_steps": 1}, "grandient_accumulation_steps", "unknown key 'grandient_accumulation_steps'; did you mean 'gradient_accumulation_steps'?"),
    ({"zero_optimization": {"stage3_param_persitance_threshold": 1}}, "zero_optimization.stage3_param_persitance_threshold", "unknown key 'zero_optimization.stage3_param_persitance_threshold'; did you mean 'stage3_param_persistence_threshold'?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}, "zero_optimization.offload_param.pin_memroy", "did you mean 'pin_memory'?"),
    ({"fp16": {"loss_scale_windows": 10}}, "fp16.loss_scale_windows", "did you mean 'loss_scale_window'?"),
    ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "did you mean 'params'?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}}}, "scheduler.params.warmup_max_lrr", "unknown key 'scheduler.params.warmup_max_lrr' for WarmupLR; did you mean 'warmup_max_lr'?"),
    ({"activation_checkpointing": {"partition_activation": True}}, "activation_checkpointing.partition_activation", "did you mean 'partition_activations'?"),
    ({"cuda_visible_devices": 0}, "cuda_visible_devices", "DeepSpeed silently ignores unknown top-level keys"),
]
# fmt: on


@pytest.mark.parametrize("source, key, message", UNKNOWN, ids=[k for _, k, _ in UNKNOWN])
def test_unknown_keys_are_refused_at_every_level(source, key, message):
    refused(source, key, message)


def test_a_key_with_no_close_match_gets_no_guess():
    error = refused({"cuda_visible_devices": 0}, "cuda_visible_devices", "unknown key")
    assert "did you mean" not in str(error)


def test_ignored_keys_are_accepted_with_one_warning_listing_them():
    source = {
        "timers": {"throughput": {"enabled": True}},
        "sparse_gradients": True,
        "dump_state": 0,
    }
    with pytest.warns(ConfigWarning) as record:
        cfg = parse_config(source)
    ignored = [str(w.message) for w in record if "ignores" in str(w.message)]
    assert len(ignored) == 1 and all(key in ignored[0] for key in source), ignored
    assert cfg.ignored == source


MONITORS = {  # DeepSpeed's monitoring keys are read now (shardwise/monitor/), typed as DeepSpeed's
    "wall_clock_breakdown": (True, "wall_clock_breakdown", True),
    "memory_breakdown": (True, "memory_breakdown", True),
    "flops_profiler": ({"enabled": True, "module_depth": 2}, "flops_profiler.module_depth", 2),
    "comms_logger": ({"enabled": True, "prof_ops": ["all_reduce"]}, "comms_logger.prof_all", True),
    "wandb": ({"enabled": False, "team": "t"}, "wandb.project", "deepspeed"),
    "comet": ({"samples_log_interval": 10}, "comet.samples_log_interval", 10),
}


@pytest.mark.parametrize("key", sorted(MONITORS))
def test_monitoring_keys_are_read_not_ignored(key):
    value, path, want = MONITORS[key]
    cfg = parse_config({key: value})
    assert key not in IGNORED and key not in cfg.ignored, key
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    assert node == want, f"{path}: {node!r}"


def test_an_unknown_collective_in_prof_ops_is_refused_naming_the_known_ones():
    refused({"comms_logger": {"prof_ops": ["allreduce"]}}, "comms_logger.prof_ops[0]", "all_reduce")


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_every_ignored_key_is_accepted(key):
    assert key in parse_quietly({key: True}).ignored


@pytest.mark.parametrize("key", sorted(UNSUPPORTED))
def test_unsupported_features_are_refused_unless_disabled(key):
    refused({key: {"enabled": True}}, key, "shardwise does not support it")
    assert key in parse_quietly({key: {"enabled": False}}).ignored


def test_sparse_attention_is_refused_as_gpu_only():
    refused({"sparse_attention": {"mode": "fixed", "block": 16}}, "sparse_attention", "GPU-only")


# --- precision -------------------------------------------------------------------------------------


def test_fp16_and_bf16_cannot_both_be_enabled():
    both = {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
    refused(both, "fp16.enabled", "cannot both be enabled")


def test_legacy_bfloat16_key_is_bf16_with_a_warning():
    with pytest.warns(ConfigWarning, match="bfloat16 -> bf16"):
        assert parse_config({"bfloat16": {"enabled": True}}).bf16.enabled
    refused({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16", "not both")


def test_fp16_loss_scale_keys_in_a_bf16_block_are_ignored_with_a_warning():
    with pytest.warns(ConfigWarning, match="bf16.loss_scale_window"):
        assert parse_config({"bf16": {"enabled": True, "loss_scale_window": 500}}).bf16.enabled


STAGE_2_ONLY = "only supported with ZeRO stage 2"


@pytest.mark.parametrize(
    "zero, refusal",
    [
        ({"stage": 0}, STAGE_2_ONLY),
        ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, STAGE_2_ONLY),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, None),
        ({"stage": 2}, "needs ZeRO-Offload"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, STAGE_2_ONLY),
    ],
)
def test_fp16_master_weights_and_grads_needs_zero_stage_2_with_offload(zero, refusal):
    fp16 = {"enabled": True, "fp16_master_weights_and_grads": True}
    source = {"fp16": fp16, "zero_optimization": zero}
    if refusal is None:
        assert parse_config(source).fp16.fp16_master_weights_and_grads
    else:
        refused(source, "fp16.fp16_master_weights_and_grads", refusal)


@pytest.mark.parametrize(
    "fp16, scale", [({"initial_scale_power": 11}, 2048.0), ({"loss_scale": 128}, 128.0)]
)
def test_first_loss_scale_is_two_to_the_initial_scale_power_or_the_static_scale(fp16, scale):
    assert parse_config({"fp16": {"enabled": True, **fp16}}).fp16.initial_scale == scale


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", None])
def test_communication_data_types(dtype):
    assert parse_config({"communication_data_type": dtype}).communication_data_type == dtype


def test_bad_communication_data_type_lists_the_valid_ones():
    message = 'expected one of "fp16", "bf16", "fp32", got the string "bfp16"'
    refused({"communication_data_type": "bfp16"}, "communication_data_type", message)


# --- ZeRO ------------------------------------------------------------------------------------------

# fmt: off
ZERO_ERRORS = [
    ({"stage": 4}, "zero_optimization.stage", "must be 0, 1, 2 or 3, got 4"),
    ({"stage": -1}, "zero_optimization.stage", "must be 0, 1, 2 or 3, got -1"),
    ({"stage": 2, "offload_optimizer": "cpu"}, "zero_optimization.offload_optimizer", 'must be an object like {"device": "cpu"}, got the string "cpu"'),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "zero_optimization.offload_param.device", '"nvme" (ZeRO-Infinity) is not supported'),
    ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device", 'expected one of "cpu", "none", "nvme"'),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "zero_optimization.offload_optimizer.ratio", "only supported with ZeRO stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "zero_optimization.offload_param", "needs ZeRO stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.cpu_offload", "not both"),
    ({"stage": 3, "zero_quantized_nontrainable_weights": True}, "zero_optimization.zero_quantized_nontrainable_weights", "not supported by shardwise"),
    ({"stage": 2, "zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights", 'needs "stage": 3 (stage is 2)'),
    ({"stage": 1, "zero_quantized_gradients": True}, "zero_optimization.zero_quantized_gradients", "ZeRO stage 2 or 3 (stage is 1)"),
]
# fmt: on


@pytest.mark.parametrize("zero, key, message", ZERO_ERRORS, ids=[str(z) for z, _, _ in ZERO_ERRORS])
def test_zero_errors(zero, key, message):
    refused({"zero_optimization": zero}, key, message)


def test_offload_to_cpu_and_to_none():
    offloads = {
        "offload_optimizer": {"device": "cpu", "ratio": 0.3},
        "offload_param": {"device": "none"},
    }
    zero = parse_config({"zero_optimization": {"stage": 3, **offloads}}).zero_optimization
    assert isinstance(zero.offload_optimizer, OffloadConfig) and zero.offload_optimizer.ratio == 0.3
    assert zero.offload_param is None, '"device": "none" means no offload'


# fmt: off
DEPRECATED = [  # (zero_optimization, attribute, its type afterwards, warning text)
    ({"stage": 2, "cpu_offload": True}, "offload_optimizer", OffloadConfig, "cpu_offload"),
    # false must read as "no offload", not as the true case's rewrite (it did, issue 14)
    ({"stage": 2, "cpu_offload": False}, "offload_optimizer", type(None), r"cpu_offload: false means offload_optimizer: absent \(no offload\)"),
    ({"stage": 3, "cpu_offload_param": True}, "offload_param", OffloadConfig, "cpu_offload_param"),
    ({"stage3_gather_fp16_weights_on_model_save": True}, "stage3_gather_16bit_weights_on_model_save", bool, "stage3_gather_fp16"),
]
# fmt: on


@pytest.mark.parametrize(
    "zero, attribute, kind, warning", DEPRECATED, ids=[w for *_, w in DEPRECATED]
)
def test_deprecated_zero_keys_still_work_with_a_warning(zero, attribute, kind, warning):
    with pytest.warns(ConfigWarning, match=warning):
        cfg = parse_config({"zero_optimization": zero})
    assert isinstance(getattr(cfg.zero_optimization, attribute), kind)


def test_old_boolean_zero_optimization_means_stage_1():
    with pytest.warns(ConfigWarning, match="zero_optimization"):
        assert parse_config({"zero_optimization": True}).zero_optimization.stage == 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipeline_refuses_zero_3(stage):
    # DeepSpeed also refuses stage 2; shardwise runs it (tests/test_pipe_equivalence.py).
    source = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": stage}}
    if stage < 3:
        assert parse_config(source).pipeline.stages == 2
    else:
        refused(source, "zero_optimization.stage", "incompatible with pipeline parallelism")


# fmt: off
PARTITIONS = [
    ({"partition": "parameters", "partition_method": "uniform"}, "pipeline.partition_method", "not both"),
    ({"partition": "type:[oops"}, "pipeline.partition", "invalid regular expression"),
    ({"partition": "profile"}, "pipeline.partition", "not implemented"),
    ({"partition": "balanced"}, "pipeline.partition", '"parameters", "uniform", "best" or "type:<regex>"'),
]
# fmt: on


@pytest.mark.parametrize("pipeline, key, message", PARTITIONS, ids=[m for *_, m in PARTITIONS])
def test_pipeline_partition_methods(pipeline, key, message):
    refused({"pipeline": pipeline}, key, message)


# (schedule, value given, value parsed or None when refused naming the key)
OVERLAP = [
    ("dualpipev", True, True),
    ("dualpipev", False, False),
    ("dualpipev", "auto", True),  # "auto" is the default, as for any key
    ("1f1b", True, None),
    ("zbv", False, None),  # the other V schedule has no F&B steps either
    ("zb-h1", True, None),
    ("interleaved", "auto", True),
]


@pytest.mark.parametrize(
    "schedule, value, parsed", OVERLAP, ids=[f"{s}-{v}" for s, v, _ in OVERLAP]
)
def test_overlap_forward_backward_is_dualpipevs_alone(schedule, value, parsed):
    source = {"pipeline": {"schedule": schedule, "overlap_forward_backward": value}}
    if parsed is None:
        refused(source, "pipeline.overlap_forward_backward", 'set "schedule": "dualpipev"')
    else:
        got = parse_quietly(source).pipeline.overlap_forward_backward
        assert got is parsed, f"{schedule} with {value!r}: parsed {got!r}"


# --- checkpoint -------------------------------------------------------------------------------------

# fmt: off
CHECKPOINT_ERRORS = [
    ({"keep_last": 0}, "checkpoint.keep_last", "must be >= 1"),
    ({"tag_validation": "Strict"}, "checkpoint.tag_validation", '"Warn", "Ignore" or "Fail"'),
    ({"use_node_local_storage": True}, "checkpoint.use_node_local_storage", "one file system"),
    ({"writer": {"type": "fast", "decoupled": True}}, "checkpoint.writer", "not supported"),
    ({"parallel_write": {"pipeline_stages": True}}, "checkpoint.parallel_write.pipeline_stages", "did you mean"),
    ({"save_interval_steps": 100}, "checkpoint.save_interval_steps", 'needs checkpoint.save_dir, the directory to save into and resume from, e.g. "checkpoint": {"save_dir": "checkpoints", "save_interval_steps": 100}'),
    ({"auto_resume": True}, "checkpoint.auto_resume", '"auto_resume": true}'),
    ({"save_dir": "ckpts", "save_interval_steps": 0}, "checkpoint.save_interval_steps", "must be >= 1"),
    ({"save_dir": "  "}, "checkpoint.save_dir", "is empty"),
    ({"save_dir": 3}, "checkpoint.save_dir", "expected a string"),
]
# fmt: on


@pytest.mark.parametrize(
    "block, key, message", CHECKPOINT_ERRORS, ids=[k for _, k, _ in CHECKPOINT_ERRORS]
)
def test_checkpoint_block_refuses_what_cannot_work(block, key, message):
    refused({"checkpoint": block}, key, message)


def test_checkpoint_block_takes_deepspeeds_keys():
    """DeepSpeed's spellings (any case for tag_validation); keys with no effect are accepted."""
    block = {"tag_validation": "fail", "load_universal": True, "use_node_local_storage": False,
             "parallel_write": {"pipeline_stage": True}, "keep_last": 3}  # fmt: skip
    got = parse_config({"checkpoint": block}).checkpoint
    assert (got.tag_validation, got.keep_last, got.load_universal) == ("Fail", 3, True)
    with pytest.warns(ConfigWarning, match="checkpoint.checkpoint_serialization"):
        parse_config({"checkpoint": {"checkpoint_serialization": False}})


# --- "auto" ------------------------------------------------------------------------------------------


def test_auto_outside_optimizer_and_scheduler_params_means_the_default():
    zero = {"stage": 3, "reduce_bucket_size": "auto"}
    source = {"gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "zero_optimization": zero}
    with pytest.warns(ConfigWarning, match="gradient_clipping") as record:
        cfg = parse_config(source)
    assert (cfg.gradient_clipping, cfg.fp16.enabled) == (0.0, False)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert sum("auto" in str(w.message) for w in record) == 1, "one warning for all of them"


def test_with_values_fills_in_auto():
    optimizer = {"type": "AdamW", "params": {"lr": "auto"}}
    cfg = parse_quietly({"train_micro_batch_size_per_gpu": "auto", "optimizer": optimizer})
    filled = cfg.with_values({"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 3e-4})
    assert filled.resolve_batch(2) == BatchSizes(8, 4, 1) and filled.optimizer.params["lr"] == 3e-4


# --- code and docs budgets ---------------------------------------------------------------------------


def test_docs_name_every_key():
    docs = (REPO / "docs" / "config.md").read_text()
    blocks = [c for c in vars(shardwise.config).values() if dataclasses.is_dataclass(c)]
    blocks.remove(BatchSizes)  # a result, not a block of keys
    assert len(blocks) == 17, [b.__name__ for b in blocks]
    keys = {k for b in blocks for k in schema_keys(b)} | set(IGNORED) | set(UNSUPPORTED)
    missing = sorted(k for k in keys if f"`{k}`" not in docs)
    assert not missing, f"docs/config.md does not mention: {missing}"
