"""MoE gate noise by statistics (docs/moe.md): for fixed logits and many draws, the chosen
experts follow the distribution DeepSpeed 0.19's rule defines (deepspeed/moe/sharded_moe.py):

- Gumbel-max: with g ~ Gumbel(0, 1) iid, argmax_e (l_e + g_e) is expert e with probability
  softmax(l)_e. So top-1 with ``noisy_gate_policy="RSample"`` picks e with softmax(l)_e, and
  top-2's sampled second choice, the argmax over the experts other than the first f, is e
  with exp(l_e) / sum_{j != f} exp(l_j).
- "Jitter" multiplies the router's input (not its logits) by U(1 - 1e-2, 1 + 1e-2) per element.
- Noise in training only, except top-2's second-expert sampling, which DeepSpeed applies in
  eval too (``TopKGate.forward`` passes ``top2_2nd_expert_sampling`` whatever the mode).

Statistics: Pearson's chi-square of N draws against the expected counts, df = cells - 1, bound
= the (1 - ALPHA) quantile of chi2(df). ALPHA = 1e-6: a correct gate fails one seed in 10^6
per case. Checked while writing the test over 600 seeds for each of the 14 chi-square cases:
at 1e-5 one of the 8,400 runs failed (chi2 26.6 against 23.0, df 2), at 1e-6 none (largest
statistic 0.96 of its bound, the next 0.77). The broken noise this file was written for
(NaN Gumbel noise, every sampled choice on expert 0 or 1) gives statistics above 4,000
against bounds below 40. Seeds are fixed, so the test is deterministic. scipy comes with
scikit-learn (the dev extra).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2

from shardwise.moe.layer import MoE
from shardwise.parallel.moe import gating
from shardwise.parallel.moe.gating import TopKGate, top1gating, top2gating

ALPHA = 1e-6
DRAWS = 20_000  # tokens sharing one logits row: each is one independent draw
# Capacity is irrelevant to the choices (exp_counts counts them before dropping); a tiny
# factor keeps the (S, E, C) combine weights small.
TINY_FACTOR, MIN_CAP = 1e-4, 1

# (name, logits row): the first choice (argmax) is expert 0 in some rows and not in others,
# since the broken noise sent every sampled choice to expert 0 (or 1 when 0 was first).
ROWS = [
    ("peaked-first-0", [3.0, 1.0, 0.0, -1.0]),
    ("first-is-last", [-1.0, 0.5, 0.2, 2.0]),
    ("near-flat", [0.1, 0.0, 0.0, 0.0]),
    ("eight-experts", [0.3, -0.2, 1.5, 0.0, -1.0, 0.8, 0.4, -0.5]),
]


def chi_square(counts: torch.Tensor, probs: torch.Tensor, case: str) -> None:
    """Cells of probability 0 must be empty; the others pass Pearson's test at ALPHA."""
    counts, probs = counts.double(), probs.double()
    assert float(counts[probs == 0].sum()) == 0, f"{case}: draws in impossible cells {counts}"
    n, live = counts.sum(), probs > 0
    want = n * probs[live] / probs[live].sum()
    stat = float(((counts[live] - want) ** 2 / want).sum())
    df = int(live.sum()) - 1
    if df == 0:  # a point mass: the empty impossible cells above were the whole test
        return
    bound = chi2.ppf(1 - ALPHA, df)
    assert stat <= bound, (
        f"{case}: counts {counts.tolist()} vs expected {want.round().tolist()}: "
        f"chi2 {stat:.1f} > {bound:.1f} (df {df}, alpha {ALPHA})"
    )


def second_choice_probs(row: torch.Tensor) -> torch.Tensor:
    """P(second = e | first = argmax): softmax over the other experts, 0 at the first."""
    return torch.softmax(row.masked_fill(row == row.max(), float("-inf")), dim=0)


def tokens(row: list[float]) -> torch.Tensor:
    return torch.tensor(row).repeat(DRAWS, 1)


@pytest.mark.parametrize("name,row", ROWS, ids=[r[0] for r in ROWS])
def test_top2_second_choice_is_a_softmax_sample_over_the_other_experts(name, row):
    torch.manual_seed(11)
    logits = tokens(row)
    _, _, _, counts = top2gating(logits, TINY_FACTOR, MIN_CAP, True, None, True)
    first = int(torch.tensor(row).argmax())
    assert int(counts[first]) == DRAWS, f"{name}: first choice is argmax, second never it"
    second = counts.clone()
    second[first] = 0
    chi_square(second, second_choice_probs(torch.tensor(row)), f"top-2 sampling {name}")


