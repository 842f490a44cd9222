"""Every real DeepSpeed config of shared/reference goes through ``initialize`` and one training
step, or is refused before any work for a reason docs/config.md states.

test_config_reference.py checks parsing and batch arithmetic; this checks the whole path a
script takes (``initialize``, forward, ``backward``, ``step``), where a key the parser accepts
can still be refused by a strategy (``partition_activations`` and ``offload_param`` were, until
they were built). "auto" values are replaced the way the Hugging Face Trainer replaces them
(from its own arguments: batch sizes, learning rate, schedule lengths, clipping); a config
without an "optimizer" block gets an optimizer from the script, as Megatron scripts pass one.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_config_reference import CONFIGS, needs_reference, valid_names

import shardwise

HF_FILLS = {  # "auto" key -> the value the Trainer would write (small: one step on CPU)
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "lr": 1e-3,
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-3,
    "warmup_num_steps": 10,
    "total_num_steps": 100,
}
# Refused on purpose: config -> the key the error names (docs/config.md says why for each).
REFUSED = {
    "ds_unit_pipe_seed_layers_ckpt.json": "grandient_accumulation_steps",  # a typo
    "dse_imagenet_fp16_zero1.json": "cuda_visible_devices",  # not a DeepSpeed key
    "dse_bing_bert_lamb_bsz64k.json": "sparse_attention",  # GPU-only Triton kernels
    # No batch size at all (the Trainer fills only "auto" values; DeepSpeed fails the same way).
    "hf_transformers_zero3_fp16_explicit.json": "train_batch_size",
}


def hf_filled(node, key: str | None = None):
    if isinstance(node, dict):
        return {k: hf_filled(v, k) for k, v in node.items()}
    return HF_FILLS.get(key, node) if node == "auto" else node


def one_step(raw: dict) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = None if "optimizer" in raw else (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine, *_ = shardwise.initialize(model=model, optimizer=optimizer, config=raw)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 4).to(dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


@needs_reference
@pytest.mark.parametrize("name", valid_names())
def test_reference_config_trains_a_step_or_is_refused_for_a_stated_reason(name):
    raw = hf_filled(json.loads((CONFIGS / name).read_text()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in REFUSED:
            with pytest.raises(shardwise.ConfigError) as info:
                one_step(raw)
            assert info.value.key == REFUSED[name], f"{name}: names {info.value.key!r}"
        else:
            loss = one_step(raw)
            assert loss == loss and loss > 0, f"{name}: loss {loss}"


@needs_reference
def test_most_reference_configs_train():
    # 15 of 19 as of this writing; a refusal added without a reason here fails the table above.
    assert len(valid_names()) - len(REFUSED) == 15
