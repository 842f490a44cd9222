"""The timed kernels of a calibration, as one rank runs them (calibrate.py explains the fits).

Times of GEMMs, collectives and the optimizer are the best of several single calls after a
warm-up (the first call of a size allocates): other jobs on the machine only ever add time,
so the fastest call is the closest to what the machine does alone. Blocks (a layer's forward
+ backward, whole and tensor-parallel) are the median call instead: every rank runs them at
once, as a training step's ranks do, and a step pays the typical call with its neighbours
busy; the best call is a moment when a neighbour happened to wait. (On 2 cores the best
calls of 2 ranks put the block 2% slower than one rank alone, while 2-rank training steps
ran 20-30% longer than that predicted; beside a busy core the median block took 17% longer
than the best.) Collectives go through ``shardwise.comm``, the
calls the library issues, so their bookkeeping is part of what is measured.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise import comm
from shardwise.parallel.clip import local_sq_sum
from shardwise.parallel.context.ring import ring_attention
from shardwise.parallel.context.ulysses import ulysses_attention
from shardwise.parallel.pipeline.split_linear import LinearSplitter, deferring, weight_backward
from shardwise.parallel.tensor.parallelize import parallelize
from shardwise.plan.models import Dims, GPTBlock, tp_plan
from shardwise.plan.tracing import OpCount

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send")
# Bytes a ring moves per payload byte, as cluster.Cluster.collective_time charges them.
RING: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}
GEMM = (1024, 256)  # (tokens, hidden): a micro-batch of 1024 tokens, hidden size 256


def _times(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _best_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    return min(_times(fn, repeats, warmup))


def _typical_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """The median call: a block as a busy step runs it (module docstring)."""
    return statistics.median(_times(fn, repeats, warmup))


def gemm_rate(dtype: torch.dtype, gemm: tuple[int, int] = GEMM, repeats: int = 5) -> float:
    """FLOP/s of a transformer layer's GEMMs (h -> 3h, h -> 4h, 4h -> h) on one thread."""
    g = torch.Generator().manual_seed(0)
    m, h = gemm
    shapes = [(m, h, 3 * h), (m, h, 4 * h), (m, 4 * h, h)]
    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        seconds += _best_time(lambda a=a, b=b: a @ b, repeats)
        flops += 2.0 * m * k * n
    return flops / seconds


def _block_forward(gemm: tuple[int, int]) -> Callable[[], torch.Tensor]:
    """The forward of the timed pre-LN block (fp32) on ``gemm`` = (tokens, hidden)."""
    return _timed_block(gemm)[1]


