"""Runs for test_hf_safetensors_load.py: a Hugging Face model with other weights (seed 5; under
ZeRO-3 built inside ``shardwise.zero.Init()``, so no rank ever holds it whole), set up by
shardwise under a layout, then its weights loaded from sharded safetensors with
``engine.load_module_state_dict(path)``; what each rank read, and the consolidated weights,
come back."""

import contextlib

from hf_models import make_hf_model

LAYOUTS = {  # name -> config keys beside the batch size and optimizer
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    "tp2": {"tensor_parallel": {"size": 2}},
}


def load_on_meta_model(layout: str, path: str) -> dict:
    import shardwise
    import shardwise.zero

    build = shardwise.zero.Init() if layout == "zero3" else contextlib.nullcontext()
    with build:
        m = make_hf_model("llama", seed=5)
    cfg = {"train_micro_batch_size_per_gpu": 1, **LAYOUTS[layout]}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = shardwise.initialize(model=m, config=cfg)
    reader = engine.load_module_state_dict(path)
    state = {k: v.detach().clone() for k, v in engine.consolidated_state_dict().items()}
    return {
        "bytes_read": reader.bytes_read,
        "opened": sorted(reader.tensors_opened),
        "state": state,
    }
