"""Hugging Face models in and out of shardwise: dict batches, saving back to ``from_pretrained``,
tied weights through checkpoints and export (issue 11 items 7, 8, 9).

Rows: a tied model (Qwen2 with ``tie_word_embeddings``, GPT-2's tied head) trained through
``train_batch`` on the dict samples Hugging Face datasets yield, in one process, under ZeRO-3
on two and under tensor parallelism on two (GPT-2's fused q|k|v split part by part); then
``save_16bit_model(dir)`` with DeepSpeed's default name must load with
``from_pretrained(dir)``, and a checkpoint exported by ``shardwise export`` must load with
``load_state_dict(load_file(...))``. Both loads must reproduce the trained weights exactly
(they are copies of the same fp32 values, so equality is bitwise).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")

from harness import run_distributed  # noqa: E402
from hf_models import make_hf_batches, make_hf_model, take  # noqa: E402

import shardwise  # noqa: E402

MB = 2
# name: (processes, zero_optimization, tensor-parallel size); tp2 splits GPT-2's fused q|k|v
# part by part (packed_colwise) and Qwen2's tied embedding and head by vocabulary.
LAYOUTS = {
    "single": (1, {}, 1),
    "zero3x2": (2, {"stage": 3, "stage3_param_persistence_threshold": 0}, 1),
    "tp2": (2, {}, 2),
}


def train_and_save(family: str, layout: str, out: str, filename: str | None) -> dict:
    _, zero, tp = LAYOUTS[layout]
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
        "tensor_parallel": {"size": tp},
    }
    engine, *_ = shardwise.initialize(model=make_hf_model(family), config=config)
    data = make_hf_batches(family, 16)
    rank = engine.dp_rank
    samples = (take(data, slice(i + rank * MB, i + (rank + 1) * MB)) for i in range(0, 16, 4))
    losses = [engine.train_batch(samples).item() for _ in range(2)]
    if filename is None:
        engine.save_16bit_model(out)
    else:
        engine.save_16bit_model(out, filename)
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    return {"losses": losses, "state": engine.consolidated_state_dict()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_tied_model_saved_by_shardwise_loads_with_from_pretrained(family, layout, tmp_path):
    import transformers

    world, _, _ = LAYOUTS[layout]
    tag = f"{family} {layout}"
    got = run_distributed(train_and_save, world, family, layout, str(tmp_path), None)[0]
    assert all(torch.isfinite(torch.tensor(got["losses"]))), tag
    assert (tmp_path / "pytorch_model.bin").exists(), f"{tag}: DeepSpeed's default name"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    state = loaded.state_dict()
    for name, want in got["state"].items():
        assert torch.equal(state[name], want), f"{tag}: from_pretrained {name} differs"
    # Tied stays tied after the load, as Hugging Face re-ties it.
    head, embed = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr(), f"{tag}: head no longer tied"

    export = tmp_path / "export.safetensors"
    cmd = [sys.executable, "-m", "shardwise", "export", str(tmp_path / "ckpt"), str(export)]
    subprocess.run(cmd, check=True, capture_output=True)
    from safetensors.torch import load_file

    fresh = make_hf_model(family, seed=9)
    fresh.load_state_dict(load_file(export))  # strict: the tied alias must be in the file
    for name, p in fresh.state_dict().items():
        assert torch.equal(p, got["state"][name]), f"{tag}: export {name} differs"


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_safetensors_name_writes_safetensors_with_both_tied_names(family, tmp_path):
    from safetensors.torch import load_file

    got = run_distributed(train_and_save, 1, family, "single", str(tmp_path), "m.safetensors")[0]
    state = load_file(tmp_path / "m.safetensors")
    assert state.keys() == got["state"].keys(), f"{family}: names written"
    for name, want in got["state"].items():
        assert torch.equal(state[name], want), f"{family}: {name}"


def _engine_without_labels():
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "SGD", "params": {}}}
    config["optimizer"]["params"]["lr"] = 0.1
    engine, *_ = shardwise.initialize(model=make_hf_model("llama"), config=config)
    return engine


def test_dict_batch_without_labels_says_what_a_batch_must_hold():
    engine = _engine_without_labels()
    batch = {"input_ids": make_hf_batches("llama", MB)["input_ids"]}
    with pytest.raises(shardwise.training.engine.EngineError, match="labels"):
        engine.train_batch(iter([batch]))


def test_dict_batch_with_a_loss_fn_says_batches_are_pairs():
    engine = _engine_without_labels()
    engine.loss_fn = lambda out, labels: out.logits.mean()
    with pytest.raises(shardwise.training.engine.EngineError, match=r"\(inputs, labels\)"):
        engine.train_batch(iter([make_hf_batches("llama", MB)]))
