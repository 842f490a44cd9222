"""What the Trainer says, written into the shardwise config; what a Lightning checkpoint keeps.

``engine_config`` starts from the strategy's config (a dict, a JSON path, or nothing: data
parallelism) and fills in what the Trainer owns, refusing a config that says otherwise:

    Trainer(accumulate_grad_batches=N)  -> gradient_accumulation_steps = N
    Trainer(gradient_clip_val=C)        -> gradient_clipping = C (the norm; "value" is refused)
    Trainer(precision="bf16-...")       -> bf16.enabled; "16-..." -> fp16.enabled
    trainer.save_checkpoint(path) again -> checkpoint.keep_last = 1: the path holds the newest
    the train loader's batch_size       -> train_micro_batch_size_per_gpu, when the config gives
                                           no batch size (it only counts samples: Lightning's
                                           loader makes the batches)

``storable`` is the part of Lightning's checkpoint dict that goes into the engine's checkpoint
as its ``client_state``: everything but the model and optimizer (the engine writes those
sharded), and only values a shardwise checkpoint stores (JSON, tuples, tensors, numeric arrays:
nothing is pickled); a top-level entry holding anything else is left out, with a warning.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from shardwise.checkpoint.state_codec import StateError, encode

logger = logging.getLogger("shardwise")

# Lightning's keys for what the engine saves itself, sharded.
ENGINE_OWNED = ("state_dict", "optimizer_states")
_BF16, _FP16 = ("bf16-mixed", "bf16-true", "bf16"), ("16-mixed", "16-true", "16")


def load_config(config: dict | str | Path | None) -> dict:
    """A private copy of ``config`` (a dict, or the path of a JSON file)."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        try:
            return json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"ShardwiseStrategy(config={str(config)!r}): {e}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"ShardwiseStrategy(config=...) takes a dict or a JSON path, not {type(config).__name__}"
        )
    return copy.deepcopy(config)


def refuse_pipeline(cfg: dict) -> None:
    """A pipeline config is refused: a LightningModule is not a list of layers to cut into
    stages (its ``training_step`` runs the whole model), and the engine's forward, which
    Lightning calls, runs no pipeline schedule."""
    block = cfg.get("pipeline")
    stages = block.get("stages", 1) if isinstance(block, dict) else 1
    if stages not in (1, "auto"):
        raise ValueError(
            f"pipeline.stages={stages!r} under ShardwiseStrategy: a LightningModule cannot be "
            "cut into pipeline stages. Drop pipeline.stages (or set it to 1) and split the model "
            "with tensor_parallel or ZeRO instead, or train a shardwise.pipe.PipelineModule "
            "with engine.train_batch outside Lightning"
        )


def _set(cfg: dict, key: str, value: Any, flag: str) -> None:
    """``cfg[key] = value``, unless the config already names another value."""
    if key in cfg and cfg[key] not in (value, "auto"):
        raise ValueError(
            f"the config's {key}={cfg[key]!r} disagrees with Trainer({flag}={value!r}): the "
            f"Trainer decides it under ShardwiseStrategy; drop the key or change the Trainer"
        )
    cfg[key] = value


def _precision(cfg: dict, precision: str) -> None:
    for names, block, other in ((_BF16, "bf16", "fp16"), (_FP16, "fp16", "bf16")):
        if precision in names:
            if cfg.get(other, {}).get("enabled"):
                raise ValueError(
                    f"Trainer(precision={precision!r}) with the config's {other}.enabled: "
                    "choose one 16-bit format"
                )
            if cfg.get(block, {}).get("enabled") is False:
                raise ValueError(
                    f"Trainer(precision={precision!r}) but the config says {block}.enabled=false"
                )
            cfg[block] = {**cfg.get(block, {}), "enabled": True}


def engine_config(
    config: dict | str | Path | None,
    accumulate: int,
    clip_val: float | None,
    clip_algorithm: str | None,
    precision: str,
    loader_batch_size: int | None,
) -> dict:
    """The config ``shardwise.initialize`` gets (module docstring)."""
    cfg = load_config(config)
    refuse_pipeline(cfg)
    _set(cfg, "gradient_accumulation_steps", int(accumulate), "accumulate_grad_batches")
    if clip_val:
        if clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"Trainer(gradient_clip_algorithm={clip_algorithm!r}) under ShardwiseStrategy: "
                "only 'norm' (the global gradient norm, over every shard)"
            )
        _set(cfg, "gradient_clipping", float(clip_val), "gradient_clip_val")
    cfg.setdefault("gradient_clipping", 0.0)  # the Trainer's default: no clipping
    _precision(cfg, precision)
    # Lightning saves a path again to replace it (ModelCheckpoint's last.ckpt): keep the newest.
    cfg.setdefault("checkpoint", {}).setdefault("keep_last", 1)
    if "train_batch_size" not in cfg and "train_micro_batch_size_per_gpu" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = loader_batch_size or 1
    return cfg


def storable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The ``client_state`` of an engine checkpoint made from Lightning's dict (module docstring)."""
    kept, left = {}, []
    for key, value in checkpoint.items():
        if key in ENGINE_OWNED:
            continue
        try:
            encode(value, {}, key)
        except StateError as e:
            left.append(f"{key} ({e})")
            continue
        kept[key] = value
    if left:
        logger.warning(
            "Lightning's checkpoint entries not saved (a shardwise checkpoint pickles nothing): %s",
            "; ".join(left),
        )
    return kept
