"""The papers' numbers, reproduced by the planner (../shared/reference/papers.md).

- ZeRO (arXiv 1910.02054) Table 1: per-device model-state memory of 7.5B, 128B and 1T
  parameters at DP 1 to 1024, and worked example A (mixed precision and fp32 Adam), the
  uneven shard of 10,000,001 parameters, and section 7's communication volumes.
- PTD-P (arXiv 2104.04473) eq. 2: parameter counts of its Table 1 models and worked
  example F; the bubble (p - 1) / (m + p - 1) and the micro-batches each stage holds
  (worked example D, against the library's own schedules); p2p bytes with and without the
  scatter/gather (example E); Megatron's tensor-parallel volume 8 bsh (t - 1) / t per layer
  (example C).
- Korthikanti et al. (arXiv 2205.05198) Table 2: activation bytes of a Megatron layer traced
  on fake tensors: sbh (34 + 5as/h) without parallelism, sbh (10 + 24/t + 5as/(ht)) with
  tensor parallelism, 2sbh with full recompute.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.pipeline.schedule import make_schedule, peak_in_flight
from shardwise.plan import PRESETS, Dims, Layout, Options, Planner, build, read_model
from shardwise.plan.activations import trace_layers
from shardwise.plan.memory import model_states
from shardwise.plan.shape import ParamInfo
from shardwise.plan.traffic import by_axis, data_calls, pipeline_calls, tensor_calls

# ----------------------------------------------------------------------------- ZeRO memory
# Table 1, GB = 1e9 bytes: the exact formula values where the paper rounded (papers.md).
ZERO_TABLE = {
    # dp: {psi: (P_os, P_os+g, P_os+g+p)}
    1: {7.5e9: (120, 120, 120), 128e9: (2048, 2048, 2048), 1e12: (16000, 16000, 16000)},
    4: {7.5e9: (52.5, 41.25, 30), 128e9: (896, 704, 512), 1e12: (7000, 5500, 4000)},
    16: {7.5e9: (35.625, 21.5625, 7.5), 128e9: (608, 368, 128), 1e12: (4750, 2875, 1000)},
    64: {7.5e9: (31.406, 16.641, 1.875), 128e9: (536, 284, 32), 1e12: (4187.5, 2218.75, 250)},
    256: {7.5e9: (30.352, 15.410, 0.46875), 128e9: (518, 263, 8), 1e12: (4046.875, 2054.69, 62.5)},
    1024: {7.5e9: (30.088, 15.103, 0.117), 128e9: (513.5, 257.75, 2), 1e12: (4011.72, 2013.67, 15.625)},
}  # fmt: skip


def _states_total(psi: int, dp: int, stage: int, precision: str, opts: Options) -> int:
    params = [ParamInfo((psi,), "model")]
    s = model_states(params, Layout(dp, 1, 1, stage, 1, 1), precision, opts)
    return s.params + s.grads + s.optimizer


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE))
def test_zero_table_1(dp):
    """Mixed-precision Adam (2 + 2 + 12 bytes), one bucket as the paper's ideal (the
    planner's default buckets add under dp elements of padding each: checked below)."""
    for psi, row in ZERO_TABLE[dp].items():
        opts = Options(bucket_elements=int(psi))
        for stage, paper in zip((1, 2, 3), row, strict=True):
            got = _states_total(int(psi), dp, stage, "bf16", opts) / 1e9
            digits = max(len(str(paper).partition(".")[2]), 0)
            assert round(got, digits) == pytest.approx(paper, abs=10**-digits), (
                f"psi={psi:g} dp={dp} stage {stage}: {got} GB, paper {paper}"
            )


def test_zero_worked_example_a_and_padding():
    psi, n = 10_000_000, 4
    opts = Options(bucket_elements=psi)
    mixed = [_states_total(psi, n, s, "bf16", opts) for s in (0, 1, 2, 3)]
    fp32 = [_states_total(psi, n, s, "fp32", opts) for s in (0, 1, 2, 3)]
    assert mixed == [160_000_000, 70_000_000, 55_000_000, 40_000_000]
    assert fp32 == [160_000_000, 100_000_000, 70_000_000, 40_000_000]
    # Uneven: 10,000,001 on 4 ranks is a shard of 2,500,001 (padding 3): 16 bytes each.
    assert _states_total(10_000_001, 4, 3, "fp32", Options()) == 16 * 2_500_001
    # The default 4 Mi-element buckets pad each bucket to a multiple of dp: < dp elements.
    buckets = math.ceil(psi / Options().bucket_elements)
    extra = _states_total(psi, n, 1, "bf16", Options()) - 70_000_000
    assert 0 <= extra < buckets * n * 16, extra