@pytest.mark.parametrize("name,row", ROWS, ids=[r[0] for r in ROWS])
def test_rsample_top1_choice_is_a_softmax_sample(name, row):
    torch.manual_seed(12)
    _, _, _, counts = top1gating(tokens(row), TINY_FACTOR, MIN_CAP, "RSample")
    chi_square(counts, torch.softmax(torch.tensor(row), 0), f"RSample {name}")


def test_gumbel_noise_is_gumbel_0_1_and_finite():
    """Equiprobable bins of Gumbel(0, 1) (quantile q_p = -log(-log p)) hold equal counts."""
    torch.manual_seed(13)
    g = gating.gumbel_noise(torch.Size([100_000]), torch.device("cpu"))
    assert torch.isfinite(g).all(), "Gumbel noise has NaN or inf"
    bins = 20
    edges = -torch.log(-torch.log(torch.arange(1, bins) / bins))
    counts = torch.bincount(torch.bucketize(g, edges), minlength=bins)
    chi_square(counts, torch.full((bins,), 1.0 / bins), "Gumbel(0,1) quantile bins")
    # Mean: Euler's gamma; the standard error is pi / sqrt(6 * 1e5) = 0.004, so 0.02 is 5 sigma.
    assert abs(float(g.mean()) - 0.5772) < 0.02, f"Gumbel mean {float(g.mean())}"


def identity_gate(num_experts: int, **kw) -> TopKGate:
    """A gate whose logits are its input: wg = I (model_dim = E)."""
    gate = TopKGate(num_experts, num_experts, min_capacity=MIN_CAP, **kw)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(num_experts))
    return gate


ROW = ROWS[0][1]
P_FIRST = torch.softmax(torch.tensor(ROW), 0)
ARGMAX = torch.nn.functional.one_hot(torch.tensor(0), 4).double()
P_SECOND = second_choice_probs(torch.tensor(ROW))
RUNNER_UP = torch.nn.functional.one_hot(torch.tensor(1), 4).double()
# (name, k, gate keywords, training, expected distribution of the choice counted): which
# mode applies which noise, DeepSpeed 0.19's TopKGate.forward.
MODES = [
    ("top1-rsample-train", 1, {"noisy_gate_policy": "RSample"}, True, P_FIRST),
    ("top1-rsample-eval", 1, {"noisy_gate_policy": "RSample"}, False, ARGMAX),
    ("top1-none-train", 1, {}, True, ARGMAX),
    ("top2-sampling-train", 2, {}, True, P_SECOND),
    ("top2-sampling-eval", 2, {}, False, P_SECOND),
    ("top2-no-sampling-train", 2, {"top2_2nd_expert_sampling": False}, True, RUNNER_UP),
    ("top2-rsample-ignored", 2, {"noisy_gate_policy": "RSample"}, True, P_SECOND),
]


@pytest.mark.parametrize("name,k,kw,training,probs", MODES, ids=[m[0] for m in MODES])
def test_the_gate_applies_noise_in_deepspeeds_modes(name, k, kw, training, probs):
    gate = identity_gate(
        4, k=k, capacity_factor=TINY_FACTOR, eval_capacity_factor=TINY_FACTOR, **kw
    )
    gate.train(training)
    torch.manual_seed(14)
    _, _, _, counts = gate(tokens(ROW))
    if k == 2:  # the second choice: the first (expert 0, the argmax) is taken by every token
        assert int(counts[0]) == DRAWS, f"{name}: first choice"
        counts = counts.clone()
        counts[0] = 0
    chi_square(counts, probs, name)


def captured_logits(monkeypatch, gate: TopKGate, x: torch.Tensor) -> torch.Tensor:
    """The logits the gate hands to top1gating."""
    seen = []
    real = gating.top1gating

    def spy(logits, *args):
        seen.append(logits.detach().clone())
        return real(logits, *args)

    monkeypatch.setattr(gating, "top1gating", spy)
    gate(x)
    return seen[0]


