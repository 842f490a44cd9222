"""Context-parallel attention (issue 18): ring and Ulysses against attention on the full sequence.

Each case runs on a gloo world (context_runs.py): every rank holds its balanced shard
(token_order.py: chunks r and 2*cp-1-r of 2*cp) of the same seeded q, k, v and upstream gradient;
the unsharded output and q, k, v gradients must match ``scaled_dot_product_attention`` on the
full sequence in this process. cp 2 runs as the strided groups {0, 2} and {1, 3} of a world of
4, so that context ranks are never mistaken for global ranks; cp 4 uses the default group.

Tolerance TOL = 5e-6 (fp32, values of order 1): only the order of reductions differs. The ring
sums each softmax block by block through the log-sum-exp merge and adds dK/dV partials rank by
rank; measured max |error| 1.5e-6 (ring, cp 2, non-causal, dk; 1.4e-6 with the plain-matmul
blocks instead of torch's fused CPU kernel), the others 3.6e-7..1.4e-6.
Ulysses runs the same kernel on the same per-head data, measured 0.0. TOL is ~3.5x the largest
measurement; a wrong mask or a misplaced chunk moves outputs by order 1 (measured on these
inputs: the causal mask missing 2.9, the diagonal excluded 2.2, two key chunks swapped 3.4).
"""

from functools import cache
from typing import NamedTuple

import pytest
import torch
from context_runs import B, D, H, attention_run, reference
from harness import run_distributed

from shardwise.monitor.memory import saved_storages
from shardwise.parallel.context import (
    check_sequence,
    chunk_ids,
    context_attention,
    ring,
    sequence_positions,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from shardwise.parallel.context.ring import _blocks, _chunks

TOL = 5e-6
FP32 = 4


class Case(NamedTuple):
    world: int
    cp: int
    method: str
    causal: bool
    seq_len: int

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.method} cp={self.cp} {mask} S={self.seq_len} world={self.world}"


# One world of 4 serves every case (a world costs seconds to start): cp 4 is the whole world
# (the default group); cp 2 runs as two context groups of strided ranks, {0, 2} and {1, 3}.
CASES = [
    Case(4, cp, method, causal, seq_len)
    for cp, seq_len in ((2, 16), (4, 24))
    for method in ("ring", "ulysses")
    for causal in (True, False)
]


@cache
def _run(case: Case) -> list[dict]:
    """One run per case, shared by the accuracy and the traffic tests."""
    return run_distributed(
        attention_run, case.world, case.method, case.cp, case.causal, case.seq_len
    )


