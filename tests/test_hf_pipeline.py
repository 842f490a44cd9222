"""A Hugging Face decoder as a pipeline trains like one process (issue 11 item 10).

``causal_lm_pipeline(model, num_stages)`` cuts a Llama-style model into stages from its own
modules; each row trains it through ``train_batch`` (1F1B and GPipe, with and without data
parallelism) on ``(input_ids, labels)`` pairs and compares with the one-process loop of
test_hf_models.py on the same global batches (SGD with momentum, clipping): same losses and
final parameters within the same 1e-5 (a pipeline changes no sum: the stages run the same
operations in the same order; data parallelism averages). The gathered state has the model's
own keys, and loads back into a fresh Hugging Face model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")

from harness import run_distributed  # noqa: E402
from hf_models import make_hf_batches, make_hf_model  # noqa: E402
from models import rank_slice  # noqa: E402
from test_hf_models import CLIP, LR, MB, STEPS, assert_matches, reference  # noqa: E402

import shardwise  # noqa: E402
from shardwise.integrations.huggingface import causal_lm_pipeline  # noqa: E402

GAS = 2
LAYOUTS = {  # name: (processes, pipeline stages, schedule)
    "pp2-1f1b": (2, 2, "1f1b"),
    "pp2-gpipe": (2, 2, "gpipe"),
    "dp2xpp2": (4, 2, "1f1b"),
}
# Activation checkpointing: Hugging Face's (gradient_checkpointing_enable) or the pipeline's
# own (activation_checkpoint_interval); neither may change a number.
CHECKPOINTING = ("none", "hf", "ours")


def run_pipeline(family: str, layout: str, ckpt: str = "none") -> dict:
    _, stages, schedule = LAYOUTS[layout]
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "pipeline": {"schedule": schedule},
    }
    model = make_hf_model(family)
    if ckpt == "hf":
        model.gradient_checkpointing_enable()
    interval = 1 if ckpt == "ours" else 0
    pipe = causal_lm_pipeline(model, num_stages=stages, activation_checkpoint_interval=interval)
    engine, *_ = shardwise.initialize(model=pipe, config=config)
    dp, rank = engine.dp_world_size, engine.dp_rank
    data = make_hf_batches(family, MB * dp * GAS * STEPS)
    ids, labels = data["input_ids"], data["labels"]
    losses, norms = [], []
    for k in range(STEPS):
        rows = [rank_slice(k, j, rank, MB, dp, GAS) for j in range(GAS)]
        losses.append(engine.train_batch(iter([(ids[r], labels[r]) for r in rows])).item())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "params": engine.consolidated_state_dict()}


CASES = [(f, layout, "none") for f in ("llama", "mistral") for layout in LAYOUTS]
CASES += [("llama", "pp2-1f1b", ckpt) for ckpt in CHECKPOINTING[1:]]


@pytest.mark.parametrize("family, layout, ckpt", CASES)
def test_hugging_face_decoder_pipeline_trains_like_one_process(family, layout, ckpt):
    world, stages, _ = LAYOUTS[layout]
    want = reference(family, MB * GAS * (world // stages))
    results = run_distributed(run_pipeline, world, family, layout, ckpt)
    tag = f"{family} {layout} checkpointing={ckpt}"
    assert_matches(results, want, tag)
    fresh = make_hf_model(family, seed=7)
    assert set(results[0]["params"]) == set(fresh.state_dict()), f"{tag}: the model's own keys"
    fresh.load_state_dict(results[0]["params"])  # strict
    trained = make_hf_model(family)
    trained.load_state_dict({k: v for k, v in want["params"].items()}, strict=False)
    ids = make_hf_batches(family, 2)["input_ids"]
    assert torch.allclose(fresh(ids).logits, trained(ids).logits, atol=1e-4), tag


def test_tied_embeddings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        causal_lm_pipeline(make_hf_model("qwen2"), num_stages=2)


def test_a_model_that_is_not_llama_style_is_refused_naming_what_it_lacks():
    with pytest.raises(ValueError, match="not a Llama-style causal LM"):
        causal_lm_pipeline(make_hf_model("gpt2"), num_stages=2)
