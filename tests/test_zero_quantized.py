"""ZeRO++ quantized communication: int8 weight all-gather (qwZ) and int4 gradient all-to-all
(qgZ) train close to one process, within a tolerance derived from the quantizer's bound.

The bound (shardwise/parallel/zero/blockquant.py): every dequantized element is within s/2 of
its value, s = (block's max |x|) / q_max: eps_w = 1/254 of a block's largest weight (int8),
eps_g = 1/14 of a block's largest gradient (int4), summed over the N-1 chunks that travel.

Tolerance of the 30-step runs against one process (first order in the errors):
- qwZ: every forward and backward runs on weights within eps_w (relative to their block's max)
  of the masters; each of the L = 3 linear layers moves its output by at most eps_w of its
  scale (tanh is 1-Lipschitz), and the MSE moves by twice the output's relative error:
  2 L eps_w = 2.4% per step. The masters themselves stay exact.
- qgZ: the mean gradient is off by at most (N-1)/N eps_g = 3.6% (N = 2) of its block's max;
  on the loss, an error e in a step's gradient changes that step's decrease (lr |g|^2) by at
  most lr |g| |e|, i.e. by eps_g of the decrease; the decreases the updates make add up to at
  most L_0 (an MSE cannot fall below 0), so the loss at step t moves by at most (N-1)/N eps_g
  L_0: relative to L_t, 3.6% x L_0 / L_t, up to 15% here (losses fall 4x in 30 steps).
- tolerance(t) = 2 L eps_w [qwZ] + (N-1)/N eps_g L_0 / L_t [qgZ], of each step's
  loss L_t. Measured over 30 steps (worst step): qwZ 0.5%, qgZ 0.3%, both 0.6% (dp4: 0.6%),
  stage 2 qgZ 1.1%; 200 steps both against unquantized 1.5% (bar: 2%). A misplaced or
  unscaled shard is off by 20-100%.
Parameters are checked through the loss (they are what the loss measures) and by staying
identical on every rank: quantization is deterministic, so ranks must not diverge.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import TinyMLP, rank_slice
from one_process import global_batches, reference_run
from verify_cases import run_script

import shardwise
from shardwise import comm
from shardwise.parallel.zero import blockquant as bq
from shardwise.parallel.zero.quantized_comm import QuantizedGather, quantized_reduce_scatter
from shardwise.verify import VerifySetup
from shardwise.verify.compare import FP32, QUANTIZED, compare
from shardwise.verify.results import load_result
from shardwise.verify.setup import load_setup
from shardwise.verify.worker import run_reference, write_initial_weights

EPS_W, EPS_G = 1 / (2 * 127), 1 / (2 * 7)  # s/2 relative to a block's max: int8, int4
MB = 8
SGD = {"type": "SGD", "params": {"lr": 0.05}}


# ----------------------------------------------------------------------------- the quantizer
def _values(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "outlier":  # one huge element: the rest of its block quantizes to ~0
        x[n // 2] = 1e4
    elif kind == "zeros":
        x.zero_()
    elif kind == "tiny":
        x *= 1e-30
    return x


# (bits, block, n, kind): blocks exact and ragged, n odd (int4 half bytes), one element
QUANT_CASES = [
    (bits, block, n, kind)
    for bits, block in ((8, bq.WEIGHT_BLOCK), (4, bq.GRAD_BLOCK), (4, 2), (8, 6))
    for n, kind in ((1, "normal"), (7, "normal"), (5000, "normal"), (1025, "outlier"),
                    (64, "zeros"), (33, "tiny"))
]  # fmt: skip


@pytest.mark.parametrize("bits,block,n,kind", QUANT_CASES)
def test_every_element_within_half_a_scale(bits, block, n, kind):
    tag = f"int{bits} block {block}, {n} {kind} values"
    x = _values(kind, n)
    q, scales = bq.quantize(x, bits, block)
    assert q.dtype == torch.int8 and q.abs().max() <= 2 ** (bits - 1) - 1, tag
    per_element = scales.repeat_interleave(block)[:n]
    err = (bq.dequantize(q, scales, block) - x).abs()
    # s/2, plus the fp32 rounding of x/s and of q*s (a few ulps of |x|)
    assert (err <= per_element / 2 + 4 * 2**-24 * x.abs()).all(), f"{tag}: max err {err.max()}"
    maxima = torch.nn.functional.pad(x.abs(), (0, len(scales) * block - n)).view(-1, block)
    want = maxima.amax(1) / (2 ** (bits - 1) - 1)
    want = torch.where(want > 0, want, torch.ones_like(want))
    assert torch.equal(scales, want), f"{tag}: scale is not the block's max / q_max"
    payload = bq.pack(x, bits, block)
    assert payload.dtype == torch.uint8, tag
    assert payload.numel() == bq.payload_bytes(n, bits, block), tag
    assert torch.equal(bq.unpack(payload, n, bits, block), bq.dequantize(q, scales, block)), tag


@pytest.mark.parametrize("bits,block", [(3, 512), (8, 0), (4, 7)])
def test_bad_bits_or_block_refused(bits, block):
    with pytest.raises(ValueError, match="bits|block"):
        bq.quantize(torch.ones(4), bits, block)


def test_payloads_are_a_quarter_and_an_eighth_of_fp32():
    n = 1 << 20
    assert bq.payload_bytes(n, 8, bq.WEIGHT_BLOCK) / (4 * n) == pytest.approx(0.25, abs=1e-3)
    assert bq.payload_bytes(n, 4, bq.GRAD_BLOCK) / (4 * n) == pytest.approx(0.125, abs=3e-3)


# ----------------------------------------------------------------------------- the collectives
def _collectives(n: int) -> dict:
    """Both collectives on 2 ranks, against their exact forms."""
    rank, world = comm.get_rank(), comm.get_world_size()
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(n, generator=g)
    full = torch.empty(world * n)
    QuantizedGather(None)(full, shard).wait()
    exact = torch.empty(world * n)
    comm.all_gather_into_tensor(exact, shard)
    send = torch.randn(world * n, generator=g)
    out, exact_out = torch.empty(n), torch.empty(n)
    quantized_reduce_scatter(out, send, None).wait()
    comm.reduce_scatter_tensor(exact_out, send.clone())
    # the bound: (N-1) others' chunks, each element within s/2 of its sender's block
    chunks = [torch.empty(world * n) for _ in range(world)]
    comm.all_gather(chunks, send)
    others = [c.view(world, n)[rank] for r, c in enumerate(chunks) if r != rank]
    bound = sum(bq.quantize(c, 4, bq.GRAD_BLOCK)[1].repeat_interleave(bq.GRAD_BLOCK)[:n] / 2
                for c in others)  # fmt: skip
    return {"full": full, "exact": exact, "out": out, "exact_out": exact_out, "bound": bound}


def test_collectives_stay_within_the_bound_and_agree_across_ranks():
    n = 1500  # 3 gradient blocks, the last ragged
    a, b = run_distributed(_collectives, 2, n)
    assert torch.equal(a["full"], b["full"]), "qwZ: ranks gathered different weights"
    scale = a["exact"].view(2, n).abs().amax(1).repeat_interleave(n) / 127
    assert ((a["full"] - a["exact"]).abs() <= scale / 2 * (1 + 1e-6)).all(), "qwZ beyond s/2"
    for rank, got in enumerate((a, b)):
        err = (got["out"] - got["exact_out"]).abs()
        assert (err <= got["bound"] * (1 + 1e-5) + 1e-6).all(), f"qgZ rank {rank} beyond bound"
        assert err.max() > 0, f"qgZ rank {rank}: nothing quantized; the test is void"


# ----------------------------------------------------------------------------- training
def teacher_data(n: int):
    """A learnable task: y = teacher(x), the teacher a fixed random TinyMLP."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    torch.manual_seed(7)
    with torch.no_grad():
        y = TinyMLP(hidden=32)(x)
    return x, y


