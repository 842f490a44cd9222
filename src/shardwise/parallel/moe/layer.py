"""The mixture-of-experts layer with expert parallelism, under DeepSpeed's names and defaults.

Legend: S tokens of this rank, M hidden, E experts, L = E / ep local experts, C capacity.

    x_sm -> gate: combine_weights_sec, dispatch_mask_sec (gating.py)
    dispatched_ecm = einsum("sec,sm->ecm", dispatch_mask, x)     token s into slot c of expert e
    all-to-all over the expert-parallel group (comm.py): (E, C, M) -> (ep, L, C, M), the tokens
                   of every rank of the group for this rank's L experts
    expert l runs on its (ep, C, M) tokens
    all-to-all back: (E, C, M), this rank's tokens through every expert
    y_sm = einsum("sec,ecm->sm", combine_weights, expert_out)     gate-weighted sum

Residual MoE (``use_residual``): y = y_moe * c0 + mlp(x) * c1 with (c0, c1) = softmax(coefficient(x)).

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name =
"ep_size_<ep>"``); ``bind_experts`` (experts.py) gives them their expert-data group.
Expert ``i`` of expert-parallel rank ``r`` is expert ``r * L + i`` of the whole layer.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Group
from shardwise.parallel.exchange import all_to_all
from shardwise.parallel.moe.gating import TopKGate


class Experts(nn.Module):
    """This rank's L experts (deep copies of ``expert``), each run on its chunk of dim 1."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str = ""
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        self.ep_rank = 0  # set by bind_experts: expert i here is ep_rank * L + i of the layer
        for p in self.parameters():
            p.allreduce = False  # DeepSpeed's mark of an expert parameter
            p.group_name = expert_group_name

    def forward(self, x_xlcm: torch.Tensor) -> torch.Tensor:
        chunks = x_xlcm.chunk(self.num_local_experts, dim=1)
        outs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts, strict=True):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (module doc). ``l_aux`` and ``exp_counts`` of the last
    forward are kept as attributes, as DeepSpeed's."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
    ) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size = ep_group_name, ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: Group = None
        self.bound = ep_size == 1  # bind_experts gives ep_size > 1 its group
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if not self.bound:
            raise RuntimeError(
                f"MoE(ep_size={self.ep_size}) runs its experts on {self.ep_size} ranks: pass "
                "the model through shardwise.initialize (it builds the expert groups) first"
            )
        if used_token is not None:
            raise NotImplementedError("MoE used_token masks are not supported: pass None")
        d_model = x.shape[-1]
        x_sm = x.reshape(-1, d_model)
        self.l_aux, combine_sec, dispatch_sec, self.exp_counts = self.gate(x_sm)
        dispatched_ecm = torch.einsum("sec,sm->ecm", dispatch_sec.type_as(x), x_sm)
        if self.ep_size > 1:
            dispatched_ecm = all_to_all(dispatched_ecm, self.ep_group)
        local = dispatched_ecm.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        out = self.experts(local)
        if self.ep_size > 1:
            out = all_to_all(out, self.ep_group)
        out_ecm = out.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        y_sm = torch.einsum("sec,ecm->sm", combine_sec.type_as(x), out_ecm)
        return y_sm.reshape(x.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: ``forward(x) -> (output, l_aux, exp_counts)``.

    ``num_experts`` experts split over ``ep_size`` data-parallel ranks (each builds
    ``num_experts // ep_size`` copies of ``expert``); ``k`` 1 or 2; capacity, dropping and
    noise as gating.py. ``use_tutel`` and expert tensor parallelism are not supported.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE num_experts={num_experts} must be divisible by ep_size={ep_size}: "
                "each expert-parallel rank holds num_experts / ep_size experts"
            )
        if use_tutel or enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "MoE use_tutel and enable_expert_tensor_parallelism are not supported: "
                "leave them False"
            )
        self.use_residual, self.ep_size, self.num_experts = use_residual, ep_size, num_experts
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