def _by_group(results: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(tuple(r["ranks"]), []).append(r)
    return {g: sorted(rs, key=lambda r: r["cp_rank"]) for g, rs in groups.items()}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_attention_on_the_full_sequence(case):
    ref = reference(case.seq_len, case.causal)
    for ranks, shards in _by_group(_run(case)).items():
        for name in ("out", "dq", "dk", "dv"):
            got = unshard_sequence([s[name] for s in shards], 2, case.cp)
            err = (got - ref[name]).abs().max().item()
            assert err <= TOL, f"{case}, group {ranks}: {name} differs by {err:.2e} > {TOL}"


def _p2p(blocks: int, block: int) -> dict:
    return {
        "send": {"calls": blocks, "bytes": blocks * block, "sent_bytes": blocks * block},
        "recv": {"calls": blocks, "bytes": blocks * block, "sent_bytes": 0},
    }


def _all_to_all(block: int, cp: int) -> dict:
    return {
        "all_to_all": {"calls": 4, "bytes": 4 * block, "sent_bytes": 4 * block * (cp - 1) // cp}
    }


@pytest.mark.parametrize("case", CASES, ids=str)
def test_traffic_matches_the_formulas(case):
    """Per rank, one block = B*H*(S/cp)*D fp32 values. Ring forward: cp-1 K and cp-1 V blocks
    sent (and received); backward: cp-1 K/V pairs plus cp dK/dV pairs (the last hop takes
    them home), 4(cp-1)+2 blocks. Ulysses: 4 all-to-alls of one block each way."""
    cp = case.cp
    block = B * H * (case.seq_len // cp) * D * FP32
    if case.method == "ring":
        forward, backward = _p2p(2 * (cp - 1), block), _p2p(4 * (cp - 1) + 2, block)
    else:
        forward = backward = _all_to_all(block, cp)
    for r, result in enumerate(_run(case)):
        assert result["forward"] == forward, f"{case}, rank {r}: forward {result['forward']}"
        assert result["backward"] == backward, f"{case}, rank {r}: backward {result['backward']}"


def _chunk_ids_in(chunks: list, rows: slice) -> set[int]:
    return {cid for cid, s in chunks if s.start < rows.stop and rows.start < s.stop}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_causal_work_is_even_and_skips_later_chunks(cp):
    """Balanced layout: over the whole ring each rank computes 2*cp+1 chunk-by-chunk blocks
    (chunk r sees r+1 chunks, chunk 2cp-1-r sees 2cp-r); a key chunk after the query chunk is
    never computed, the same chunk only under the causal diagonal."""
    c = 3
    for me in range(cp):
        area = 0
        for step in range(cp):
            q_chunks, k_chunks = _chunks(cp, me, 2 * c), _chunks(cp, (me - step) % cp, 2 * c)
            for rows, keys, diagonal in _blocks(q_chunks, k_chunks, causal=True):
                area += (rows.stop - rows.start) * (keys.stop - keys.start)
                qids, kids = _chunk_ids_in(q_chunks, rows), _chunk_ids_in(k_chunks, keys)
                where = f"cp={cp} rank {me} step {step}: query chunks {qids}, key chunks {kids}"
                if diagonal:
                    assert len(qids) == 1 and qids == kids, where
                else:
                    assert max(kids) < min(qids), where
        assert area == (2 * cp + 1) * c * c, f"cp={cp} rank {me}: {area / (c * c)} blocks"


REFUSED_LENGTHS = [(18, 2, 4), (16, 3, 6), (30, 4, 8)]  # (S, cp, multiple needed)


@pytest.mark.parametrize("seq_len,cp,multiple", REFUSED_LENGTHS)
def test_a_length_2cp_does_not_divide_is_refused(seq_len, cp, multiple):
    for call in (
        lambda: check_sequence(seq_len, cp),
        lambda: shard_sequence(torch.zeros(1, 2, seq_len, 4), 2, cp, 0),
        lambda: sequence_positions(seq_len, cp, 0),
    ):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        for part in (f"context_parallel.size={cp}", str(seq_len), str(multiple), "Pad", "causal"):
            assert part in msg, f"S={seq_len} cp={cp}: {part!r} missing from {msg!r}"


def test_ulysses_refuses_heads_not_divisible_before_communicating():
    """The check needs only cp = len(ranks), so it runs before any collective: one process,
    no world, is enough to see every rank refuse it alike."""
    q = k = v = torch.zeros(1, 3, 8, 4)
    with pytest.raises(ValueError) as err:
        ulysses_attention(q, k, v, causal=True, group=None, ranks=[0, 1])
    for part in ("context_parallel.size=2", "3 attention heads", "'ring'"):
        assert part in str(err.value), f"3 heads over cp 2: {part!r} missing from {err.value}"


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_different_head_counts_are_refused(method):
    q, kv = torch.zeros(1, 4, 8, 4), torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="same number of heads"):
        context_attention(q, kv, kv, is_causal=True, method=method, group=None, ranks=[0, 1])


def test_an_unknown_method_is_refused():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"context_parallel.method .*'ring', 'ulysses'"):
        context_attention(q, q, q, is_causal=True, method="zigzag", group=None, ranks=[0])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_round_trip_and_positions(cp):
    seq_len = 24
    x = torch.randn(2, 3, seq_len, 5)
    shards = [shard_sequence(x, 2, cp, r) for r in range(cp)]
    assert all(s.is_contiguous() and s.shape[2] == seq_len // cp for s in shards), f"cp={cp}"
    assert torch.equal(unshard_sequence(shards, 2, cp), x), f"cp={cp}: unshard(shard(x)) != x"
    c = seq_len // (2 * cp)
    for r in range(cp):
        pos = sequence_positions(seq_len, cp, r)
        assert torch.equal(pos, shard_sequence(torch.arange(seq_len), 0, cp, r)), f"cp={cp} r={r}"
        if cp > 1:
            first, second = chunk_ids(cp, r)
            assert (first, second) == (r, 2 * cp - 1 - r), f"cp={cp} r={r}"
            expected = [*range(first * c, first * c + c), *range(second * c, second * c + c)]
            assert pos.tolist() == expected, f"cp={cp} r={r}: positions {pos.tolist()}"
    every = torch.cat([sequence_positions(seq_len, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(seq_len)), f"cp={cp}: not each position once"


@pytest.mark.parametrize("diagonal", [True, False], ids=["diagonal block", "full block"])
def test_ring_blocks_plain_matmuls_agree_with_the_fused_cpu_kernel(diagonal, monkeypatch):
    """On CPU a ring block runs torch's fused flash-attention kernel; other devices run the same
    block as plain matmuls. Both give the same O_b, lse_b and, with the final O and lse, the same
    dq, dk, dv (fp32; tolerance as TOL above: only the summation order differs)."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(B, H, 12, D, generator=g) for _ in range(4))
    scale, results = D**-0.5, {}
    for fused in (True, False):
        monkeypatch.setattr(ring, "_fused", lambda t, fused=fused: fused)
        out, lse = ring._attend(q, k, v, scale, diagonal)
        grads = ring._block_grads(q, k, v, do, out, lse, scale, diagonal)
        results[fused] = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    for name, fused in results[True].items():
        err = (fused - results[False][name]).abs().max().item()
        assert err <= TOL, (
            f"{'diagonal' if diagonal else 'full'} block: {name} differs by {err:.2e}"
        )


def test_ring_output_merges_heads_without_a_copy():
    """A transformer puts the heads side by side again after attention and projects them; the
    projection saves its input for backward. The ring's output is laid out (B, s, H, D) in
    memory, so that input is a view of the output the ring saves itself: one forward saves
    q, k, v, O and lse, nothing twice (a (B, H, s, D) output cost one more block per layer)."""
    q, k, v = (torch.randn(B, 6, H * D).requires_grad_() for _ in range(3))  # (B, s, H*D)
    proj = torch.nn.Linear(H * D, H * D, bias=False)
    heads = [x.view(B, 6, H, D).transpose(1, 2) for x in (q, k, v)]  # (B, H, s, D) views

    def forward() -> None:
        out = context_attention(*heads, is_causal=True, method="ring", group=None, ranks=[0])
        proj(out.transpose(1, 2).flatten(2))  # (B, s, H*D): a view, not a copy

    saved = saved_storages(forward, [proj.weight])
    block = B * 6 * H * D * FP32
    assert sorted(saved.values()) == sorted([B * H * 6 * FP32] + 4 * [block]), (
        f"ring cp=1, (B, H, s, D) = {(B, H, 6, D)}: saved {sorted(saved.values())} bytes, "
        f"expected q, k, v, O of {block} and lse of {B * H * 6 * FP32}"
    )
