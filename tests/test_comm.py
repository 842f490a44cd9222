"""shardwise.comm: every collective's before/after, and the bytes it counts against theory."""

import pytest
import torch
from harness import run_distributed

from shardwise import comm


def _collectives(world: int) -> dict:
    r = comm.get_rank()
    out = {}
    t = torch.full((4,), float(r))
    comm.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.full((2,), float(r))
    comm.broadcast(t, src=world - 1)
    out["broadcast"] = t.tolist()
    t = torch.full((1,), float(r + 1))
    comm.reduce(t, dst=0)
    out["reduce"] = t.tolist() if r == 0 else None
    full = torch.empty(world * 2)
    comm.all_gather_into_tensor(full, torch.full((2,), float(r)))
    out["all_gather"] = full.tolist()
    shard = torch.empty(2)
    comm.reduce_scatter_tensor(shard, torch.arange(world * 2, dtype=torch.float32))
    out["reduce_scatter"] = shard.tolist()
    gl = [torch.empty(1) for _ in range(world)] if r == 0 else None
    comm.gather(torch.tensor([float(r)]), gl, dst=0)
    out["gather"] = [g.item() for g in gl] if r == 0 else None
    got = torch.empty(1)
    comm.scatter(got, [torch.tensor([10.0 * i]) for i in range(world)] if r == 0 else None, src=0)
    out["scatter"] = got.item()
    if world > 1:
        if r == 0:
            comm.send(torch.tensor([42.0]), dst=1)
        elif r == 1:
            buf = torch.empty(1)
            comm.recv(buf, src=0)
            out["recv"] = buf.item()
    out["stats"] = comm.stats()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_before_after(world):
    if world == 1:
        results = [_collectives(1)]
    else:
        results = run_distributed(_collectives, world, world)
    total = sum(range(world))
    for r, out in enumerate(results):
        tag = f"world={world} rank={r}"
        assert out["all_reduce"] == [float(total)] * 4, tag
        assert out["broadcast"] == [float(world - 1)] * 2, tag
        assert out["all_gather"] == [float(i) for i in range(world) for _ in range(2)], tag
        assert out["reduce_scatter"] == [2.0 * r * world, (2.0 * r + 1) * world], tag
        assert out["scatter"] == 10.0 * r, tag
    assert results[0]["reduce"] == [float(world * (world + 1) // 2)]
    assert results[0]["gather"] == [float(i) for i in range(world)]
    if world > 1:
        assert results[1]["recv"] == 42.0


def _ring_bytes(numel: int) -> dict:
    grad = torch.ones(numel)
    comm.reset_stats()
    comm.all_reduce(grad)
    out = torch.empty(numel // comm.get_world_size())
    comm.reduce_scatter_tensor(out, grad)
    return comm.stats()


@pytest.mark.parametrize("world", [2, 4])
def test_counted_bytes_follow_the_ring_model(world):
    numel = 1000 * world
    s = numel * 4
    for r, st in enumerate(run_distributed(_ring_bytes, world, numel)):
        tag = f"world={world} rank={r}"
        assert st["all_reduce"] == {
            "calls": 1,
            "bytes": s,
            "sent_bytes": 2 * (world - 1) * s // world,
        }, tag
        assert st["reduce_scatter"]["sent_bytes"] == (world - 1) * s // world, tag


def test_single_process_is_a_local_no_op():
    comm.reset_stats()
    t = torch.ones(3)
    comm.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert comm.stats() == {}, "a world of one sends nothing and counts nothing"
