"""Small Hugging Face models and batches for the equivalence tables (transformers is a dev extra).

Five families, each the shape a user meets in the field: Llama and Mistral (RoPE, grouped
query attention, SwiGLU), Qwen2 (tied embeddings, q/k/v biases), GPT-2 (``Conv1D`` layers with a
fused q|k|v projection, learned positions, tied head), BERT (post-norm encoder, masked LM).
Sizes are tiny (hidden 32, 2 blocks, 4 heads, vocabulary 64) and every dropout is 0, so the
only difference between layouts is the order of floating-point sums. Attention is "eager":
the same kernel in every layout.

``make_hf_model(family, seed)`` is deterministic; ``make_hf_batches(family, n, seq)`` gives
``n`` rows of ``{"input_ids", "labels"}``. For BERT exactly ``MASKED`` positions of each row are
masked, so that every micro-batch holds the same number of labelled tokens and the mean of
per-rank mean losses equals the mean over the global batch (as it does for causal LMs, whose
labels are the inputs).
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert")  # the equivalence tables; also "phi3"
CAUSAL = ("llama", "mistral", "qwen2", "gpt2")
VOCAB, HIDDEN, SEQ, MASKED, MASK_ID = 64, 32, 8, 2, 3


def _config(family: str):
    import transformers as tf

    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "llama":
        return tf.LlamaConfig(**decoder, tie_word_embeddings=False)
    if family == "phi3":  # fused qkv_proj and gate_up_proj: its plan gathers them (rowwise_rep)
        return tf.Phi3Config(**decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mistral":
        return tf.MistralConfig(**decoder, sliding_window=None, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**decoder, tie_word_embeddings=True)
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
    if family == "bert":
        return tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def make_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised model of ``family`` (same weights for the same seed)."""
    import transformers as tf

    config = _config(family)
    config._attn_implementation = "eager"
    classes = {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "phi3": tf.Phi3ForCausalLM,
        "bert": tf.BertForMaskedLM,
    }
    torch.manual_seed(seed)
    model = classes[family](config)
    # Zero-mean biases are a near-cancelling gradient case (design notes); give them a value.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.dim() == 1 and "norm" not in name.lower():
                p.normal_(0.0, 0.02)
    return model.train()


def make_hf_batches(family: str, n: int, seq: int = SEQ, seed: int = 5) -> dict:
    """``n`` rows of input ids and labels (labels are the inputs for causal LMs: Hugging Face
    shifts them inside the loss)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, seq), generator=g)
    if family != "bert":
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.full_like(ids, -100)
    where = torch.stack([torch.randperm(seq, generator=g)[:MASKED] for _ in range(n)])
    rows = torch.arange(n).unsqueeze(1).expand_as(where)
    labels[rows, where] = ids[rows, where]
    masked = ids.clone()
    masked[rows, where] = MASK_ID
    return {"input_ids": masked, "labels": labels}


def take(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def decay_groups(named, decay: float = 0.01) -> list[dict]:
    """The Hugging Face Trainer's grouping: no weight decay for biases and norm weights."""
    named = list(named)
    exempt = [p for n, p in named if n.endswith("bias") or "norm" in n]
    rest = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
    return [{"params": rest, "weight_decay": decay}, {"params": exempt, "weight_decay": 0.0}]
