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

pytest.importorskip("transformers", reason="the Hugging Face tables need the dev extra")

from cp_train_runs import hf_padding_error, hf_run  # noqa: E402
from harness import run_distributed  # noqa: E402
from test_hf_models import CLIP, LR, MB, STEPS, assert_matches, reference  # noqa: E402

# family, processes, context size, method (data ranks: processes / context size)
CASES = [
    ("llama", 2, 2, "ring"),
    ("llama", 4, 2, "ulysses"),
    ("qwen2", 2, 2, "ulysses"),
    ("gpt2", 4, 4, "ring"),
    ("bert", 2, 2, "ring"),
    ("mistral", 4, 2, "ring"),
]


@pytest.mark.parametrize(
    "family, nproc, cp, method", CASES, ids=[f"{f}-dp{n // c}-cp{c}-{m}" for f, n, c, m in CASES]
)
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
