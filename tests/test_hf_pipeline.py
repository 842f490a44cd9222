"""A Hugging Face decoder as a pipeline trains like one process (issue 11 item 10).

``causal_lm_pipeline(model, num_stages)`` cuts a Llama-style or GPT-2 model into stages from its
own modules; each row trains it through ``train_batch`` (1F1B and GPipe, with and without data
parallelism) on ``(input_ids, labels)`` pairs and compares with the one-process loop of
test_hf_models.py on the same global batches (SGD with momentum, clipping): same losses and
final parameters within the same 1e-5 (a pipeline changes no sum: the stages run the same
operations in the same order; data parallelism averages). The gathered state has the model's
own keys, and loads back into a fresh Hugging Face model.

Qwen2 and GPT-2 tie their input and output embeddings: the embedding on the first stage and the
head on the last hold copies of one weight (DeepSpeed's TiedLayerSpec), their gradients summed
over the two stages. The rows check the copies against the one weight of one process under both
Hugging Face names, and against each other bitwise (same start, same summed gradient, same
update). Each decoder layer makes the attention mask the model would give it (its attention
implementation, its sliding window): checked bitwise against the model's logits in one stage.

Measured (these rows, transformers 5.23): losses within 1.1e-7 relative, gradient norms 3.1e-7,
parameters 7.5e-9 of one process; the 1e-5 tolerance leaves a factor of 30 and more.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")

from harness import run_distributed  # noqa: E402
from hf_models import make_hf_batches, make_hf_model, take  # noqa: E402
from models import rank_slice  # noqa: E402
from test_hf_models import CLIP, LR, MB, STEPS, assert_matches, reference  # noqa: E402

import shardwise  # noqa: E402
from shardwise.integrations.huggingface import causal_lm_pipeline  # noqa: E402

GAS = 2
LAYOUTS = {  # name: (processes, pipeline stages, schedule)
    "pp1": (1, 1, "1f1b"),  # one stage: the tied embedding and head are one weight
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


TIED = {"qwen2": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}  # lm_head's twin
CASES = [(f, layout, "none") for f in ("llama", "mistral") for layout in LAYOUTS if layout != "pp1"]
CASES += [(f, layout, "none") for f in TIED for layout in LAYOUTS]  # tied embeddings
CASES += [(f, "pp2-1f1b", ckpt) for f in ("llama", "gpt2") for ckpt in CHECKPOINTING[1:]]
CASES += [("qwen2", "pp2-1f1b", "ours")]


@pytest.mark.parametrize("family, layout, ckpt", CASES)
def test_hugging_face_decoder_pipeline_trains_like_one_process(family, layout, ckpt):
    world, stages, _ = LAYOUTS[layout]
    want = reference(family, MB * GAS * (world // stages))
    results = run_distributed(run_pipeline, world, family, layout, ckpt)
    tag = f"{family} {layout} checkpointing={ckpt}"
    assert_matches(results, want, tag)
    got = results[0]["params"]
    fresh = make_hf_model(family, seed=7)
    assert set(got) == set(fresh.state_dict()), f"{tag}: the model's own keys"
    trained = make_hf_model(family)
    trained.load_state_dict(want["params"], strict=False)
    for name, w in trained.state_dict().items():  # a tied alias (lm_head.weight) included
        diff = (got[name] - w).abs().max()
        assert diff <= 1e-5, f"{tag}: {name} differs from one process by {diff:.2e}"
    if family in TIED:
        embed, head = got[TIED[family]], got["lm_head.weight"]
        assert torch.equal(embed, head), f"{tag}: the tied copies drifted apart"
    fresh.load_state_dict(got)  # strict
    ids = make_hf_batches(family, 2)["input_ids"]
    assert torch.allclose(fresh(ids).logits, trained(ids).logits, atol=1e-4), tag


@pytest.mark.parametrize("family", TIED)
def test_one_stage_keeps_one_tied_weight_under_both_names(family):
    """num_stages=1: embedding and head are one parameter (one optimizer entry, one update),
    and the state dict lists it under both names, as the Hugging Face model does."""
    model = make_hf_model(family)
    pipe = causal_lm_pipeline(model, num_stages=1)
    weight = model.get_input_embeddings().weight
    assert [n for n, p in pipe.named_parameters() if p is weight] == [TIED[family]], family
    state = pipe.state_dict()
    assert list(state) == list(model.state_dict()), f"{family}: the model's keys, in its order"
    assert state["lm_head.weight"].data_ptr() == weight.data_ptr(), f"{family}: lm_head is tied"
    ids = make_hf_batches(family, 2)["input_ids"]
    assert torch.equal(pipe(ids), model(ids).logits), f"{family}: the model's logits"


# (family, attention implementation, sliding window): Mistral's window covers every layer,
# Qwen2's only the layers config.layer_types marks "sliding_attention" (here the second).
MASKS = [
    ("gpt2", "eager", None),
    ("gpt2", "sdpa", None),
    ("llama", "sdpa", None),
    ("mistral", "eager", 3),
    ("mistral", "sdpa", 3),
    ("qwen2", "eager", 3),
]


def with_window(model: torch.nn.Module, family: str, window: int) -> torch.nn.Module:
    """``model``'s weights in a model built with a sliding window of ``window`` tokens (Qwen2:
    on its second layer). Built, not set afterwards: transformers 4.57 fixes a Qwen2 layer's
    attention type at construction (``decoder_layer.attention_type``), 5.x reads
    ``config.layer_types`` at each forward."""
    config = copy.deepcopy(model.config)
    config.sliding_window = window
    if family == "qwen2":
        config.layer_types = ["full_attention", "sliding_attention"]
    windowed = type(model)(config)
    windowed.load_state_dict(model.state_dict())
    return windowed.train(model.training)


@pytest.mark.parametrize("family, attention, window", MASKS)
def test_every_layer_gets_the_mask_the_model_gives_it(family, attention, window):
    """One stage runs every layer as the pipeline calls it, each making its own mask: the
    logits are the model's, bitwise, whatever its attention implementation ("sdpa" may skip
    the mask for is_causal) and window (3 < T = 8: it changes the logits, checked)."""
    tag = f"{family} {attention} window={window}"
    model = make_hf_model(family)
    model.set_attn_implementation(attention)
    ids = make_hf_batches(family, 2)["input_ids"]
    model.config.use_cache = False  # as the pipeline sets it (a cache changes the last bits)
    whole = model(ids).logits
    if window:
        model = with_window(model, family, window)
    want = model(ids).logits
    assert window is None or not torch.allclose(want, whole), f"{tag}: void, no window effect"
    pipe = causal_lm_pipeline(model, num_stages=1)
    assert torch.equal(pipe(ids), want), f"{tag}: the pipeline's logits differ from the model's"


def test_a_model_of_no_known_structure_is_refused_naming_what_each_family_needs():
    import transformers

    base = transformers.GPT2Model(make_hf_model("gpt2").config)  # no lm_head
    with pytest.raises(ValueError, match=r"neither a Llama-style nor a GPT-2 style .*lm_head"):
        causal_lm_pipeline(base, num_stages=2)


def test_a_masked_lm_is_refused_saying_why():
    """BERT: refused, naming the tie TiedLayerSpec cannot hold (docs/huggingface.md)."""
    why = r"BertForMaskedLM is a masked LM.*tied twice.*cls\.predictions\.bias.*padding"
    with pytest.raises(ValueError, match=why):
        causal_lm_pipeline(make_hf_model("bert"), num_stages=2)


def save_or_resume(family: str, layout: str, out: str, load: bool) -> dict:
    """A tied model as a two-stage pipeline ("pp2") or as itself in one process ("plain"): two
    steps, then save_checkpoint and save_16bit_model; or (``load``) start from other weights,
    load what the other layout saved and skip its two batches. Then one more step."""
    model = make_hf_model(family, seed=3 if load else 0)
    pipe = layout == "pp2"
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "SGD", "params": {}}}
    config["optimizer"]["params"] = {"lr": LR, "momentum": 0.9}  # momentum: state to carry
    module = causal_lm_pipeline(model, num_stages=2) if pipe else model
    engine, *_ = shardwise.initialize(model=module, config=config)
    data = make_hf_batches(family, 3 * MB)
    rows = [slice(i, i + MB) for i in range(0, 3 * MB, MB)]
    batches = iter(
        [(data["input_ids"][r], data["labels"][r]) if pipe else take(data, r) for r in rows]
    )
    if load:
        engine.load_checkpoint(os.path.join(out, "ckpt"), tag="t")
        next(batches), next(batches)
    else:
        engine.train_batch(batches), engine.train_batch(batches)
        engine.save_checkpoint(os.path.join(out, "ckpt"), tag="t")
        engine.save_16bit_model(out)
    weights = engine.consolidated_state_dict()
    return {"weights": weights, "next_loss": engine.train_batch(batches).item()}


@pytest.mark.parametrize("family", TIED)
@pytest.mark.parametrize("saved_by, loaded_by", [("pp2", "plain"), ("plain", "pp2")])
def test_a_tied_checkpoint_moves_between_the_pipeline_and_the_plain_model(
    family, saved_by, loaded_by, tmp_path
):
    """The plain model's checkpoint stores the tied weight once (lm_head.weight recorded as its
    alias); the pipeline's last stage reads its copy, weights and momentum, through the alias.
    The pipeline's checkpoint holds both names; the plain model reads one. Same weights
    (bitwise: copies of the same values) and the same next loss (1e-6: a different layout)."""
    tag = f"{family} {saved_by} -> {loaded_by}"
    world, out = {"pp2": 2, "plain": 1}, str(tmp_path)
    saved = run_distributed(save_or_resume, world[saved_by], family, saved_by, out, False)[0]
    loaded = run_distributed(save_or_resume, world[loaded_by], family, loaded_by, out, True)[0]
    assert saved["weights"].keys() == loaded["weights"].keys(), f"{tag}: the same names"
    for name, w in saved["weights"].items():
        assert torch.equal(w, loaded["weights"][name]), f"{tag}: {name}"
    assert loaded["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-6), tag


@pytest.mark.parametrize("family", TIED)
def test_a_tied_pipeline_saves_what_from_pretrained_and_load_state_dict_load(family, tmp_path):
    """save_16bit_model of the two-stage pipeline writes both Hugging Face names and the
    model's config.json: from_pretrained loads it, tied again; ``shardwise export`` of its
    checkpoint loads strictly. Both reproduce the trained weights exactly."""
    import transformers
    from safetensors.torch import load_file

    trained = run_distributed(save_or_resume, 2, family, "pp2", str(tmp_path), False)[0]
    trained = trained["weights"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(make_hf_model(family)), f"{family}: from_pretrained's class"
    head, embed = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr(), f"{family} from_pretrained: tied again"
    export = tmp_path / "export.safetensors"
    cmd = [sys.executable, "-m", "shardwise", "export", str(tmp_path / "ckpt" / "t"), str(export)]
    subprocess.run(cmd, check=True, capture_output=True)
    fresh = make_hf_model(family, seed=9)
    fresh.load_state_dict(load_file(export))  # strict: both names are in the file
    for how, state in (("from_pretrained", loaded.state_dict()), ("export", fresh.state_dict())):
        assert state.keys() == trained.keys(), f"{family} {how}: the model's names"
        for name, w in trained.items():
            assert torch.equal(state[name], w), f"{family} {how}: {name} differs"
