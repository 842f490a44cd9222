"""``flops_profiler``: the example GPT's forward FLOPs, counted by torch's FLOP counter through
the engine, against the textbook count.

Per token, a forward through a decoder's matrices costs 2 N FLOPs (N = the parameters of the
linear layers: one multiply-add per weight), and attention adds 4 T C per layer (scores q k^T
and their product with v, each 2 T C, counted over the full T x T matrix as torch counts
causal kernels). Training costs 3 x forward (DeepSpeed's rule: backward = 2 x forward), so

    3 x fwd = 6 N_linear x tokens + 12 L T C x tokens      (exactly, integer FLOPs)

Against the usual 6 x params x tokens (params: everything but the embeddings, which do no
multiplication: norms included) the measured count may differ by at most the attention term,
12 L T C / (6 N) = 2 L T C / N of it: 8% for the tiny GPT below (T = 32, C = 64, L = 2), and
that is the tolerance. The profile is written once, by rank 0, in DeepSpeed's format.
"""

import re

from harness import run_distributed
from models import example_module

import shardwise
from shardwise.config import parse_config
from shardwise.monitor.flops import number

B, T, C, L, H, V = 2, 32, 64, 2, 4, 64


def _profile(out: str) -> dict:
    gpt = example_module("gpt", "model")
    model = gpt.GPT(gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
    config = {
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 1,
            "top_modules": 2,
            "output_file": out,
        },
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    ids = torch_randint(engine.global_rank)
    for _ in range(3):
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
    prof = engine.monitor.profiler
    if prof is None:
        return {"profiler": False}
    named = dict(model.named_modules())
    linear = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Linear")
    params = sum(p.numel() for n, p in model.named_parameters() if "emb" not in n)
    return {
        "profiler": True,
        "fwd": prof.get_total_flops(),
        "block0": prof.flops[named["blocks.0"]],
        "linear": linear,
        "params": params,
    }


def torch_randint(seed: int):
    import torch

    return torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))


def test_gpt_forward_flops_are_six_params_tokens_within_the_attention_term(tmp_path):
    out = tmp_path / "flops.txt"
    got = run_distributed(_profile, 2, str(out))
    assert not got[1]["profiler"], "rank 0 alone profiles"
    g, tokens = got[0], B * T
    attention = 12 * L * T * C * tokens
    assert 3 * g["fwd"] == 6 * g["linear"] * tokens + attention, g  # exact decomposition
    six_nd = 6 * g["params"] * tokens
    ratio = 3 * g["fwd"] / six_nd
    assert abs(3 * g["fwd"] - six_nd) <= attention, f"3 x fwd / 6ND = {ratio:.4f}"
    assert g["block0"] == 2 * 12 * C * C * tokens + 4 * T * C * tokens, "one block: linears + attn"
    text = out.read_text()
    assert "Profile Summary at step 1:" in text, text[:500]
    assert re.search(rf"\nfwd flops per GPU: +{number(g['fwd'])} *\n", text), text[:2000]
    assert "depth 3:" in text and "(attend): Attend(0 = 0% Params" in text, text
    print(f"GPT 3 x fwd FLOPs / (6 x params x tokens) = {ratio:.4f}")


def test_a_profile_step_the_run_never_reaches_is_accepted_as_in_deepspeed():
    # Megatron-DeepSpeed's ds_zero2_config_bf16.json ships "profile_step": -1; DeepSpeed takes it
    # (nothing is profiled), so refusing it would stop a real script before training.
    for step in (-1, 0):
        cfg = parse_config(
            {"train_batch_size": 2, "flops_profiler": {"enabled": True, "profile_step": step}}
        )
        assert cfg.flops_profiler.profile_step == step, f"profile_step={step}"
