"""Batch arithmetic, and the real DeepSpeed configs in shared/reference: what shardwise accepts,
resolves and refuses.

The folder sits beside the repository (``REPO.parent / "shared"``), in CI as on the dev machine.
Policy tested here (docs/config.md): every valid reference config parses, except three that name
something shardwise refuses on purpose: an unknown top-level key (DeepSpeed ignores those, which
hid a real typo) or a GPU-only feature. The batch sizes match DeepSpeed's wherever DeepSpeed gets
a result, and wherever it fails shardwise raises ConfigError with the same arithmetic.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch

from shardwise.config import BatchSizes, ConfigError, ConfigWarning, parse_config
from shardwise.lr_schedules import build_scheduler
from shardwise.ops.adam import FusedAdam
from shardwise.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO.parent / "shared" / "reference" / "deepspeed-configs"
needs_reference = pytest.mark.skipif(
    not CONFIGS.is_dir(),
    reason=f"the reference configs are not at {CONFIGS} (shared/ beside the repo)",
)
pytestmark = [
    pytest.mark.filterwarnings("ignore::shardwise.config.ConfigWarning"),
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`"),
]

WORLD_SIZES = ("1", "2", "3", "4", "8")
# Refused on purpose: file -> (key named, text of the error).
REFUSED = {
    "ds_unit_pipe_seed_layers_ckpt.json": (
        "grandient_accumulation_steps",
        "did you mean 'gradient_accumulation_steps'?",
    ),
    "dse_imagenet_fp16_zero1.json": ("cuda_visible_devices", "unknown key 'cuda_visible_devices'"),
    "dse_bing_bert_lamb_bsz64k.json": ("sparse_attention", "GPU-only"),
}


def fixed(raw: dict, name: str) -> dict:
    """The config after the fix its refusal asks for (used to check its batch sizes)."""
    raw = dict(raw)
    if name == "ds_unit_pipe_seed_layers_ckpt.json":
        raw["gradient_accumulation_steps"] = raw.pop("grandient_accumulation_steps")
    elif name in REFUSED:
        raw.pop(REFUSED[name][0])
    return raw


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def parse(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return parse_config(source)


def valid_names() -> list[str]:
    if not CONFIGS.is_dir():
        return []
    return sorted(
        p.name for p in CONFIGS.glob("*.json") if p.name != "expected_batch_resolution.json"
    )


def expected_batches() -> dict:
    return (
        json.loads((CONFIGS / "expected_batch_resolution.json").read_text())
        if CONFIGS.is_dir()
        else {}
    )


# --- batch arithmetic: a synthetic table (runs without the reference folder) ----------------------

# fmt: off
BATCH = [  # (tb, mb, gas, W) -> (tb, mb, gas) or an error substring
    ((32, 4, 2, 4), (32, 4, 2)),
    ((32, 4, None, 4), (32, 4, 2)),
    ((32, None, 2, 4), (32, 4, 2)),
    ((None, 4, 2, 4), (32, 4, 2)),
    ((32, None, None, 4), (32, 8, 1)),
    ((None, 4, None, 4), (16, 4, 1)),
    ((24, 3, 3, 2), "train_batch_size 24 != train_micro_batch_size_per_gpu 3 * gradient_accumulation_steps 3 * data-parallel size 2 (= 18)"),
    ((24, 3, None, 3), "24 != 3 * 2 * 3"),
    ((24, None, 5, 2), "train_batch_size 24 is not a multiple of gradient_accumulation_steps 5 * data-parallel size 2 (= 10)"),
    ((4, None, None, 8), "Micro batch size per gpu: 0 has to be greater than 0"),
    ((4, 8, None, 1), "Gradient accumulation steps: 0 has to be greater than 0"),
    ((None, None, 4, 2), "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
]
# fmt: on


@pytest.mark.parametrize("given, expected", BATCH, ids=[str(g) for g, _ in BATCH])
def test_batch_resolution(given, expected):
    tb, mb, gas, world = given
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cfg = parse_config({k: v for k, v in zip(keys, (tb, mb, gas), strict=True) if v is not None})
    if isinstance(expected, tuple):
        assert cfg.resolve_batch(world) == BatchSizes(*expected), f"{given}"
    else:
        with pytest.raises(ConfigError) as info:
            cfg.resolve_batch(world)
        assert expected in str(info.value), f"{given}: {str(info.value)!r}"
        assert "Fix:" in str(info.value) or "needs to be provided" in str(info.value)


def test_dp_world_size_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="dp_world_size"):
        parse_config({"train_batch_size": 8}).resolve_batch(0)


# --- the reference configs ----------------------------------------------------------------------


@needs_reference
def test_there_are_19_valid_configs_and_each_has_expected_batches():
    assert len(valid_names()) == 19
    assert set(valid_names()) == set(expected_batches()) - {"_doc"}


@needs_reference
@pytest.mark.parametrize("name", [n for n in valid_names() if n not in REFUSED])
def test_valid_config_is_accepted(name):
    cfg = parse(str(CONFIGS / name))
    assert cfg.raw == load(name), name


@needs_reference
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_config_with_a_refused_key_is_refused_naming_it(name):
    key, text = REFUSED[name]
    with pytest.raises(ConfigError) as info:
        parse(str(CONFIGS / name))
    assert info.value.key == key and text in str(info.value), f"{name}: {info.value}"
    parse(fixed(load(name), name))  # and the fix the message asks for is enough


BATCH_CASES = [
    (name, world, outcome)
    for name, by_world in expected_batches().items()
    if name != "_doc" and by_world != "auto"
    for world, outcome in by_world.items()
]


@needs_reference
@pytest.mark.parametrize(
    "name, world, outcome", BATCH_CASES, ids=[f"{n}-W{w}" for n, w, _ in BATCH_CASES]
)
def test_batch_sizes_match_deepspeed(name, world, outcome):
    cfg = parse(fixed(load(name), name))
    if isinstance(outcome, dict):
        expected = BatchSizes(*outcome.values())
        assert cfg.resolve_batch(int(world)) == expected, f"{name} at W={world}"
        return
    with pytest.raises(ConfigError) as info:
        cfg.resolve_batch(int(world))
    deepspeed_says = outcome.removeprefix("error: ")
    assert deepspeed_says.lower() in str(info.value).lower(), f"{name} at W={world}: {info.value}"


@needs_reference
def test_pipeline_config_uses_the_data_parallel_size():
    """2 ranks as 2 pipeline stages: W = 1 data-parallel rank, so 32 micro-batches per train_batch()."""
    cfg = parse(str(CONFIGS / "dse_pipeline_parallelism.json"))
    assert cfg.resolve_batch(dp_world_size=1) == BatchSizes(256, 8, 32)


AUTO_NAMES = sorted(n for n, v in expected_batches().items() if v == "auto")


@needs_reference
@pytest.mark.parametrize("name", AUTO_NAMES)
def test_auto_batch_sizes_are_refused_until_filled_in(name):
    cfg = parse(str(CONFIGS / name))
    for world in map(int, WORLD_SIZES):
        with pytest.raises(ConfigError, match='"auto"'):
            cfg.resolve_batch(world)
    filled = cfg.with_values({"train_micro_batch_size_per_gpu": 2})
    gas = filled.gradient_accumulation_steps or 1
    assert filled.resolve_batch(4) == BatchSizes(2 * gas * 4, 2, gas), name


HF_WITH_OPTIMIZER = [n for n in AUTO_NAMES if "optimizer" in load(n)]


@needs_reference
def test_every_hf_and_accelerate_config_is_covered():
    assert [n.split("_")[0] for n in HF_WITH_OPTIMIZER] == ["accelerate"] * 2 + ["hf"] * 3, (
        HF_WITH_OPTIMIZER
    )


@needs_reference
@pytest.mark.parametrize("name", HF_WITH_OPTIMIZER)
def test_hf_auto_policy_end_to_end(name):
    raw, cfg = load(name), parse(str(CONFIGS / name))
    assert cfg.gradient_clipping == 0.0, '"auto" gradient_clipping -> 0.0 (off)'
    if raw["zero_optimization"].get("reduce_bucket_size") == "auto":
        assert cfg.zero_optimization.reduce_bucket_size == 500_000_000, '"auto" -> the default'
    if raw.get("fp16", {}).get("enabled") == "auto":
        assert not cfg.fp16.enabled, '"auto" fp16.enabled -> false'
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ConfigError, match="needs a value") as info:
        build_optimizer(cfg.optimizer, params)
    assert info.value.key == "optimizer.params.lr"
    cfg = cfg.with_values({"optimizer.params.lr": 3e-4})
    optimizer = build_optimizer(cfg.optimizer, params)
    group = optimizer.param_groups[0]
    assert type(optimizer) is torch.optim.AdamW and group["lr"] == 3e-4
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8 and group["weight_decay"] == 0.0
    with pytest.raises(ConfigError) as info:
        build_scheduler(cfg.scheduler, optimizer)
    assert info.value.key == "scheduler.params.warmup_num_steps", "no meaningful default for it"
    steps = {"scheduler.params.warmup_num_steps": 10}
    if cfg.scheduler.type == "WarmupDecayLR":
        steps["scheduler.params.total_num_steps"] = 100
    scheduler = build_scheduler(cfg.with_values(steps).scheduler, optimizer)
    assert group["lr"] == 0.0, '"auto" warmup_min_lr is 0'
    for _ in range(11):
        scheduler.step()
    assert group["lr"] == pytest.approx(3e-4), '"auto" warmup_max_lr is the optimizer lr'


OPTIMIZER_OUTCOMES = {  # config -> torch class, or the text of the build-time refusal
    "ds_tests_torch_compile_zero3_bf16.json": torch.optim.AdamW,
    "ds_unit_pipe_seed_layers_ckpt.json": torch.optim.AdamW,
    "dse_cifar_zero2_fp16_cpu_offload.json": torch.optim.AdamW,
    "dse_imagenet_fp16_zero1.json": torch.optim.AdamW,
    "dse_megatron_zero3_act_ckpt.json": torch.optim.AdamW,
    "dse_pipeline_parallelism.json": torch.optim.AdamW,
    "hf_transformers_zero3_fp16_explicit.json": torch.optim.AdamW,
    "dse_bing_bert_lamb_bsz64k.json": "'Lamb' is not supported by shardwise",
    "dse_bingbertsquad_bsz24.json": FusedAdam,  # bias_correction: false
}


@needs_reference
@pytest.mark.parametrize("name, outcome", sorted(OPTIMIZER_OUTCOMES.items(), key=str))
def test_reference_optimizers_build_or_are_refused_clearly(name, outcome):
    cfg = parse(fixed(load(name), name))
    params = [torch.nn.Parameter(torch.ones(3))]
    if isinstance(outcome, str):
        with pytest.raises(ConfigError, match=outcome):
            build_optimizer(cfg.optimizer, params)
    else:
        assert type(build_optimizer(cfg.optimizer, params)) is outcome, name


# --- the 12 invalid configs ------------------------------------------------------------------------

INVALID = {  # file -> (where it fails, key named, text of the error)
    "derived_batch_mismatch.json": ("resolve", "train_batch_size", "24 != 3 * 3 * 2"),
    "derived_duplicate_key.json": ("parse", "train_batch_size", "duplicate keys in"),
    "derived_fp16_and_bf16.json": (
        "parse",
        "fp16.enabled",
        "bfloat16 and fp16 modes cannot be simultaneously enabled",
    ),
    "derived_fp16_master_weights_stage1.json": (
        "parse",
        "fp16.fp16_master_weights_and_grads",
        "only supported with ZeRO stage 2",
    ),
    "derived_max_grad_norm_in_optimizer.json": (
        "parse",
        "optimizer.params.max_grad_norm",
        "'max_grad_norm' is not supported as an optimizer parameter",
    ),
    "derived_negative_lr.json": ("parse", "optimizer.params.lr", "must be > 0, got -0.001"),
    "derived_wrong_type_micro_batch_string.json": (
        "parse",
        "train_micro_batch_size_per_gpu",
        'expected an integer, got the string "8"',
    ),
    "derived_wrong_type_offload_string.json": (
        "parse",
        "zero_optimization.offload_optimizer",
        'must be an object like {"device": "cpu"}',
    ),
    "derived_zero_stage4.json": ("parse", "zero_optimization.stage", "must be 0, 1, 2 or 3, got 4"),
    "wild_dse_megatron_zero3_typo_key.json": (
        "parse",
        "zero_optimization.stage3_param_persitance_threshold",
        "did you mean 'stage3_param_persistence_threshold'?",
    ),
    "wild_dse_zero_infinity_nvme_typo_key.json": (
        "parse",
        "zero_optimization.stage3_param_persitence_threshold",
        "did you mean 'stage3_param_persistence_threshold'?",
    ),
    "wild_megatron_ds_zero2_bf16_bad_comm_dtype.json": (
        "parse",
        "communication_data_type",
        'expected one of "fp16", "bf16", "fp32", got the string "bfp16"',
    ),
}


@needs_reference
def test_every_invalid_config_is_in_the_table():
    expected = json.loads((CONFIGS / "invalid" / "expected_errors.json").read_text())
    assert (
        set(INVALID)
        == set(expected) - {"_doc"}
        == {p.name for p in (CONFIGS / "invalid").glob("*.json")} - {"expected_errors.json"}
    )


@needs_reference
@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_config_is_refused_naming_the_key(name):
    stage, key, text = INVALID[name]
    world = json.loads((CONFIGS / "invalid" / "expected_errors.json").read_text())[name][
        "world_size"
    ]
    with pytest.raises(ConfigError) as info:
        cfg = parse(str(CONFIGS / "invalid" / name))
        assert stage == "resolve", f"{name} should fail at parse time"
        cfg.resolve_batch(world)
    assert info.value.key == key, f"{name}: names {info.value.key!r}"
    assert text in str(info.value), f"{name}: {info.value}"


@needs_reference
def test_nvme_offload_is_refused_once_the_typo_is_fixed():
    raw = json.loads(
        (CONFIGS / "invalid" / "wild_dse_zero_infinity_nvme_typo_key.json").read_text()
    )
    zero = raw["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = zero.pop("stage3_param_persitence_threshold")
    with pytest.raises(ConfigError, match="nvme") as info:
        parse(raw)
    assert info.value.key == "zero_optimization.offload_optimizer.device"