def test_zero_communication_volumes():
    """Section 7 with the ring counts of papers.md: elements sent per rank per step, Psi =
    10M on 4 ranks: DP 15M; ZeRO-1 and -2 the same; ZeRO-3 1.5x (gathers in forward and
    backward, then the reduce-scatter)."""
    psi, n = 10_000_000, 4
    params = [ParamInfo((psi,), "model")]
    opts = Options(bucket_elements=psi, persistence_threshold=0)
    sent = {}
    for stage in (0, 1, 2, 3):
        calls = data_calls(params, Layout(n, 1, 1, stage, 1, 1), "fp32", opts, set())
        sent[stage] = by_axis(calls)["data"] // 4
    assert sent == {0: 15_000_000, 1: 15_000_000, 2: 15_000_000, 3: 22_500_000}


# ----------------------------------------------------------------------------- PTD-P
class MegatronLayer(nn.Module):
    """A GPT layer as PTD-P and Korthikanti et al. count it: biases everywhere, fused q|k|v,
    softmax attention with dropout on the probabilities, GELU MLP of 4h, two dropouts."""

    def __init__(self, h: int, a: int, p: float = 0.1) -> None:
        super().__init__()
        self.a, self.p = a, p
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # x (s, b, h), Megatron's order
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(s, b * self.a, 3 * h // self.a).chunk(3, -1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (b a, s, d)
        att = F.dropout(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1), self.p)
        y = (att @ v).transpose(0, 1).reshape(s, b, h)
        x = x + F.dropout(self.proj(y), self.p)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln_2(x)))), self.p)


class MegatronGPT(nn.Module):
    """Eq. 2's model: learned positions, tied output layer, and a final layernorm."""

    def __init__(self, layers: int, h: int, a: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.Sequential(*[MegatronLayer(h, a) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(h)


PTDP_TABLE_1 = [  # (billions as printed, heads, hidden, layers); V = 51,200, s = 2,048
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96), (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128),
]  # fmt: skip


def _eq2(l: int, h: int, vocab: int, seq: int) -> int:  # noqa: E741 - the paper's name
    return 12 * l * h * h + 13 * l * h + (vocab + seq) * h


@pytest.mark.parametrize("billions,heads,hidden,layers", PTDP_TABLE_1)
def test_ptdp_parameter_counts(billions, heads, hidden, layers):
    with torch.device("meta"):
        shape = read_model(MegatronGPT(layers, hidden, heads, 51_200, 2048))
    assert shape.numel == _eq2(layers, hidden, 51_200, 2048) + 2 * hidden  # + final norm
    assert round(shape.numel / 1e9, 1) == billions


# The planner's decoders (no biases), l = 2, h = 64, V = 1000, s = 32: --arch gpt
# 12lh^2 + 2lh + (V + s)h + h tied (GPT-2 and Megatron, the default), + Vh untied; Llama
# (f = 256 x ceil(8h/3 / 256) = 256, no positions): l(4h^2 + 3hf + 2h) + Vh + h tied, + Vh
# untied (its default).
GPT_TIED = 12 * 2 * 64**2 + 2 * 2 * 64 + (1000 + 32) * 64 + 64
LLAMA_TIED = 2 * (4 * 64**2 + 3 * 64 * 256 + 2 * 64) + 1000 * 64 + 64
TIES = [
    ("gpt default", "gpt", None, GPT_TIED),
    ("gpt untied", "gpt", False, GPT_TIED + 1000 * 64),
    ("gpt tied", "gpt", True, GPT_TIED),
    ("llama default", "llama", None, LLAMA_TIED + 1000 * 64),
    ("llama tied", "llama", True, LLAMA_TIED),
]


def test_ptdp_worked_example_f():
    with torch.device("meta"):
        assert read_model(MegatronGPT(2, 64, 4, 1000, 32)).numel == 166_144  # 166,016 + 128


@pytest.mark.parametrize("name,arch,tie,numel", TIES, ids=[t[0] for t in TIES])
def test_tie_embeddings_flag(name, arch, tie, numel):
    d = Dims(layers=2, hidden=64, heads=4, vocab=1000, seq=32, arch=arch, tie_embeddings=tie)
    assert read_model(build(d)).numel == numel, name


def _free_comm():
    """A cluster where communication and the update cost nothing: only the bubble remains."""
    return replace(
        PRESETS["a100-80g"], intra_gbps=1e12, inter_gbps=1e12, latency_us=0, optimizer_gbps=1e18
    )


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16), (4, 1)])
def test_ptdp_bubble_and_in_flight_worked_example_d(p, m):
    d = Dims(layers=8, hidden=64, heads=4, vocab=64, seq=16)
    planner = Planner(read_model(build(d)), _free_comm(), m, 16, "fp32")
    for schedule in ("1f1b", "gpipe"):
        lay = Layout(1, 1, p, 0, 1, m, schedule=schedule)
        rec = planner.evaluate(lay)
        assert rec["bubble"] == pytest.approx((p - 1) / (m + p - 1)), (p, m, schedule)
        for s in range(p):  # what the library's own schedule holds at its peak
            want = peak_in_flight(make_schedule(schedule, p, s, m))
            assert planner.in_flight(lay, s) == want, (p, m, schedule, s)


