"""What ShardwiseStrategy writes into the shardwise config from the Trainer, and what of
Lightning's checkpoint dict it keeps (integrations/lightning/config.py); no process."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip(
    "lightning", reason="lightning is not installed (pip install shardwise[lightning])"
)

from shardwise.integrations.lightning.config import engine_config, storable  # noqa: E402
from shardwise.integrations.lightning.precision import ShardwisePrecision  # noqa: E402
from shardwise.integrations.lightning.strategy import ShardwiseStrategy  # noqa: E402


def _cfg(config=None, accumulate=1, clip=None, algorithm=None, precision="32-true", batch=None):
    return engine_config(config, accumulate, clip, algorithm, precision, batch)


def test_the_trainer_fills_accumulation_clipping_precision_and_the_micro_batch():
    cfg = _cfg({"zero_optimization": {"stage": 2}}, 4, 1.0, "norm", "bf16-mixed", 16)
    assert cfg == {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "checkpoint": {"keep_last": 1},
        "train_micro_batch_size_per_gpu": 16,
    }
    assert _cfg()["gradient_clipping"] == 0.0, "no clip_val: the Trainer's default, no clipping"
    assert _cfg({"train_batch_size": 32})["train_batch_size"] == 32, "a batch size given is kept"
    assert _cfg(precision="16-mixed")["fp16"] == {"enabled": True}


def test_a_config_that_disagrees_with_the_trainer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 disagrees with Trainer"):
        _cfg({"gradient_accumulation_steps": 2}, accumulate=1)
    with pytest.raises(ValueError, match="choose one 16-bit format"):
        _cfg({"fp16": {"enabled": True}}, precision="bf16-mixed")
    with pytest.raises(ValueError, match="only 'norm'"):
        _cfg(clip=0.5, algorithm="value")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto"}))
    assert _cfg(str(path), accumulate=3)["gradient_accumulation_steps"] == 3
    with pytest.raises(ValueError, match="takes a dict or a JSON path"):
        _cfg(42)
    with pytest.raises(ValueError, match="not supported by ShardwiseStrategy"):
        ShardwisePrecision("64-true")


PIPELINES = {  # name: (the config's pipeline block, refused)
    "2 stages": ({"stages": 2}, True),
    "4 stages, 1f1b schedule": ({"stages": 4, "schedule": "1f1b"}, True),
    "1 stage: no pipeline": ({"stages": 1}, False),
    "auto: a PipelineModule's own count, none here": ({"stages": "auto"}, False),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_pipeline_config_is_refused_when_the_strategy_is_made(tmp_path, name):
    """A LightningModule is not a PipelineModule: refused by ShardwiseStrategy(config=...),
    before the Trainer starts any process, naming the key and the fix (a dict or a JSON path),
    and by the config the strategy hands to initialize."""
    block, refused = PIPELINES[name]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pipeline": block}))
    for config in ({"pipeline": block}, str(path)):
        if not refused:
            ShardwiseStrategy(config=config)
            assert _cfg(config)["pipeline"] == block, name
            continue
        fix = "pipeline.stages=.* LightningModule cannot be cut into pipeline stages. Drop"
        with pytest.raises(ValueError, match=fix):
            ShardwiseStrategy(config=config)
        with pytest.raises(ValueError, match=fix):
            _cfg(config)


def test_the_checkpoint_keeps_lightnings_state_but_not_the_model_or_pickles(caplog):
    checkpoint = {
        "epoch": 1,
        "global_step": 4,
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{}],
        "lr_schedulers": [{"last_epoch": 4, "_last_lr": [0.05]}],
        "callbacks": {"ModelCheckpoint{}": {"best_model_score": torch.tensor(0.5)}},
        "hyper_parameters": {"args": argparse.Namespace(lr=0.1)},
    }
    kept = storable(checkpoint)
    assert sorted(kept) == ["callbacks", "epoch", "global_step", "lr_schedulers"]
    assert "hyper_parameters" in caplog.text and "pickles nothing" in caplog.text
