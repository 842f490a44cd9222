"""Sharded Hugging Face safetensors load straight into a ZeRO-3 or tensor-parallel engine, each
rank reading only its part.

A tiny Llama (hf_models.py) is saved by ``save_pretrained`` as sharded safetensors
(``model.safetensors.index.json`` and several shard files). On 2 ranks the same model class is
built with other weights (under ZeRO-3 inside ``shardwise.zero.Init()``: partitioned as it is
built), set up under ZeRO-3 or tensor parallelism of 2, and ``engine.load_module_state_dict(dir)`` loads the shards (hf_load_runs.py). Checked:

    the consolidated weights equal the saved model's state dict bit for bit (an fp32 copy);
    each rank read at most its share: under ZeRO-3 every tensor is split in 2 flat halves, so
        the ranks together read the model exactly once (no byte twice) and each about half;
        under tensor parallelism the split weights are read once in all and the replicated
        ones (norms) by both ranks; no rank reads the whole model.
"""

import json
import os

import pytest
import torch
from harness import run_distributed
from hf_load_runs import load_on_meta_model
from hf_models import make_hf_model

from shardwise.checkpoint.foreign.hf_safetensors import INDEX

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("hf-sharded"))
    full = make_hf_model("llama", seed=0)
    full.save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    return path, {k: v.detach().clone() for k, v in full.state_dict().items()}


def test_the_model_is_saved_as_several_shards(saved):
    path, _ = saved
    with open(os.path.join(path, INDEX)) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) >= 3, f"save_pretrained wrote {files}: not sharded"


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
def test_each_rank_reads_only_its_part_and_the_engine_equals_the_model(saved, layout):
    path, want = saved
    got = run_distributed(load_on_meta_model, 2, layout, path)
    total = sum(v.numel() * v.element_size() for v in want.values())
    state = got[0]["state"]
    assert state.keys() == want.keys(), layout
    for name, value in want.items():
        assert torch.equal(state[name], value), f"{layout}: {name} loaded differently"
    read = [r["bytes_read"] for r in got]
    for rank, n in enumerate(read):
        assert n < 0.75 * total, f"{layout} rank {rank} read {n} of {total} bytes"
    if layout == "zero3":  # 2 flat halves of every tensor: the ranks read the model once
        assert sum(read) == total, f"{layout}: {read} bytes read, the model has {total}"
    else:  # split weights once, replicated ones (norms: 1-D) on both ranks
        replicated = sum(v.numel() * v.element_size() for v in want.values() if v.dim() == 1)
        assert sum(read) == total + replicated, f"{layout}: {read}, model {total}"


def test_inspect_names_hugging_face_weights_and_how_they_load(saved, capsys):
    from shardwise.launch.cli import main

    path, want = saved
    assert main(["checkpoint", "inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"format: Hugging Face safetensors weights at {path}" in out, out
    assert "loads with engine.load_module_state_dict(path)" in out, out
    assert f"weights: {len(want)} tensors" in out and "model/lm_head.weight" in out, out
