"""Top-1 and top-2 gating with capacity, as DeepSpeed's ``deepspeed/moe/sharded_moe.py``.

Legend: S tokens (of this rank), E experts (all of them), C capacity (slots per expert), M hidden.

    gates = softmax(x W_g)                          (S, E), in fp32, never noisy: the combine
                                                    weights and l_aux's me are these gates
    capacity C = max(ceil(S / E * capacity_factor), min_capacity)   (top-2: factor * 2)
    top-1: each token goes to argmax(gates), or with ``noisy_gate_policy="RSample"`` (training)
           to argmax(logits + g), g ~ Gumbel(0, 1) iid: expert e with probability
           softmax(logits)_e (Gumbel-max); an expert keeps at most C of its tokens (with
           random token selection, ``use_rts``, C chosen at random; else by ``topk`` on the
           0/1 mask), the others are dropped (their output is zero; a residual carries them)
    top-2: the first expert is argmax(gates); the second is argmax over the others of
           logits + g when ``top2_2nd_expert_sampling`` (training and eval, as DeepSpeed), so
           P(second = e | first = f) = exp(l_e) / sum_{j != f} exp(l_j); else the runner-up;
           first choices fill the slots before second ones, in token order; the two gate
           values are renormalised to sum to one
    Jitter (training): the router's input x becomes x * U(1 - 1e-2, 1 + 1e-2) per element
    l_aux: top-1  E * sum_e me_e * ce_e
           top-2  E * E * mean_e me_e * ce_e   (= the same number; DeepSpeed writes it so)
           me_e = mean gate of expert e, ce_e = fraction of tokens whose first choice is e
    combine_weights (S, E, C): the gate value at token s's slot c of expert e; dispatch_mask
    is its support. exp_counts (E,): tokens routed to each expert *before* dropping (top-2:
    both choices), as DeepSpeed returns them.

``drop_tokens=False`` sets C to the largest count, maximised over the expert-parallel group
(every rank must send the same shape through the all-to-all).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm

Gating = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ceil(S / E * capacity_factor), at least ``min_capacity``."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def _no_drop_capacity(exp_counts: torch.Tensor, num_tokens: int, ep_group: comm.Group) -> int:
    """The largest count over the expert-parallel group, at most the number of tokens."""
    biggest = exp_counts.max().reshape(1).clone()
    if ep_group is not None:
        comm.all_reduce(biggest, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    return max(min(int(biggest), num_tokens), 1)


def _slots(locations_s: torch.Tensor, cap: int) -> torch.Tensor:
    """(S,) slot index -> (S, C) one-hot float."""
    return F.one_hot(locations_s, num_classes=cap).float()


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.Group = None,
) -> Gating:
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-1 gating (module doc)."""
    noisy = logits
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_noise(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    indices1 = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    exp_counts = mask1.sum(dim=0).detach().cpu()
    if not drop_tokens:
        cap = _no_drop_capacity(exp_counts, num_tokens, ep_group)
    if num_tokens < min_capacity and drop_tokens:
        raise ValueError(
            f"MoE gating got {num_tokens} tokens, fewer than min_capacity={min_capacity}: "
            "set min_capacity=0 or use a larger batch"
        )
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    # Keep at most C tokens per expert: random ones (RTS), else topk's pick among the 1s.
    scores = mask1 * torch.rand(mask1.shape, device=mask1.device) if use_rts else mask1
    top_idx = torch.topk(scores, k=min(cap, num_tokens), dim=0)[1]
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    locations1 = torch.cumsum(mask1, dim=0) - 1  # slot of each kept token, in token order
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.float()
    combine_weights = torch.einsum("se,sc->sec", gates, _slots(locations1_s, cap))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.Group = None,
    top2_2nd_expert_sampling: bool = True,
) -> Gating:
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-2 gating (module doc)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    if top2_2nd_expert_sampling:  # Gumbel-max: the second expert sampled from the gates
        logits = logits + gumbel_noise(logits.shape, logits.device)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    mask2 = F.one_hot(torch.argmax(logits_except1, dim=1), num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().cpu()
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, cap)
        mask2 = mask2 * torch.lt(locations2, cap)
    else:
        cap = _no_drop_capacity(exp_counts, num_tokens, ep_group)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1_s = torch.einsum("se,se->s", gates, mask1.float())
    gates2_s = torch.einsum("se,se->s", gates, mask2.float())
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1 = torch.einsum("s,se->se", gates1_s / denom_s, mask1.float())
    gates2 = torch.einsum("s,se->se", gates2_s / denom_s, mask2.float())
    combine_weights = torch.einsum("se,sc->sec", gates1, _slots(locations1_s, cap))
    combine_weights = combine_weights + torch.einsum(
        "se,sc->sec", gates2, _slots(locations2_s, cap)
    )
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) samples: g = -log(-log(u)), u ~ U(tiny, 1 - eps) (fp32's tiny and eps).

    u >= tiny keeps -log(u) <= 87.4 finite; u <= 1 - eps keeps -log(u) >= 1.2e-7 > 0, so the
    outer log is finite too: g lies in [-4.5, 15.9]. The draws are those of
    ``torch.distributions.Gumbel(0, 1).rsample``, DeepSpeed's ``gumbel_rsample``: one
    ``torch.rand`` of ``shape``, scaled onto [tiny, 1 - eps)."""
    finfo = torch.finfo(torch.float32)
    low = torch.tensor(finfo.tiny, device=device)
    high = torch.tensor(1.0 - finfo.eps, device=device)
    u = low + torch.rand(shape, device=device) * (high - low)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """x * U(1 - epsilon, 1 + epsilon), one factor per element (DeepSpeed's ``Jitter``: the
    router's input, before ``wg``); the same draws as ``torch.distributions.Uniform``."""
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    return x * (low + torch.rand(x.shape, device=x.device) * (high - low))


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate``: the linear router ``wg`` (M -> E, no bias, fp32) and the rule.

    Training uses ``capacity_factor`` and the noise policy; eval ``eval_capacity_factor`` and
    no noise policy (top-2's second-expert sampling stays on, as DeepSpeed's). ``ep_group``
    is set when expert parallelism is bound (layer.py)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"MoE k={k}: only top-1 and top-2 gating are supported (k=1 or 2)")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(
                f"MoE noisy_gate_policy={noisy_gate_policy!r}: use None, 'Jitter' or 'RSample'"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k, self.min_capacity = k, min_capacity
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_group: comm.Group = None

    def forward(self, x_sm: torch.Tensor) -> Gating:
        x = x_sm.float()
        # DeepSpeed 0.19's rule of noise (sharded_moe.py TopKGate.forward): "Jitter" and
        # "RSample" in training only; top-2's second-expert sampling in eval too.
        policy = self.noisy_gate_policy if self.training else None
        if policy == "Jitter":
            x = multiplicative_jitter(x, 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                policy,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
            )
        return top2gating(
            logits,
            factor,
            self.min_capacity,
            self.drop_tokens,
            self.ep_group,
            self.top2_2nd_expert_sampling,
        )
