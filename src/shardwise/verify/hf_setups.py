"""Tiny Hugging Face decoders for ``shardwise verify --fuzz``: Llama (RoPE, grouped-query
attention, SwiGLU) and GPT-2 (``Conv1D`` layers, a fused q|k|v, learned positions, a tied head).

Imported only when the fuzzer draws one of them; without ``transformers`` the draw is refused
with the install command. Sizes are tiny (hidden 32, 2 blocks, 4 heads, vocabulary 64,
sequences of 8 tokens), every dropout is 0 and attention is "eager" (the same kernel in every
layout), so a correct layout differs from one process by the order of floating-point sums only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardwise.integrations.huggingface import causal_lm_pipeline
from shardwise.verify.setup import VerifySetup

FAMILIES = ("llama", "gpt2")
VOCAB, HIDDEN, SEQ, ROWS = 64, 32, 8, 8


def _transformers() -> Any:
    try:
        import transformers  # noqa: PLC0415 - an optional dependency, loaded when drawn
    except ImportError:
        raise ValueError(
            "--fuzz drew a Hugging Face model but transformers is not installed: "
            "pip install 'shardwise[hf]' (or transformers)"
        ) from None
    return transformers


def _config(family: str) -> Any:
    tf = _transformers()
    if family == "llama":
        return tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    if family == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    raise ValueError(f"unknown Hugging Face family {family!r}; one of {FAMILIES}")


def hf_model(family: str) -> nn.Module:
    """A freshly initialised tiny model (the caller seeds torch)."""
    tf = _transformers()
    config = _config(family)
    config._attn_implementation = "eager"
    cls = tf.LlamaForCausalLM if family == "llama" else tf.GPT2LMHeadModel
    model = cls(config)
    # Zero biases are a near-cancelling gradient case (design notes): give them a value.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.dim() == 1 and "norm" not in name.lower():
                p.normal_(0.0, 0.02)
    return model.train()


def hf_setup(family: str, stages: int = 1) -> VerifySetup:
    """The verify setup of a tiny ``family`` model. It returns its own loss from
    ``{"input_ids", "labels"}`` (labels are the inputs: the model shifts them); with pipeline
    ``stages`` it is ``causal_lm_pipeline``'s, fed ``(input_ids, labels)`` pairs, the same rows."""
    _config(family)  # refuses an unknown family or a missing transformers before any work

    def batches() -> Iterator[Any]:
        g = torch.Generator().manual_seed(5)
        while True:
            ids = torch.randint(4, VOCAB, (ROWS, SEQ), generator=g)
            yield (ids, ids.clone()) if stages > 1 else {"input_ids": ids, "labels": ids.clone()}

    def pipeline(model: nn.Module) -> nn.Module:
        return causal_lm_pipeline(model, num_stages=stages)

    return VerifySetup(model=lambda: hf_model(family), batches=batches, pipeline=pipeline)