def student() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP(hidden=48)


def train(dp: int, gas: int, steps: int, zero: dict) -> dict:
    """Each rank trains ``student`` on its rows of every global batch; losses (global mean per
    step), final parameters, and the bytes and dtypes of the gathers and all-to-alls."""
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": SGD,
        "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero},
    }
    engine, *_ = shardwise.initialize(model=student(), config=config)
    x, y = teacher_data(MB * dp * gas * steps)
    rec = comm.recorder()
    was, rec.enabled = rec.enabled, True
    # The harness's worlds outlive a test: earlier calls are in the ring. Held alive here so
    # that no new call takes one's id.
    before = rec.recent()
    old = {id(c) for c in before}
    comm.reset_stats()
    losses = []
    try:
        for k in range(steps):
            total = torch.zeros(())
            for j in range(gas):
                rows = rank_slice(k, j, engine.dp_rank, MB, dp, gas)
                loss = F.mse_loss(engine(x[rows]), y[rows])
                engine.backward(loss)
                engine.step()
                total += loss.detach() / gas
            comm.all_reduce(total)
            losses.append(total.item() / dp)
        stats = comm.stats()
        dtypes: dict[str, set] = {}
        sizes: dict[str, set] = {}
        for c in (c for c in rec.recent() if id(c) not in old):
            dtypes.setdefault(c.op, set()).update(str(d).removeprefix("torch.") for d in c.dtypes)
            sizes.setdefault(c.op, set()).add(len(c.group.ranks))
    finally:
        rec.enabled = was
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "params": params, "stats": stats, "dtypes": dtypes, "sizes": sizes}


