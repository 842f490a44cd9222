"""``deepspeed.DeepSpeedConfig`` (``shardwise.config.deepspeed_view``) against DeepSpeed 0.19's own
class on the real configs of shared/reference: the attributes scripts read are equal, at one
process and at two; under tensor parallelism the data-parallel size is the layout's (the
documented difference).
"""

from __future__ import annotations

import json
import warnings

import pytest
from harness import run_distributed
from test_config_reference import CONFIGS, REFUSED, expected_batches, fixed, load, valid_names

import shardwise as deepspeed  # the import a ported script changes
from shardwise.config import ConfigWarning
from shardwise.runtime.config import DeepSpeedConfig as RuntimeDeepSpeedConfig

ds_config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed 0.19 (make dev)")
SAME = (  # read the same way on both
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization_stage",
    "zero_enabled",
    "optimizer_name",
    "optimizer_params",
    "scheduler_name",
    "scheduler_params",
    "world_size",
    "global_rank",
)
GIVEN = ("gradient_clipping", "steps_per_print")  # equal where the config gives the key
# Configs the DeepSpeed of their time read and 0.19.8's pydantic models refuse; shardwise reads
# them as the older releases did (test_config_reference.py: each reference config parses).
DEEPSPEED_019_REFUSES = {
    "ds_tests_torch_compile_zero3_bf16.json": "loss_scale",  # fp16's keys left in the bf16 block
    "hf_transformers_zero3_fp16_explicit.json": "reduce_bucket_size",  # 0: now must be > 0
}


def _comparable() -> list[str]:
    batches = expected_batches()
    return [n for n in valid_names() if batches.get(n) != "auto" and n not in REFUSED]


def _ours(raw: dict, cls=deepspeed.DeepSpeedConfig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return cls(raw)


@pytest.mark.skipif(not CONFIGS.is_dir(), reason=f"{CONFIGS} missing")
@pytest.mark.parametrize("name", _comparable())
def test_the_attributes_scripts_read_are_deepspeeds(name):
    raw = fixed(load(name), name)
    if name in DEEPSPEED_019_REFUSES:  # the reference-config test parses them
        with pytest.raises(ValueError, match=DEEPSPEED_019_REFUSES[name]):
            ds_config.DeepSpeedConfig(json.loads(json.dumps(raw)))
        return
    theirs, ours = ds_config.DeepSpeedConfig(json.loads(json.dumps(raw))), _ours(raw)
    for attr in SAME + tuple(k for k in GIVEN if k in raw):
        assert getattr(ours, attr) == getattr(theirs, attr), f"{name}: {attr}"
    assert ours.fp16_enabled == theirs.float16_config.enabled, f"{name}: fp16"
    assert ours.bfloat16_enabled == theirs.bfloat16_config.enabled, f"{name}: bf16"


def test_both_paths_and_a_missing_attribute_names_itself():
    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    assert (
        _ours(raw).gradient_accumulation_steps,
        _ours(raw, RuntimeDeepSpeedConfig).train_batch_size,
    ) == (4, 8)
    with pytest.raises(AttributeError, match=r"DeepSpeedConfig.hybrid_engine is not provided"):
        _ours(raw).hybrid_engine  # noqa: B018 - the access is the test
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="train_batch_size") as err:
        _ours({"train_batch_size": 0})
    assert err.value.key == "train_batch_size"


def _sizes() -> list[tuple[int, int]]:
    out = []
    for tp in (1, 2):
        raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
        c = _ours({**raw, "tensor_parallel": {"size": tp}})
        out.append((c.world_size, c.gradient_accumulation_steps))
    return out


def test_on_two_processes_the_data_parallel_size_is_the_layouts():
    for rank, sizes in enumerate(run_distributed(_sizes, 2)):
        assert sizes[0] == (2, 2), f"dp2, rank {rank}: W = the world, as DeepSpeed"
        assert sizes[1] == (1, 4), f"tp2, rank {rank}: W = world / tensor_parallel.size"
