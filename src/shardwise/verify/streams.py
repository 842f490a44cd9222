"""Dropout and the random streams of tensor parallelism: what no loss comparison can check.

One process draws one mask over a whole activation, so over any split of it the parts are
independent. A tensor-parallel layout cannot reproduce that mask bit for bit, only its law
(docs/tensor-parallel.md, "Dropout and random streams"):

- where the activation is *replicated* over the TP ranks, every rank must draw the *same* mask
  (else the copies of one activation diverge);
- where it is *split* (local heads, sequence shards), the ranks must draw *different* masks
  (the same mask on every shard correlates parts that one process draws independently).

So verify trains with every ``nn.Dropout`` set to p = 0 (the losses are then comparable) and,
after the last step, runs one forward with the script's p restored, hashing each dropout's
input and mask (mask = output == 0 where the input is not) on every TP rank. Equal input hashes
mean replicated, different ones split; the rule above then decides. Dropout inside a function
(``F.dropout``, ``scaled_dot_product_attention(dropout_p=...)``) is not seen: give it p = 0 in
the verify setup.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.moe.gating import TopKGate
from shardwise.training.batch_loop import loss_of


def silence_dropout(model: nn.Module) -> dict[str, tuple[nn.Module, float]]:
    """Set p = 0 on every dropout module with p > 0; returns {name: (module, its p)}."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            found[name] = (m, m.p)
            m.p = 0.0
    return found


def silence_gate_noise(model: nn.Module) -> list[str]:
    """Turn off the random parts of MoE gates (noise policy, second-expert sampling, random
    token selection when an expert is over capacity): each data rank draws them from its own
    stream, one process from one stream over every rank's tokens, so they cannot match draw
    for draw (their distributions are tested against DeepSpeed's in
    tests/test_moe_gate_statistics.py). Returns the gates' names."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, TopKGate) and (
            m.noisy_gate_policy or m.top2_2nd_expert_sampling or m.use_rts
        ):
            m.noisy_gate_policy, m.top2_2nd_expert_sampling, m.use_rts = None, False, False
            found.append(name)
    return found


def _digest(t: torch.Tensor) -> int:
    """A 63-bit hash of a tensor's values (equal tensors, equal hashes)."""
    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") >> 1


def _hashes(engine: Any, dropouts: dict, batch: Any) -> torch.Tensor:
    """(n, 2) int64: each dropout's (input hash, mask hash) in one train-mode forward."""
    seen = torch.zeros(len(dropouts), 2, dtype=torch.int64)
    handles = []

    def hook(i: int) -> Any:
        def record(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if seen[i, 0] == 0:  # the first call of the module: one draw per module
                x = args[0]
                seen[i, 0] = _digest(x)
                seen[i, 1] = _digest((out == 0) & (x != 0))

        return record

    for i, (module, p) in enumerate(dropouts.values()):
        module.p = p
        handles.append(module.register_forward_hook(hook(i)))
    try:
        engine.train()
        with torch.no_grad():
            loss_of(engine, batch)
    finally:
        for h, (module, _) in zip(handles, dropouts.values(), strict=True):
            h.remove()
            module.p = 0.0
    return seen


def check_streams(engine: Any, dropouts: dict, batch: Any) -> list[str]:
    """Findings of the replicated / split rule over this rank's TP group (same on every rank)."""
    mine = _hashes(engine, dropouts, batch)
    group = engine.mesh.tp_group
    every = [torch.zeros_like(mine) for _ in range(comm.get_world_size(group))]
    comm.all_gather(every, mine, group=group)
    findings = []
    for i, name in enumerate(dropouts):
        inputs = [int(h[i, 0]) for h in every]
        masks = [int(h[i, 1]) for h in every]
        if 0 in inputs:
            continue  # not called in this forward
        if len(set(inputs)) == 1 and len(set(masks)) > 1:
            findings.append(
                f"dropout {name!r}: replicated input but different masks on the TP ranks "
                "(the copies diverge): draw it from the default stream, seeded alike"
            )
        elif len(set(inputs)) > 1 and len(set(masks)) < len(masks):
            same = [r for r, m in enumerate(masks) if masks.count(m) > 1]
            findings.append(
                f"dropout {name!r}: the same mask on TP ranks {same} over split activations "
                "(one process draws them independently): give it the rank's own stream "
                "(tp_plan style 'split_dropout')"
            )
    return findings