def on_nodes_of_two(fn, *args):
    """``fn`` with 2 processes per node (DeepSpeed's NDEV_PER_NODE; only the two-hop layouts
    read it)."""
    import os

    os.environ["NDEV_PER_NODE"] = "2"
    try:
        return fn(*args)
    finally:
        del os.environ["NDEV_PER_NODE"]


def reference(dp: int, gas: int, steps: int) -> list[float]:
    rows = MB * dp * gas
    config = {"gradient_accumulation_steps": gas, "optimizer": SGD}
    setup = VerifySetup(student, global_batches(teacher_data, rows, steps), config, F.mse_loss)
    return reference_run(setup, steps)["losses"]


QW, QG = {"zero_quantized_weights": True}, {"zero_quantized_gradients": True}
TWO_HOP = {"mics_hierarchical_params_gather": True}
# (name, dp, gas, zero_optimization)
LAYOUTS = [
    ("z3-dp2-qw", 2, 1, {"stage": 3, **QW}),
    ("z3-dp2-qg", 2, 1, {"stage": 3, **QG}),
    ("z3-dp2-gas2-qw-qg", 2, 2, {"stage": 3, **QW, **QG}),
    ("z2-dp2-gas2-qg", 2, 2, {"stage": 2, **QG}),
    # one shard group of 4 ranks on 2 nodes of 2 (NDEV_PER_NODE): two-hop gathers, and qgZ's
    # two hops (quantized_comm.py); its bound sums to the same (N-1)/N eps_g (module docstring)
    ("z3-dp4-two-hop-qw-qg", 4, 1, {"stage": 3, "mics_shard_size": 4, **TWO_HOP, **QW, **QG}),
]