def test_jitter_multiplies_the_router_input_by_uniform_1_plus_minus_1e_2(monkeypatch):
    """wg = [I; I] (E = 2M): logits[:, :M] = logits[:, M:] = x * u if the noise u is on the
    input (noise on the logits would differ between the halves); u = logits / x is then
    U(0.99, 1.01): in range, and uniform over 10 bins. Eval: no jitter, logits = x."""
    m = 64
    gate = TopKGate(m, 2 * m, noisy_gate_policy="Jitter", min_capacity=MIN_CAP)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.cat([torch.eye(m), torch.eye(m)]))
    x = torch.rand(256, m, generator=torch.Generator().manual_seed(0)) + 0.5  # away from 0
    torch.manual_seed(15)
    logits = captured_logits(monkeypatch, gate, x)
    assert torch.equal(logits[:, :m], logits[:, m:]), "jitter must act on the input, not logits"
    u = logits[:, :m] / x
    # x * u then / x: 2 roundings of fp32, 2.4e-7 relative at most.
    assert float(u.min()) >= 0.99 - 3e-7 and float(u.max()) <= 1.01 + 3e-7, "out of range"
    assert float((u == 1).float().mean()) < 0.01, "no jitter applied"
    bins = torch.bucketize(u.flatten(), torch.linspace(0.99, 1.01, 11)[1:-1])
    chi_square(torch.bincount(bins, minlength=10), torch.full((10,), 0.1), "jitter factors")
    gate.eval()
    assert torch.equal(captured_logits(monkeypatch, gate, x)[:, :m], x), "eval must not jitter"


