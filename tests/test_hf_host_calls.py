"""What the Hugging Face Trainer, transformers and Accelerate call on ``deepspeed``, checked
without processes (the runs through the shim are tests/test_hf_trainer.py's): each value as
DeepSpeed 0.19 gives it, or as docs/hf-trainer.md says it differs."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from shardwise.checkpoint.utils import clone_tensors_for_torch_save
from shardwise.config import parse_config
from shardwise.runtime import lr_schedules
from shardwise.runtime.zero import partition_parameters as pp


@pytest.mark.parametrize(
    ("given", "expected"),
    [(math.inf, sys.maxsize), (5, 5)],
    ids=["accelerate's inf reads as never", "an integer stays"],
)
def test_steps_per_print(given, expected):
    assert parse_config({"steps_per_print": given}).steps_per_print == expected, given


def test_config_get_reads_the_source_dict_as_the_trainer_does():
    cfg = parse_config({"zero_optimization": {"stage": 3}, "train_batch_size": 8})
    assert cfg.get("zero_optimization", {}).get("stage") == 3
    assert cfg.get("tensor_parallel", {}).get("autotp_size", 1) == 1, "an absent key: the default"


def test_valid_lr_schedules_names_deepspeeds_schedules():
    # Accelerate: type(scheduler).__name__ in VALID_LR_SCHEDULES decides who steps it
    names = {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    assert set(lr_schedules.VALID_LR_SCHEDULES) == names
    assert all(hasattr(lr_schedules, n) for n in names)
    assert type(torch.optim.lr_scheduler.LambdaLR).__name__ not in names


def test_clone_tensors_for_torch_save_copies_every_tensor_it_holds():
    base = torch.arange(10.0)
    item = {"a": base[:2], "nested": [base[2:4], (base[4:6], 7)], "name": "x"}
    out = clone_tensors_for_torch_save(item)
    assert out["a"].untyped_storage().nbytes() == 2 * 4, "a view's clone holds only its elements"
    assert torch.equal(out["nested"][1][0], base[4:6]) and out["nested"][1][1] == 7
    assert isinstance(out["nested"][1], tuple) and out["name"] == "x"
    out["a"][0] = 99.0
    assert base[0] == 0.0, "a clone, not a view"


def test_the_constructor_hook_transformers_swaps_changes_nothing():
    # transformers' prevent_arange_dtype_change wraps it and compares with _orig_torch_arange
    assert pp._orig_torch_arange is torch.arange
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.float16) is torch.arange
