"""The model shapes ``shardwise plan`` builds from flags: a GPT and a Llama, as real modules.

Built on the meta device they cost no memory at any size (a 70B Llama has no storage), yet
they are ordinary ``nn.Module`` s: the planner reads their parameters (names, shapes, order,
which module owns each), traces what one micro-batch's forward saves for backward, and
``--simulate`` hands them to the real ``shardwise.initialize``.

``--arch gpt`` has the parameter shapes, owning modules and order of ``examples/gpt/model.py``
(no biases, LayerNorm without bias, learned positions), so the planner's numbers for it are
those of the example it is validated on; its head is tied to the token embedding unless
``tie_embeddings=False`` (GPT-2, GPT-3 and Megatron tie; the example GPT does not).
``Llama`` is the Llama-2/3 layer: RMSNorm, grouped-query attention (``kv_heads`` <=
``heads``), rotary positions, a SwiGLU MLP of width ``ffn``, untied head unless
``tie_embeddings``. With ``moe_experts`` each block's MLP is a shardwise ``MoE`` of that many
copies of it (``moe_k`` experts per token). Both attend through ``shardwise.attention`` (so
context parallelism runs them) and publish a tensor-parallel plan (``tp_plan``) and their
layer list (``pipeline_layers()``) for pipelines.

Shape legend: B batch, T positions, C hidden, H heads, K kv heads, D head dim = C / H, F ffn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.context.scope import attention, context_positions
from shardwise.parallel.moe.layer import MoE


@dataclass(frozen=True)
class Dims:
    """A decoder's sizes, named as ``shardwise plan``'s flags."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None  # None: as many as heads (no grouping)
    ffn: int | None = None  # None: 4 x hidden (GPT), about 8/3 x hidden rounded (Llama)
    arch: str = "gpt"
    moe_experts: int = 0  # > 0: each block's MLP is a MoE layer of this many experts
    moe_k: int = 1  # experts per token (top-1 or top-2 gating)
    tie_embeddings: bool | None = None  # head.weight is tok_emb.weight (None: GPT yes, Llama no)

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"--arch {self.arch!r}: use gpt or llama")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.heads % self.kv:
            raise ValueError(f"--heads {self.heads} is not divisible by --kv-heads {self.kv}")
        if self.moe_experts < 0 or self.moe_k not in (1, 2):
            raise ValueError(
                f"--moe-experts {self.moe_experts} --moe-k {self.moe_k}: give experts >= 1 "
                "(0: a dense MLP) and k 1 or 2 (top-1 or top-2 gating)"
            )

    @property
    def tied(self) -> bool:
        """GPT-2, GPT-3 and Megatron tie the head to the embedding; Llama does not."""
        return self.arch == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def width(self) -> int:
        """The MLP's inner width."""
        if self.ffn:
            return self.ffn
        if self.arch == "gpt":
            return 4 * self.hidden
        return 256 * -(-(8 * self.hidden // 3) // 256)  # Llama's rule, multiple_of=256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Attention(nn.Module):
    """Causal self-attention; q has H heads, k and v K heads (K = H for a GPT)."""

    def __init__(self, d: Dims, q: str, k: str, v: str, o: str) -> None:
        super().__init__()
        self.names, self.head_dim = (q, k, v, o), d.head_dim
        kv = d.kv * d.head_dim
        for name, out in ((q, d.hidden), (k, kv), (v, kv)):
            setattr(self, name, nn.Linear(d.hidden, out, bias=False))
        setattr(self, o, nn.Linear(d.hidden, d.hidden, bias=False))
        self.rotary = d.arch == "llama"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, o = (getattr(self, n) for n in self.names)
        B, T = x.shape[0], x.shape[1]
        # (B, T, C) @ (C, H*D) -> (B, H, T, D); H from the local weight (tensor parallelism)
        qh = q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        kh = k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        vh = v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            qh, kh = _rotate(qh), _rotate(kh)
        groups = qh.shape[1] // kh.shape[1]
        if groups > 1:  # grouped-query attention: each kv head serves `groups` q heads
            kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
        y = attention(qh, kh, vh, is_causal=True)  # (B, H, T, D); context parallelism: any
        # rank's T tokens against every rank's keys (torch's function without a split)
        return o(y.transpose(1, 2).flatten(2))  # (B, T, H*D) @ (H*D, C) -> (B, T, C)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, H, T, D): pairs (x1, x2) turned by angle t * f_i."""
    T, D = x.shape[-2], x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    t = context_positions(T, device=x.device).float()  # this rank's global positions
    angle = t[:, None] * freq  # (T, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class GPTMLP(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.fc = nn.Linear(d.hidden, d.width, bias=False)
        self.proj = nn.Linear(d.width, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, C) -> (B, T, F) -> (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.width, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.width, bias=False)
        self.down_proj = nn.Linear(d.width, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEMLP(nn.Module):
    """A MoE layer in the MLP's place: ``E`` copies of the block's MLP, top-k gated, built
    with ``ep_size=1`` (every expert; the planner takes a layout's E / ep of them). Its output
    only: the auxiliary loss is the training script's to add."""

    def __init__(self, d: Dims, expert: nn.Module, ep_size: int = 1) -> None:
        super().__init__()
        self.moe = MoE(d.hidden, expert, num_experts=d.moe_experts, ep_size=ep_size, k=d.moe_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _mlp(d: Dims, dense: type, ep_size: int) -> nn.Module:
    return MoEMLP(d, dense(d), ep_size) if d.moe_experts else dense(d)


class GPTBlock(nn.Module):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (the example GPT's Block)."""

    def __init__(self, d: Dims, ep_size: int = 1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d.hidden, bias=False)
        self.attn = Attention(d, "q", "k", "v", "proj")
        self.ln_2 = nn.LayerNorm(d.hidden, bias=False)
        self.mlp = _mlp(d, GPTMLP, ep_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaBlock(nn.Module):
    def __init__(self, d: Dims, ep_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden)
        self.self_attn = Attention(d, "q_proj", "k_proj", "v_proj", "o_proj")
        self.post_attention_layernorm = RMSNorm(d.hidden)
        self.mlp = _mlp(d, SwiGLU, ep_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embed(nn.Module):
    """Layer 0: ids (B, T) -> (B, T, C); learned positions for a GPT."""

    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(d.vocab, d.hidden)
        self.pos_emb = nn.Embedding(d.seq, d.hidden) if d.arch == "gpt" else None
        # Where sequence parallelism splits the sequence (the first sequence_parallel module).
        self.drop = nn.Dropout(0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(context_positions(ids.shape[1], device=ids.device))
        return self.drop(x)


class Final(nn.Module):
    """Last layer: x (B, T, C) -> head(norm(x)), the logits (B, T, V)."""

    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d.hidden, bias=False) if d.arch == "gpt" else RMSNorm(d.hidden)
        self.head = nn.Linear(d.hidden, d.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class LMLoss(nn.Module):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.ce(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class Decoder(nn.Module):
    """embed -> blocks -> final -> loss. Parameter order: embeddings, blocks, norm, head."""

    def __init__(self, d: Dims, ep_size: int = 1) -> None:
        super().__init__()
        self.dims = d
        self.embed = Embed(d)
        block = GPTBlock if d.arch == "gpt" else LlamaBlock
        self.blocks = nn.ModuleList(block(d, ep_size) for _ in range(d.layers))
        self.final = Final(d)
        if d.tied:  # one tensor: counted once, or on the first and last stage of a pipeline
            self.final.head.weight = self.embed.tok_emb.weight
        self.loss_fn = LMLoss()
        self.tp_plan = tp_plan(d.arch, moe=d.moe_experts > 0)
        self.free_ep = d.moe_experts > 0 and ep_size == 1  # any ep dividing E can be built
        self.context_attention = True  # attends through shardwise.attention

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.final]

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.final(x)
        return logits if targets is None else self.loss_fn(logits, targets)


def tp_plan(arch: str, moe: bool = False) -> dict[str, str]:
    """Megatron's split: q/k/v and the MLP's first matrices by columns, the output matrices
    by rows, embedding and head by vocabulary, the loss on split logits. MoE experts stay
    whole on every tensor-parallel rank (the library has no expert tensor parallelism)."""
    if arch == "gpt":
        attn = {"q": "colwise", "k": "colwise", "v": "colwise", "proj": "rowwise"}
        mlp = {"fc": "colwise", "proj": "rowwise"}
        norms, block_attn = ("ln_1", "ln_2"), "attn"
    else:
        attn = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
        mlp = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
        norms, block_attn = ("input_layernorm", "post_attention_layernorm"), "self_attn"
    plan = {"embed.tok_emb": "vocab", "embed.drop": "sequence_parallel"}
    plan.update({"final.head": "vocab", "loss_fn.ce": "loss_parallel"})
    plan.update({f"blocks.*.{block_attn}.{k}": s for k, s in attn.items()})
    plan.update({} if moe else {f"blocks.*.mlp.{k}": s for k, s in mlp.items()})
    plan.update({f"blocks.*.{n}": "sequence_parallel" for n in norms})
    plan["final.ln_f"] = "sequence_parallel"
    return plan


def build(d: Dims, device: str | torch.device = "meta", ep_size: int = 1) -> Decoder:
    """The decoder of ``d`` on ``device`` (meta: shapes only, no memory, no random draws);
    its MoE layers (``moe_experts``) with ``ep_size``, as a run of that expert size builds it."""
    with torch.device(device):
        return Decoder(d, ep_size)
