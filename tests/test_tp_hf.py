"""Tensor parallelism on Hugging Face models: their own plans, their style names, and parameter
lists collected before the split (issue 11 items 3 and 4).

The equivalence rows train a tiny Llama at TP2 with the model's own plan for a few steps and
compare with the one-process loop of test_hf_models.py (same weights, batches, SGD with
momentum, clipping): the order of sums is the only difference, so the same 1e-5 bounds hold.
The ``model_parameters`` rows hand ``initialize`` the list a script builds before the split: a
list, a generator, and the Hugging Face Trainer's decay / no-decay groups. Before the fix the
optimizer held the unsplit parameters and the split layers never moved (99% of elements off).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")

from harness import run_distributed  # noqa: E402
from hf_models import decay_groups, make_hf_model  # noqa: E402
from test_hf_models import CLIP, LR, MB, assert_matches, reference, train_engine  # noqa: E402

import shardwise  # noqa: E402
from shardwise.parallel.tensor.hf_styles import decoder_sequence_parallel  # noqa: E402
from shardwise.parallel.tensor.parallelize import match_plan, resolve_plan  # noqa: E402
from shardwise.parallel.tensor.styles import STYLES  # noqa: E402

DECAY = 0.01  # hf_models.decay_groups' default
PARAM_LISTS = {
    "list": lambda m: list(m.parameters()),
    "generator": lambda m: (p for p in m.parameters()),
    "groups": lambda m: decay_groups(m.named_parameters()),
}
TP2 = {
    "train_micro_batch_size_per_gpu": MB,
    "gradient_clipping": CLIP,
    "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
}


def run_tp2_with_param_list(kind: str) -> dict:
    model = make_hf_model("llama")
    config = {**TP2, "tensor_parallel": {"size": 2}}
    params = PARAM_LISTS[kind](model)
    engine, opt, *_ = shardwise.initialize(model=model, config=config, model_parameters=params)
    return {**train_engine(engine, "llama"), "wd": [g["weight_decay"] for g in opt.param_groups]}


@pytest.mark.parametrize("kind", list(PARAM_LISTS))
def test_model_parameters_collected_before_the_split_train_the_shards(kind):
    want = reference("llama", MB, grouped=kind == "groups")
    results = run_distributed(run_tp2_with_param_list, 2, kind)
    assert_matches(results, want, f"llama tp2 model_parameters={kind}")
    if kind == "groups":
        assert results[0]["wd"] == [DECAY, 0.0], "group options kept"


HF_NAMES = sorted(n for n, s in STYLES.items() if set(s.names) - {"shardwise"})


@pytest.mark.parametrize("style", HF_NAMES)
def test_every_hugging_face_style_runs_as_a_shardwise_style_or_is_refused_saying_why(style):
    runs_as = STYLES[style].runs_as
    if runs_as is not None:
        assert "shardwise" in STYLES[runs_as].names, f"{style} runs as {runs_as}, not ours"
        return
    model = make_hf_model("llama")
    with pytest.raises(ValueError, match=rf"'model.layers.\*.mlp.up_proj': '{style}' is .*"):
        match_plan(model, {"model.layers.*.mlp.up_proj": style})


LLAMA_MLP = "model.layers.*.mlp"
# id: (family, plan, what the refusal must say); each ran (and crashed or trained wrong) before
REFUSED_ON_MODELS = {
    "gpt2 c_attn colwise": ("gpt2", {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}, "use 'packed_colwise'"),
    "llama gate_proj packed_colwise": ("llama", {f"{LLAMA_MLP}.gate_proj": "packed_colwise", f"{LLAMA_MLP}.up_proj": "colwise", f"{LLAMA_MLP}.down_proj": "rowwise"}, "use 'colwise'"),
    "llama down_proj rwga after colwise": ("llama", {f"{LLAMA_MLP}.gate_proj": "colwise", f"{LLAMA_MLP}.up_proj": "colwise", f"{LLAMA_MLP}.down_proj": "replicated_with_grad_allreduce"}, "use 'rowwise'"),
    "llama down_proj rwga alone": ("llama", {f"{LLAMA_MLP}.down_proj": "replicated_with_grad_allreduce"}, "use 'replicate'"),
    "phi3 o_proj rowwise after colwise_rep": ("phi3", {"model.layers.*.self_attn.qkv_proj": "colwise_rep", "model.layers.*.self_attn.o_proj": "rowwise"}, "use 'rowwise_split_input'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_ON_MODELS))
def test_a_style_that_does_not_fit_a_hugging_face_module_is_refused(case):
    family, plan, says = REFUSED_ON_MODELS[case]
    with pytest.raises(ValueError, match=re.escape(says)):
        match_plan(make_hf_model(family), plan)


def test_the_models_own_plan_is_accepted_with_hugging_face_style_names():
    model = make_hf_model("llama")
    styles = match_plan(model, resolve_plan(model))
    if "model.embed_tokens" in styles:  # transformers 5's plan names them; 4.57's instance
        assert styles["model.embed_tokens"] == "vocab", styles  # plan lacks both
        assert styles["lm_head"] == "colwise_rep", styles
    assert styles["model.layers.1.mlp.down_proj"] == "rowwise", styles


def test_a_plan_relative_to_the_base_model_gets_its_prefix():
    """transformers 4.x published the base model's patterns ("layers.*...") on the model."""
    model = make_hf_model("qwen2")
    model._tp_plan = dict(model.config.base_model_tp_plan)
    plan = resolve_plan(model)
    assert "model.layers.*.self_attn.q_proj" in plan, plan
    assert match_plan(model, plan)["model.layers.0.self_attn.q_proj"] == "colwise"


