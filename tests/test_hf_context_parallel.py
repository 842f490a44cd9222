"""Hugging Face models under context parallelism (integrations/hf_context.py): trained through
``train_batch`` on whole-sequence ``{"input_ids", "labels"}`` batches, exactly as in one process.

Each family meets a different part of the rule: Llama (RoPE positions, grouped-query
attention), Qwen2 (tied embeddings, q/k/v biases), GPT-2 (learned positions, ``Conv1D``), BERT
(bidirectional, masked-LM labels on 2 positions of 8: unequal counts per rank). The reference is
test_hf_models.py's one-process loop; the bounds are that table's (fp32: 1e-5 on losses,
norms and every parameter), and a causal LM whose labels were shifted per rank, or a loss
averaged without the count of labelled tokens, is off by more than 1e-2 in the first loss.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the HF tables need the dev extra")

from cp_train_runs import hf_padding_error, hf_run  # noqa: E402
from harness import run_distributed  # noqa: E402
from hf_models import make_hf_model  # noqa: E402
from test_hf_models import CLIP, LR, MB, STEPS, assert_matches, reference  # noqa: E402

import shardwise  # noqa: E402
from shardwise.errors import EngineError  # noqa: E402

# transformers 4.57's BERT builds its own attention classes (no AttentionInterface): refused,
# see test_a_model_whose_attention_is_built_in_is_refused_naming_the_fix.
BERT_ROUTED = transformers.BertPreTrainedModel._supports_attention_backend
BUILT_IN = pytest.mark.skipif(
    not BERT_ROUTED, reason="this transformers' BERT builds its own attention: refused (below)"
)
# family, processes, context size, method (data ranks: processes / context size)
ROWS = [
    ("llama", 2, 2, "ring"),
    ("llama", 4, 2, "ulysses"),
    ("qwen2", 2, 2, "ulysses"),
    ("gpt2", 4, 4, "ring"),
    ("bert", 2, 2, "ring"),
    ("mistral", 4, 2, "ring"),
]
CASES = [pytest.param(*row, marks=BUILT_IN if row[0] == "bert" else ()) for row in ROWS]
IDS = [f"{f}-dp{n // c}-cp{c}-{m}" for f, n, c, m in ROWS]


@pytest.mark.parametrize("family, nproc, cp, method", CASES, ids=IDS)
def test_hf_model_trains_like_one_process_under_context_parallelism(family, nproc, cp, method):
    dp = nproc // cp
    want = reference(family, MB * dp)
    got = run_distributed(hf_run, nproc, family, cp, method, STEPS, MB, LR, CLIP)
    assert_matches(got, want, f"{family} dp{dp} cp{cp} {method}")


def test_padding_is_refused_naming_the_fix():
    """A padded position's key lives on another rank: no rank could mask it."""
    for rank, error in enumerate(run_distributed(hf_padding_error, 2)):
        assert "padding attention_mask" in error, f"rank {rank}: {error}"
        assert "context_parallel.size to 1" in error, f"rank {rank}: {error}"


def test_a_model_whose_attention_is_built_in_is_refused_naming_the_fix():
    """A model whose class builds its own attention (``_supports_attention_backend = False``,
    transformers 4.57's BERT; a subclass flagged so stands for it under 5.x) never calls the
    registered attention: each rank would attend to its own tokens only. Refused by
    ``initialize`` before any process group (one process is enough)."""
    model = make_hf_model("bert")
    flagged = type("BuiltInAttentionBert", (type(model),), {"_supports_attention_backend": False})
    model.__class__ = flagged
    config = {"train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": 2}}
    with pytest.raises(EngineError) as refused:
        shardwise.initialize(model=model, config=config)
    for says in ("BuiltInAttentionBert", "AttentionInterface", "context_parallel.size to 1"):
        assert says in str(refused.value), f"the refusal names {says!r}: {refused.value}"