@pytest.mark.parametrize("name,dp,gas,zero", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_layout_trains_close_to_one_process(name, dp, gas, zero):
    steps = 30
    want = reference(dp, gas, steps)
    results = run_distributed(on_nodes_of_two, dp, train, dp, gas, steps, zero)
    assert want[-1] < want[0] / 1.5, f"{name}: the reference does not learn; the test is void"
    qw, qg = (bool(zero.get(f"zero_quantized_{k}")) for k in ("weights", "gradients"))
    for rank, got in enumerate(results):
        for k, (a, b) in enumerate(zip(got["losses"], want, strict=True)):
            tol = 2 * 3 * EPS_W * qw + (dp - 1) / dp * EPS_G * want[0] / b * qg
            assert abs(a - b) <= tol * b, f"{name} rank {rank} step {k}: {a} vs {b}, tol {tol}"
        sent = got["dtypes"]
        gathers = {"uint8"} if zero.get("zero_quantized_weights") else {"float32"}
        assert sent["all_gather"] == gathers, f"{name}: gathered {sent['all_gather']}"
        if zero.get("zero_quantized_gradients"):
            assert sent["all_to_all"] == {"uint8"}, f"{name}: all-to-all of {sent['all_to_all']}"
            hops = {2} if TWO_HOP.keys() <= zero.keys() else {dp}
            assert got["sizes"]["all_to_all"] == hops, f"{name}: all-to-all over {got['sizes']}"
            assert "reduce_scatter" not in sent, f"{name}: reduce-scattered {sent}"
    first = results[0]["params"]
    for rank, got in enumerate(results[1:], 1):
        for key in first:
            assert torch.equal(first[key], got["params"][key]), f"{name}: rank {rank} {key}"


def test_loss_curve_within_two_percent_of_unquantized_and_bytes_cut():
    """200 steps of ZeRO-3 with both quantizations against the same run unquantized: each
    step's loss within 2%, weights gathered in about 1/4 of the bytes, gradients in 1/8."""
    steps, zero = 200, {"stage": 3}
    plain = run_distributed(train, 2, 2, 1, steps, zero)[0]
    quant = run_distributed(train, 2, 2, 1, steps, {**zero, **QW, **QG})[0]
    assert plain["losses"][-1] < plain["losses"][0] / 4, "the run does not learn; void"
    worst = max(abs(a - b) / b for a, b in zip(quant["losses"], plain["losses"], strict=True))
    assert worst <= 0.02, f"loss curve off by {worst:.2%}"
    # all_gather also counts the one exact gather of consolidated_state_dict (4 bytes/elem)
    ratio = quant["stats"]["all_gather"]["bytes"] / plain["stats"]["all_gather"]["bytes"]
    assert ratio == pytest.approx(0.25, abs=0.02), f"weights: {ratio:.3f} of fp32 bytes"
    ratio = quant["stats"]["all_to_all"]["bytes"] / plain["stats"]["reduce_scatter"]["bytes"]
    assert ratio == pytest.approx(0.125, abs=0.01), f"gradients: {ratio:.3f} of fp32 bytes"
    assert "reduce_scatter" not in quant["stats"], "a gradient was reduce-scattered unquantized"
    assert math.isfinite(worst)


# ----------------------------------------------------------------------------- verify
VERIFY_SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "verify_quantized.py")


@pytest.mark.parametrize("layout", ["zero3x2xqwxqg", "zero2x2xqg"])
def test_verify_accepts_quantized_layouts_within_their_tolerance(tmp_path, layout):
    """Within verify's quantized tolerance (compare.py), and beyond fp32's: the quantization
    really ran (a layout that silently sent fp32 would pass fp32's)."""
    steps, setup = 5, load_setup(VERIFY_SCRIPT)
    init = tmp_path / "init.safetensors"
    write_initial_weights(setup, init)
    want = run_reference(setup, steps, init)
    run_distributed(run_script, 2, VERIFY_SCRIPT, layout, steps, str(init), str(tmp_path / "q"))
    got = load_result(tmp_path / "q")
    verdict = compare(got, want, QUANTIZED, 2)
    assert not verdict.diverged, f"{layout}: {verdict.findings}"
    assert compare(got, want, FP32, 2).diverged, f"{layout}: exact: was anything quantized?"