def test_ptdp_worked_examples_c_and_e():
    """C: b 2, s 16, h 64, t 2, two layers: 8 bsh (t-1)/t = 8,192 elements per layer sent per
    device (two all-reduces forward, two backward). E: b s h = 2,048 elements between stages
    per micro-batch, 1,024 with the scatter/gather."""
    d = Dims(layers=2, hidden=64, heads=4, vocab=64, seq=16)
    tr = trace_layers(read_model(build(d)), 2, 16, torch.float32)
    sites = [s for layer in tr.layers[1:3] for s in layer.tp_sites]
    calls = tensor_calls(sites, [], Layout(1, 2, 1, 0, 2, 1), "fp32", False)
    assert sum(c.sent for c in calls) == 4 * 2 * 8_192
    assert sorted(c.op for c in calls) == ["all_reduce"] * 8
    for tp, elements in ((1, 2048), (2, 1024)):
        calls = pipeline_calls(Layout(1, tp, 2, 0, 2, 1), 0, 0, 2048 * 4, 3, 4)
        assert [c.payload for c in calls if c.op == "send"][0] == 4 * elements, tp


# ----------------------------------------------------------------------------- Korthikanti
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_table_2(t):
    """One layer in 16 bits, s 512, b 2, h 1024, a 16, traced on fake CPU tensors: within 1%
    of the table (the layernorms' fp32 statistics, 16 sb bytes, are not in it) once the
    kernel's own choice is counted: on CPU, dropout keeps its mask in the input's dtype (2
    bytes) where the GPU kernel the table counts keeps one byte, so the three masks add
    as^2 b (attention, split by TP) + 2 sbh (after the two row layers, split by SP only)."""
    s, b, h, a = 512, 2, 1024, 16
    with torch.device("meta"):
        shape = read_model(nn.Sequential(MegatronLayer(h, a)))
    shape.styles.update({"0.qkv": "colwise", "0.proj": "rowwise", "0.fc": "colwise"})
    shape.styles["0.fc2"] = "rowwise"
    layer = _trace_sbh(shape, s, b, h)
    sbh, attn = s * b * h, 5 * a * s / h
    cpu_masks = a * s * s * b / t + 2 * sbh
    want = sbh * (10 + 24 / t + attn / t) + cpu_masks
    assert layer.plain.per_rank(t, False) == pytest.approx(want, rel=0.01), "TP"
    # Sequence parallelism as the library runs it: the column layers keep their all-gathered
    # input (4 sbh) where Megatron stores the shard and gathers it again in backward.
    want_sp = sbh * (34 / t + attn / t) + 4 * sbh * (t - 1) / t + a * s * s * b / t + 2 * sbh / t
    assert layer.plain.per_rank(t, True) == pytest.approx(want_sp, rel=0.01), "TP + SP"
    assert layer.checkpointed.per_rank(t, False) == 2 * sbh  # full recompute: the input


def _trace_sbh(shape, s, b, h):
    """Trace the layer on an (s, b, h) input: its only layer, fed by a float input."""

    class _Input(nn.Module):  # a first layer that turns (b, s) ids into an (s, b, h) input
        def forward(self, ids):
            return torch.zeros(s, b, h, dtype=torch.float16)

    shape.callables.insert(0, _Input())
    shape.layers.insert(0, replace(shape.layers[0], kind="input", params=[]))
    return trace_layers(shape, b, s, torch.float16).layers[1]