def _timed_block(gemm: tuple[int, int]) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """(the timed pre-LN block, its forward on ``gemm`` = (tokens, hidden)), fp32."""
    torch.manual_seed(0)
    tokens, h = gemm
    seq = min(tokens, 256)
    block = nn.TransformerEncoderLayer(
        h, max(h // 64, 1), 4 * h, dropout=0.0, batch_first=True, norm_first=True
    )
    x = torch.randn(max(tokens // seq, 1), seq, h, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(seq)
    return block, lambda: block(x, src_mask=mask, is_causal=True)


def block_time(gemm: tuple[int, int] = GEMM, repeats: int = 5) -> tuple[float, float]:
    """(FLOPs, median seconds) of a pre-LN transformer block's forward + backward (fp32) on
    ``gemm`` = (tokens, hidden); FLOPs by torch's counter, as the planner's trace counts them
    (norms, softmax and GELU cost time and no counted FLOPs)."""
    forward = _block_forward(gemm)

    def step() -> None:
        forward().sum().backward()

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops()), _typical_time(step, repeats)


def split_excess(gemm: tuple[int, int], repeats: int = 5) -> float:
    """Seconds the timed block's forward + backward takes longer run as the zero-bubble
    schedules run it (split_linear.py: its linears routed through the splitter's mode, the
    backward as B with the weight work deferred, then W) than fused; >= 0."""
    module, block = _timed_block(gemm)
    splitter = LinearSplitter(module)

    def plain() -> None:
        splitter.active = False
        block().sum().backward()

    def split() -> None:
        splitter.active = True
        out = block()
        splitter.active = False
        with deferring([]) as sink:
            out.sum().backward()
        weight_backward(sink)

    # Alternated, and the median of the pairs' differences: a busy neighbour slows both
    # calls of a pair alike.
    for fn in (plain, split, plain, split):
        fn()
    pairs = [_times(split, 1, 0)[0] - _times(plain, 1, 0)[0] for _ in range(repeats)]
    return max(statistics.median(pairs), 0.0)


def block_ops(gemm: tuple[int, int] = GEMM) -> int:
    """Aten ops of the timed block's forward (``block_time``'s block, counted as the
    planner's trace counts a layer's: tracing.OpCount)."""
    forward = _block_forward(gemm)
    with OpCount() as count:
        forward()
    return count.n


def update_time(shapes: list[tuple[int, ...]], repeats: int = 9) -> float:
    """Median seconds of the engine's update over parameters of ``shapes`` (fp32, plain data
    parallelism's path: the gradients' squared norm, their clip scaling, an AdamW step as
    a config's ``"type": "AdamW"`` builds it)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)

    def update() -> None:
        local_sq_sum(grads)
        torch._foreach_mul_(grads, 0.5)
        opt.step()

    return _typical_time(update, repeats)


def update_costs(hidden: int = GEMM[1], repeats: int = 9) -> tuple[float, float]:
    """(seconds per parameter tensor, bytes/s of model state) of the update: timed on 96
    tiny tensors (their fixed cost: the per-tensor kernels of the norm, the scaling and
    AdamW, which a transformer's many small weights pay) and on four GPT blocks' weights at
    ``hidden`` (12 tensors each, ~50 MB of state at 256: past the caches, as a model's
    update streams it), 16 bytes an element (parameter, gradient, two moments)."""
    tiny = [(8,)] * 96
    per_tensor = update_time(tiny, repeats) / len(tiny)
    h = hidden
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h)] + [(h,)] * 5
    shapes = block * 4
    elements = sum(math.prod(s) for s in shapes)
    t = update_time(shapes, repeats) - len(shapes) * per_tensor
    return per_tensor, 16.0 * elements / max(t, 1e-9)


def collective_calls(size: int) -> dict[str, Callable[[], object]]:
    """One call of each collective with a ``size``-byte fp32 payload on the default group."""
    n = comm.get_world_size()
    elems = max(size // 4 // n, 1) * n  # fp32, divisible by n for the gathers and scatters
    full, part, out = torch.ones(elems), torch.ones(elems // n), torch.empty(elems)
    return {
        "all_reduce": lambda: comm.all_reduce(full),
        "all_gather": lambda: comm.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(part, full),
        "broadcast": lambda: comm.broadcast(full, 0),
        "all_to_all": lambda: comm.all_to_all_single(out, full),
    }


def call_excess(size: int = 1 << 14, repeats: int = 7, calls: int = 16) -> float:
    """The median seconds an all-reduce adds to a loop of equal compute segments (ten
    256 x 256 matmuls, ~2 ms) on every rank at once, beyond the segments alone: its transfer
    and its wait (a peer still computing, a woken socket thread; on ranks taking turns on
    cores, a turn per step of its ring: 4 ranks on 2 cores ~6 ms). Each loop with calls is
    paired with one without, run just before it, and the pairs' median difference kept (a
    difference of two medians moved 2-4x between calibrations)."""
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    call = collective_calls(size)["all_reduce"]

    def loop(with_calls: bool) -> float:
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            for _ in range(10):
                a @ w
            if with_calls:
                call()
        return time.perf_counter() - start

    loop(True)  # warm-up: the first calls set up their buffers
    return statistics.median(loop(True) - loop(False) for _ in range(repeats)) / calls


def barrier_skew(repeats: int = 15) -> float:
    """Median seconds between the first and the last rank leaving a barrier (each rank's
    exit time on the node's monotonic clock, all-gathered): a woken rank resumes when a core
    is free for it."""
    n = comm.get_world_size()
    skews = []
    for _ in range(repeats):
        comm.barrier()
        mine = torch.tensor([time.perf_counter()], dtype=torch.float64)
        every = torch.zeros(n, dtype=torch.float64)
        comm.all_gather_into_tensor(every, mine)
        skews.append(float(every.max() - every.min()))
    return statistics.median(skews)


def time_op(op: str, size: int, repeats: int) -> float:
    """Best seconds of one ``op`` with a ``size``-byte payload on the default group (every
    rank calls it). ``send``: half a ping-pong between ranks 2k and 2k + 1 (0 when unpaired)."""
    n, rank = comm.get_world_size(), comm.get_rank()
    if op == "send":
        peer = rank ^ 1
        if peer >= n:
            comm.barrier()
            return 0.0
        first, second = (comm.send, comm.recv) if rank % 2 == 0 else (comm.recv, comm.send)
        full = torch.ones(max(size // 4 // n, 1) * n)

        def pingpong() -> None:
            first(full, peer)
            second(full, peer)

        comm.barrier()
        return _best_time(pingpong, repeats) / 2
    comm.barrier()
    return _best_time(collective_calls(size)[op], repeats)


def tp_blocks(gemm: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """(tokens, hidden) of the split blocks timed: the GEMM size, and a half and a quarter
    of its tokens at half its width (the shapes of small micro-batches). Three sizes for
    the two terms fitted (calibrate_fits.fit_excess): with two, one slow call of the median
    set the per-call wait alone (two calibrations an hour apart gave 1.9 and 0.9 ms)."""
    half = max(gemm[1] // 2, 16)
    return gemm, (max(gemm[0] // 2, 8), half), (max(gemm[0] // 4, 8), half)


def tp_block_times(gemm: tuple[int, int], repeats: int = 5) -> dict[str, float]:
    """A pre-LN GPT block (the planner's own, plan/models.py) on ``gemm`` = (tokens, hidden):
    median seconds of its forward + backward whole (``full``) and split by its tensor-parallel
    plan over the default group (``tp``), the collectives one split pass issues (``calls``)
    and the payload of each (``payload``: the (tokens, hidden) activation, fp32).
    Every rank runs both at once, as ranks of a tensor-parallel layout do."""
    torch.manual_seed(0)
    tokens, h = gemm
    seq = min(tokens, 256)
    d = Dims(layers=1, hidden=h, heads=max(h // 32, comm.get_world_size()), vocab=8, seq=seq)
    x = torch.randn(max(tokens // seq, 1), seq, h, requires_grad=True)
    block = GPTBlock(d)
    plan = {k.removeprefix("blocks.*."): s for k, s in tp_plan("gpt").items()}
    plan = {k: s for k, s in plan.items() if k.split(".")[0] in ("attn", "mlp")}
    split = parallelize(GPTBlock(d), plan, None)

    def step(m: nn.Module) -> Callable[[], None]:
        return lambda: m(x).sum().backward()

    comm.barrier()
    full = _typical_time(step(block), repeats)
    comm.barrier()
    tp = _typical_time(step(split), repeats)
    before = comm.stats().get("all_reduce", {}).get("calls", 0)
    step(split)()
    calls = comm.stats().get("all_reduce", {}).get("calls", 0) - before
    return {"full": full, "tp": tp, "calls": calls, "payload": 4 * x.numel()}


CONTEXT = {"ring": ring_attention, "ulysses": ulysses_attention}


def cp_attention_times(gemm: tuple[int, int], repeats: int = 5) -> dict[str, float]:
    """Causal attention split over the default group as context parallelism splits it: the
    median seconds of forward + backward per method (``ring``, ``ulysses``) on this rank's
    (1, H, s, 32) shard of ``gemm``'s tokens (s = tokens / n, H = hidden / 32, at least n and
    divisible by it), every rank at once; with the FLOPs the planner's tracer counts for the
    local block (4 H s^2 D) and the bytes of one (1, H, s, D) block (``payload``, fp32)."""
    n = comm.get_world_size()
    tokens, h = gemm
    d, heads = 32, -(-max(h // 32, n) // n) * n
    s = max(tokens // n // 2 * 2, 2)  # two chunks per rank (the balanced token order)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, s, d, requires_grad=True) for _ in range(3))
    ranks = list(range(n))
    out: dict[str, float] = {"flops": 4.0 * heads * s * s * d, "payload": 4.0 * q.numel()}
    for name, attend in CONTEXT.items():

        def step(attend: Callable = attend) -> None:
            attend(q, k, v, causal=True, group=None, ranks=ranks).sum().backward()

        comm.barrier()
        out[name] = _typical_time(step, repeats)
    return out