def run_tp2_sequence_parallel(family: str) -> dict:
    config = {**TP2, "tensor_parallel": {"size": 2, "sequence_parallel": True}}
    engine, *_ = shardwise.initialize(model=make_hf_model(family), config=config)
    return train_engine(engine, family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_sequence_parallel_hugging_face_decoder_trains_like_one_process(family):
    """The model's own plan plus sequence parallelism: the residual stream is split from the
    first decoder layer on, the norms' gradients summed over the TP ranks (before the fix the
    split happened at the first norm, inside the layer, and the residual add crashed)."""
    results = run_distributed(run_tp2_sequence_parallel, 2, family)
    assert_matches(results, reference(family, MB), f"{family} tp2 + sequence parallelism")


PHI3_OTHER_NAMES = {  # Phi-3's plan in the vocabulary the installed transformers does not use
    "model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
    "model.layers.*.self_attn.o_proj": "rowwise_rep",
    "model.layers.*.mlp.gate_up_proj": "colwise_rep",
    "model.layers.*.mlp.down_proj": "rowwise_split_input",
}


def run_tp2_with_plan(family: str, plan: dict | None, sp: bool = False) -> dict:
    config = {**TP2, "tensor_parallel": {"size": 2, "plan": plan, "sequence_parallel": sp}}
    engine, *_ = shardwise.initialize(model=make_hf_model(family), config=config)
    return train_engine(engine, family)


@pytest.mark.parametrize("plan", ["own", "both vocabularies"])
def test_phi3_gathered_qkv_and_whole_input_row_layers_train_like_one_process(plan):
    """Phi-3 gathers its fused qkv_proj / gate_up_proj (it slices them itself) and its row
    layers take a whole input: rowwise_rep (4.57) / rowwise_split_input (5.x). Before, 4.57's
    rowwise_rep ran as a rowwise on a whole input (a shape error) and 5.x's was refused."""
    given = None if plan == "own" else PHI3_OTHER_NAMES
    results = run_distributed(run_tp2_with_plan, 2, "phi3", given)
    assert_matches(results, reference("phi3", MB), f"phi3 tp2 plan={plan}")


def test_a_user_plan_marking_the_norms_sequence_parallel_is_completed():
    """Hugging Face's own vocabulary: the norms marked "sequence_parallel". Before, the first
    norm became the entry, inside the layer, and the residual add crashed on shapes."""
    model = make_hf_model("llama")
    plan = dict(resolve_plan(model))
    plan.update(
        {
            f"model.layers.*.{n}": "sequence_parallel"
            for n in ("input_layernorm", "post_attention_layernorm")
        }
    )
    results = run_distributed(run_tp2_with_plan, 2, "llama", plan, True)
    assert_matches(results, reference("llama", MB), "llama tp2 sp, norms marked by the user")


def headless_plan(family: str) -> dict[str, str]:
    """The model's plan as transformers 4.57's instances publish it: its base model's entries
    under the prefix, no head and no embedding (5.x's name both)."""
    base = make_hf_model(family).config.base_model_tp_plan
    return {f"model.{pattern}": style for pattern, style in base.items()}


# family, the plan given, the styles of the head and the embedding after completion
HEADS = [
    ("llama", "headless", {"lm_head": "colwise_rep"}),  # the embedding stays whole
    ("qwen2", "headless", {"lm_head": "colwise_rep", "model.embed_tokens": "vocab"}),  # tied
    ("llama", "head kept", {"lm_head": "vocab"}),  # the plan's own head entry is kept
]


@pytest.mark.parametrize("family, given, want", HEADS, ids=[f"{f}-{g}" for f, g, _ in HEADS])
def test_sequence_parallelism_gives_a_plan_without_a_head_one_that_gathers_the_sequence(
    family, given, want
):
    """transformers 4.57's plans name no head: whole, it would see the final norm's T/n
    positions only. Completed as 5.x's plan does: the head split by vocabulary with its logits
    gathered (its input all-gathered along the sequence), a tied embedding split like it."""
    model = make_hf_model(family)
    plan = headless_plan(family)
    if given == "head kept":
        plan["lm_head"] = "vocab"
    styles = match_plan(model, decoder_sequence_parallel(model, plan), sequence_parallel=True)
    got = {n: s for n, s in styles.items() if n in ("lm_head", "model.embed_tokens")}
    assert got == want, f"{family} {given}: {got}"


def test_a_headless_plan_with_a_tied_embedding_trains_like_one_process_under_sequence_parallelism():
    """Qwen2 (tied) with 4.57's plan under either transformers: before, the head stayed whole
    on T/n positions (shapes off against the labels)."""
    results = run_distributed(run_tp2_with_plan, 2, "qwen2", headless_plan("qwen2"), True)
    assert_matches(results, reference("qwen2", MB), "qwen2 tp2 sp, 4.57's headless plan")


def test_sequence_parallelism_on_a_decoder_shardwise_cannot_complete_is_refused_naming_the_entries():
    model = make_hf_model("gpt2")
    with pytest.raises(ValueError, match="'sequence_entry' on the module whose input is"):
        decoder_sequence_parallel(model, {"transformer.h.*.ln_1": "sequence_parallel"})
    plan = {"transformer.h.0": "sequence_entry", "transformer.h.*.ln_1": "sequence_parallel"}
    assert decoder_sequence_parallel(model, plan) == plan, "the user's own entries are kept"
