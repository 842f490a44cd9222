"""The planner's built-in decoder, with MoE layers or split sequences, trained as a script would.

``measure(layout, precision, dims)`` runs on every rank: ``shardwise.plan.build(dims, "cpu",
ep_size=layout.ep)`` (the decoder a run of that expert size builds) trained three steps with
the config ``to_config`` writes for the layout; it returns, as plan_runs.measure does, this
rank's ``engine.memory_breakdown()`` inside the third update and ``comm.stats()`` of that step.
"""

from __future__ import annotations

import torch

from shardwise.plan import Dims, Layout, build, to_config

DIMS = dict(layers=2, hidden=32, heads=4, vocab=61, seq=16)
MOE = Dims(**DIMS, moe_experts=4, moe_k=2)
DENSE = Dims(**DIMS)
EXTRA = {"zero_optimization": {"reduce_bucket_size": 3000}}
STEPS = 3


def config_for(layout: Layout, precision: str) -> dict:
    cfg = to_config(layout, precision)
    cfg["zero_optimization"].update(EXTRA["zero_optimization"])
    return cfg


def measure(layout: Layout, precision: str, dims: Dims) -> dict:
    import shardwise
    from shardwise import comm

    torch.manual_seed(0)
    model = build(dims, "cpu", ep_size=layout.ep)
    for p in model.parameters():  # a meta-free model with distinct values
        torch.nn.init.normal_(p, std=0.02)
    engine, *_ = shardwise.initialize(model=model, config=config_for(layout, precision))
    taken = {}
    step = engine.strategy.step

    def step_and_measure(optimizer, coef):
        taken["memory"] = engine.memory_breakdown()
        return step(optimizer, coef)

    engine.strategy.step = step_and_measure
    g = torch.Generator().manual_seed(engine.dp_rank)
    for k in range(STEPS):
        if k == STEPS - 1:
            comm.reset_stats()
        batches = []
        for _ in range(layout.grad_accum):
            x = torch.randint(0, dims.vocab, (layout.micro_batch, dims.seq), generator=g)
            batches.append((x, torch.roll(x, -1, 1)))
        engine.train_batch(iter(batches))
    return {"memory": taken["memory"], "comm": comm.stats()}


class UserMoE(torch.nn.Module):
    """A user's model: embedding -> MoE(4 experts, ``ep_size``) -> head -> cross-entropy."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from shardwise.moe.layer import MoE

        self.emb = torch.nn.Embedding(61, 32)
        expert = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
        )
        self.moe = MoE(32, expert, num_experts=4, ep_size=ep_size, k=2)
        self.head = torch.nn.Linear(32, 61)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.moe(self.emb(ids))[0])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def user_moe_ep2() -> UserMoE:
    return UserMoE(2)


def user_moe_ep1() -> UserMoE:
    return UserMoE(1)