POLICIES = [None, "Jitter", "RSample"]
# (k, top2_2nd_expert_sampling, training, input scale): large inputs saturate the softmax.
FINITE = [
    (k, s, t, scale)
    for k in (1, 2)
    for s in (True, False)
    for t in (True, False)
    for scale in (1.0, 1e3)
    if k == 2 or s
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("k,sampling,training,scale", FINITE)
def test_no_nan_in_gates_combine_weights_or_l_aux(policy, k, sampling, training, scale):
    case = f"policy={policy} k={k} sampling={sampling} training={training} scale={scale}"
    torch.manual_seed(16)
    layer = MoE(8, torch.nn.Linear(8, 8), 4, k=k, noisy_gate_policy=policy,
                top2_2nd_expert_sampling=sampling, use_residual=True)  # fmt: skip
    layer.train(training)
    x = torch.randn(3, 40, 8) * scale
    l_aux, combine, dispatch, counts = layer.deepspeed_moe.gate(x.reshape(-1, 8))
    out, *_ = layer(x)
    for what, t in (("l_aux", l_aux), ("combine", combine), ("output", out)):
        assert torch.isfinite(t).all(), f"{case}: {what} not finite"
    per_token = combine.sum(dim=(1, 2))
    assert bool(((per_token >= 0) & (per_token <= 1 + 1e-6)).all()), f"{case}: weights > 1"
    assert int(counts.sum()) == 120 * k, f"{case}: {counts.tolist()} routed"


def seeded(layer: MoE) -> MoE:
    """Distinct weights for every expert, the residual MLP and the coefficient."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7)
    return layer


def by_hand(layer: MoE, x_sm: torch.Tensor, k: int) -> torch.Tensor:
    """Each token through its top-k experts (no noise, no dropping), weighted by its gates
    renormalised over the chosen ones (top-1: the gate value itself)."""
    gates = torch.softmax(x_sm @ layer.deepspeed_moe.gate.wg.weight.T, dim=-1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for x_m, g in zip(x_sm, gates, strict=True):
        top = g.topk(k).indices
        weights = g[top] / (g[top].sum() if k == 2 else 1.0)
        rows.append(sum(w * experts[int(e)](x_m) for w, e in zip(weights, top, strict=True)))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2], ids=["top1", "top2"])
def test_use_residual_is_deepspeeds_coefficient_mix(k):
    """output = moe_out * coef[..., 0:1] + mlp(x) * coef[..., 1:], coef = softmax(coefficient(x))
    (deepspeed/moe/layer.py MoE.forward), moe_out built here from the gate and experts.
    Eval, capacity 8 x the tokens, no sampling: nothing is random or dropped."""
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    layer = seeded(MoE(8, expert, 4, k=k, eval_capacity_factor=8.0, use_residual=True,
                       top2_2nd_expert_sampling=False))  # fmt: skip
    layer.eval()
    x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, _, _ = layer(x)
        moe_out = by_hand(layer, x.reshape(-1, 8), k).reshape(x.shape)
        coef = torch.softmax(layer.coefficient(x), dim=-1)
        want = moe_out * coef[..., 0:1] + layer.mlp(x) * coef[..., 1:]
    assert layer.mlp is expert, f"k={k}: the residual MLP is the expert module given"
    assert float(coef[..., 0].std()) > 0.05, f"k={k}: a constant coefficient tests nothing"
    # The same products summed in another order: a few fp32 ulps of outputs of size ~1.
    diff = float((out - want).abs().max())
    assert diff <= 1e-5, f"k={k}: output differs from DeepSpeed's formula by {diff:.2e}"
    assert not torch.allclose(out, moe_out, atol=1e-3), f"k={k}: the residual changed nothing"


# DeepSpeed itself, where it is installed (the bench extra; never part of the test install).
@pytest.fixture(scope="module")
def sharded_moe():
    pytest.importorskip("deepspeed", reason="deepspeed not installed (pip install -e .[bench])")
    from deepspeed.moe import sharded_moe

    return sharded_moe


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor, case: str) -> None:
    """Two histograms from one distribution: sum (k_a a - k_b b)^2 / (a + b), k_a =
    sqrt(N_b / N_a), k_b = 1 / k_a, is chi2 with (non-empty cells - 1) df; bound at ALPHA."""
    a, b = a.double(), b.double()
    live = (a + b) > 0
    ka = math.sqrt(float(b.sum() / a.sum()))
    stat = float(((ka * a[live] - b[live] / ka) ** 2 / (a[live] + b[live])).sum())
    df = int(live.sum()) - 1
    bound = chi2.ppf(1 - ALPHA, df) if df else 0.0
    assert stat <= bound, (
        f"{case}: DeepSpeed {a.tolist()} vs ours {b.tolist()}: chi2 {stat:.1f} > {bound:.1f} "
        f"(df {df}, alpha {ALPHA})"
    )


@pytest.mark.parametrize("k", [1, 2], ids=["rsample-top1", "sampled-top2"])
@pytest.mark.parametrize("name,row", ROWS, ids=[r[0] for r in ROWS])
def test_choice_histograms_agree_with_deepspeeds(sharded_moe, k, name, row):
    """Independent draws (other seeds) of DeepSpeed's top1gating / top2gating and ours on the
    same logits: the exp_counts histograms come from one distribution."""
    logits = tokens(row)
    torch.manual_seed(21)
    if k == 1:
        theirs = sharded_moe.top1gating(
            logits.clone(), TINY_FACTOR, MIN_CAP, noisy_gate_policy="RSample"
        )
    else:  # DeepSpeed adds the noise to its argument in place: give it a copy
        theirs = sharded_moe.top2gating(logits.clone(), TINY_FACTOR, MIN_CAP)
    torch.manual_seed(22)
    if k == 1:
        ours = top1gating(logits, TINY_FACTOR, MIN_CAP, "RSample")
    else:
        ours = top2gating(logits, TINY_FACTOR, MIN_CAP)
    two_sample_chi_square(theirs[3].cpu(), ours[3], f"k={k} {name}")


# (k, noisy_gate_policy, top2_2nd_expert_sampling, training)
SAME_SEED = [
    (k, policy, sampling, training)
    for k in (1, 2)
    for policy in POLICIES
    for sampling in (True, False)
    for training in (True, False)
    if k == 2 or sampling
]


@pytest.mark.parametrize("k,policy,sampling,training", SAME_SEED)
def test_same_seed_routes_exactly_as_deepspeeds_gate(sharded_moe, k, policy, sampling, training):
    """Same weights, same seed: DeepSpeed's TopKGate and ours draw the same noise (Gumbel,
    jitter, random token selection, in the same order), so every output is equal."""
    case = f"k={k} policy={policy} sampling={sampling} training={training}"
    theirs = sharded_moe.TopKGate(8, 4, k, 0.5, 0.5, 2, policy, True, True, None, sampling)
    ours = TopKGate(8, 4, k, 0.5, 0.5, 2, policy, True, True, sampling)
    with torch.no_grad():
        ours.wg.weight.copy_(theirs.wg.weight)
    theirs.train(training)
    ours.train(training)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(23)
    want = theirs(x)
    torch.manual_seed(23)
    got = ours(x)
    for what, w, g in zip(("l_aux", "combine", "dispatch", "exp_counts"), want, got, strict=True):
        assert torch.equal(w.cpu(), g), f"{case}: {what} differs from DeepSpeed's"
    assert int(want[2].sum()) < 64 * k, f"{case}: nothing dropped; random selection untested"
