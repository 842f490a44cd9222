"""Shared pieces of the benchmarks: a GPT block stack, synthetic data, timing, a table printer.

Plain torch only, so every contender trains exactly the same module.

Shapes: B = micro-batch rows, T = sequence length, C = d_model, H = heads, V = vocabulary.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB = 2048  # small: the embedding stays a minor part of the parameters


def single_thread() -> None:
    """One thread per process: runs repeat bit for bit and two ranks do not fight over 2 cores."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). 12 C^2 weights."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        # No biases on the projections: a key bias has an exact gradient of zero (softmax ignores
        # a shift shared by all keys), and Adam turns that into noise (design.md, testing notes).
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.out = nn.Linear(4 * d_model, d_model, bias=False)

    def attention(self, x_btc: torch.Tensor) -> torch.Tensor:
        b, t, c = x_btc.shape
        q, k, v = self.qkv(x_btc).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H) for each of q, k, v
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y_bhtd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_bhtd.transpose(1, 2).reshape(b, t, c))

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        x_btc = x_btc + self.attention(self.ln1(x_btc))
        return x_btc + self.out(F.gelu(self.fc(self.ln2(x_btc))))


class GPT(nn.Module):
    """Token + position embeddings, a stack of blocks, final LN, head tied to the embedding.

    ``forward(idx_bt, targets_bt)`` returns the mean next-token cross-entropy, so every engine
    can treat the module's output as the loss.
    """

    def __init__(self, d_model: int, layers: int, seq: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, max(1, d_model // 64)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2: one parameter, two uses
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's init; residual projections scaled by depth so the stream stays O(1).
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, idx_bt: torch.Tensor, targets_bt: torch.Tensor) -> torch.Tensor:
        t = idx_bt.shape[1]
        x_btc = self.tok(idx_bt) + self.pos(torch.arange(t))
        for block in self.blocks:
            x_btc = block(x_btc)
        logits_btv = self.head(self.ln_f(x_btc))
        return F.cross_entropy(logits_btv.flatten(0, 1), targets_bt.flatten())


def make_model(args: argparse.Namespace, seed: int = 0) -> GPT:
    """The same initial weights for every contender: the seed alone decides them."""
    torch.manual_seed(seed)
    return GPT(args.d_model, args.layers, args.seq)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_batches(
    n_steps: int, rows: int, seq: int, vocab: int = VOCAB, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_steps`` global batches of ``rows`` sequences, (inputs, next-token targets) each.

    A noisy Markov chain (each token has one likely successor, 10% random jumps), so the loss
    falls from ln(V) within a few steps: a visibly learning model, not noise being fitted.
    """
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    tokens = torch.empty(n_steps * rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (n_steps * rows,), generator=g)
    for t in range(seq):
        jump = torch.rand(n_steps * rows, generator=g) < 0.1
        rand = torch.randint(vocab, (n_steps * rows,), generator=g)
        tokens[:, t + 1] = torch.where(jump, rand, successor[tokens[:, t]])
    batches = tokens.view(n_steps, rows, seq + 1)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]


# ----------------------------------------------------------------------------- flags


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark shares (model shape and the timing schedule)."""
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each block")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of interleaved blocks")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per rank per step")


# ----------------------------------------------------------------------------- measuring


def timed_steps(
    c: object,
    step: Callable[[int], torch.Tensor],
    warmup: int,
    steps: int,
    loss_over_ranks: str = "mean",
) -> None:
    """``warmup`` untimed then ``steps`` timed calls ``step(c.steps_done)`` (one training step
    on batch number ``c.steps_done``, returning this rank's loss), appended to ``c.times``,
    ``c.cpu`` (the slowest rank's seconds) and ``c.losses`` (the rank ``"mean"`` of the losses,
    or their ``"sum"`` when only one rank holds a non-zero loss, as the last pipeline stage)."""
    times, cpu, losses = [], [], []
    for i in range(warmup + steps):
        dist.barrier()  # every rank starts together: no rank's step absorbs another's lateness
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(c.steps_done)
        dist.barrier()  # the step is over when the slowest rank is done
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            # CPU time of every thread of this rank (gloo's included): what the step costs,
            # nearly blind to other processes competing for the cores, unlike wall time.
            cpu.append(time.process_time() - c0)
        losses.append(loss.detach().double())
        c.steps_done += 1
    # One collective per block, outside the timed region: the slowest rank, the mean loss.
    slowest = torch.tensor([times, cpu], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    loss_t = torch.stack(losses)
    dist.all_reduce(loss_t)
    if loss_over_ranks == "mean":
        loss_t /= dist.get_world_size()
    c.times += slowest[0].tolist()
    c.cpu += slowest[1].tolist()
    c.losses += loss_t.tolist()


def median_ms(seconds: Iterable[float]) -> float:
    return 1e3 * statistics.median(seconds)


def rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident set, in MiB (Linux only)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def tensor_mb(tensors: Iterable[torch.Tensor | None]) -> float:
    """MiB held by ``tensors``, each storage counted once (a grad viewing a bucket is free)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values()) / 2**20


def grad_mb(model: nn.Module) -> float:
    """MiB of one gradient per trainable parameter: what an engine that frees its gradients
    between steps (set_to_none) rebuilds in every backward."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with aligned columns: readable in a terminal, pasteable in a README."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def import_deepspeed() -> tuple[object | None, str]:
    """DeepSpeed, or None and the reason; the same answer on every rank (else they'd hang)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed

        found, why = deepspeed, ""
    except Exception as e:  # ImportError, or a broken install failing at import time
        found, why = None, f"{type(e).__name__}: {e}".splitlines()[0]
    ok = torch.tensor([1 if found else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if found and not ok.item():
        return None, "not importable on every rank"
    if found:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # it logs its config at INFO
        found.init_distributed(dist_backend="gloo")  # reuses our world; sets up deepspeed.comm
    return found, why
