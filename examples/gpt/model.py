"""A small GPT (decoder-only transformer) for character-level language modelling.

Parallelism-agnostic on purpose: plain ``nn.Linear`` / ``nn.Embedding`` with stable module names,
so shardwise can later swap layers in place by name (``GPT.tp_plan``) or cut ``blocks`` into
pipeline stages, without this file knowing about either.

Shape legend: B batch, T time (sequence position), C n_embd, H heads (local to this rank once
tensor parallelism splits them), D head_dim = C / n_head, V vocab_size.

Convention: ``model(idx)`` returns logits (B, T, V); ``model(idx, targets)`` returns the scalar
mean cross-entropy loss. One return type per call, so ``loss = engine(x, y)`` reads like a
DeepSpeed script and ``logits = model(idx)`` serves generation. Under the tensor-parallel plan
(``GPT.tp_plan``) logits are each rank's vocabulary slice (padding columns -inf): generate with
the single-process model, or a plan whose head is "colwise_rep".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from shardwise.moe.layer import MoE
from shardwise.pipe import TiedLayerSpec, moe_aux_loss


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 128  # longest context the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linear (except keys, see CausalSelfAttention) and LayerNorm
    tie_weights: bool = False  # head.weight is tok_emb.weight; untied keeps TP/PP simpler
    moe_experts: int = 0  # > 0: each block's feed-forward is a mixture of this many MLPs
    ep: int = 1  # expert-parallel size: the experts split over this many data ranks
    moe_k: int = 1  # experts per token (top-1 or top-2 gating)
    moe_aux: float = 0.01  # weight of the load-balancing loss added to the training loss
    moe_args: dict = field(default_factory=dict)  # more MoE arguments (noisy_gate_policy, ...)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections.

    Separate projections (not one fused qkv) so that splitting each weight by output columns
    across tensor-parallel ranks hands every rank whole heads: rows h*D..(h+1)*D of q, k and v
    belong to head h. The forward pass infers the number of heads from the local weight size,
    so the same code runs on a full layer or on a column shard holding H/tp heads.

    Keys never carry a bias: softmax ignores a shift shared by all keys, so the bias's exact
    gradient is zero, and Adam would turn rounding noise on it into updates of about lr.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attend = Attend(cfg.dropout)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, H*D) -> (B, H, T, D); H comes from the tensor, not the config (see class doc)
        B, T, _ = x.shape
        return x.view(B, T, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q(x))  # (B, T, C) @ (C, H*D) -> (B, H, T, D)
        k = self._heads(self.k(x))  # (B, T, C) @ (C, H*D) -> (B, H, T, D)
        v = self._heads(self.v(x))  # (B, T, C) @ (C, H*D) -> (B, H, T, D)
        y = self.attend(q, k, v)  # (B, H, T, D)
        # (B, T, H*D): heads side by side again. T from y, not x: under sequence parallelism
        # x holds a slice of the positions and q/k/v (gathered) the whole sequence.
        y = y.transpose(1, 2).flatten(2)
        return self.resid_drop(self.proj(y))  # (B, T, H*D) @ (H*D, C) -> (B, T, C)


class Attend(nn.Module):
    """softmax(q k^T / sqrt(D) + causal mask) v, with dropout on the attention probabilities.

    Its own module so that a tensor-parallel plan can name it: its dropout acts on the local
    heads of a rank, so it must draw from that rank's random stream ("split_dropout").
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, H, T, D) @ (B, H, D, T) -> (B, H, T, T); (B, H, T, T) @ (B, H, T, D) -> (B, H, T, D)
        p = self.dropout if self.training else 0.0
        # torch's scaled_dot_product_attention, over every rank's keys under context parallelism
        return shardwise.attention(q, k, v, dropout_p=p, is_causal=True)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))  # (B, T, C) @ (C, 4C) -> (B, T, 4C)
        return self.drop(self.proj(h))  # (B, T, 4C) @ (4C, C) -> (B, T, C)


class MoEMLP(nn.Module):
    """The feed-forward as DeepSpeed's MoE of ``moe_experts`` MLPs (docs/moe.md); the
    auxiliary load-balancing loss of the last forward is kept in ``l_aux`` for GPT's loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.moe = MoE(
            cfg.n_embd, MLP(cfg), cfg.moe_experts, ep_size=cfg.ep, k=cfg.moe_k, **cfg.moe_args
        )
        self.l_aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)  # (B, T, C): each token through its k experts
        return out


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x)).

    Pre-LN keeps the residual stream an identity path, which trains stably without warmup
    tricks at this size; post-LN would need a gentler learning rate.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoEMLP(cfg) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # Tensor-parallel plan, Hugging Face style: module-name pattern -> style ("*" is a block
    # index), applied by shardwise.parallel.tensor.parallelize. q/k/v split their output features
    # (each rank whole heads, see CausalSelfAttention), the output projections their input
    # features (then one all-reduce per sublayer); the embedding and the head split the
    # vocabulary, and the loss works on vocabulary-split logits without gathering them.
    # "split_dropout": attention dropout acts on local heads, so it draws from the rank's own
    # random stream. "sequence_parallel" marks the norms and dropouts between the split
    # layers: no-ops unless sequence parallelism is on, then they run on sequence shards, the
    # first ("drop", after the embeddings) splitting the sequence. Every pattern is checked
    # against the real module names in tests/test_example_gpt.py.
    tp_plan: dict[str, str] = {
        "tok_emb": "vocab",
        "drop": "sequence_parallel",
        "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.attend": "split_dropout",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.attn.resid_drop": "sequence_parallel",
        "blocks.*.ln_2": "sequence_parallel",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "blocks.*.mlp.drop": "sequence_parallel",
        "ln_f": "sequence_parallel",
        "head": "vocab",
        "loss_fn": "loss_parallel",
    }

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.loss_fn = nn.CrossEntropyLoss()  # a module, so a TP plan can swap it (loss_parallel)
        if cfg.tie_weights:
            # Both are (V, C): the embedding looks rows up, the head multiplies by its transpose.
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so shrink their output
        # projections by 1/sqrt(2 * n_layer) to keep the residual stream's variance near 1.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small weights make the initial logits nearly uniform: loss starts at about ln(V).
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (a tied head shares the embedding's tensor)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, V), or the mean loss when targets (B, T) given."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = shardwise.context_positions(T, device=idx.device)  # arange(T) on one process
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, C) @ (C, V) -> (B, T, V)
        if targets is None:
            return logits
        # Flatten to (B*T, V) vs (B*T,): every position is one next-token prediction.
        loss = self.loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        if self.cfg.moe_experts:  # the load-balancing loss keeps every expert in use
            loss = loss + self.cfg.moe_aux * sum(b.mlp.l_aux for b in self.blocks)
        return loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); returns (B, T + max_new_tokens).

        temperature 0 means greedy decoding. No KV cache: at this size recomputing the
        (at most block_size) context is cheap and keeps the model code minimal.
        """
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size :]  # the position embedding ends at block_size
            logits = self(ctx)[:, -1, :]  # (B, V): only the last position predicts the next
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx


# ----------------------------------------------------------------------------- pipeline form
# The same model as a list of layers for shardwise.pipe.PipelineModule: [embeddings, block 0,
# ..., block n-1, final norm + head], and the loss as a module. The layers share the GPT's own
# modules, so a pipeline built from a GPT starts from exactly its weights (every layout of the
# same seed trains the same model); a model too big for one process would use LayerSpec.
# Layer names are the index in the list: "0.tok_emb", "3.attn.q", f"{n_layer + 1}.head".


class Embed(nn.Module):
    """Layer 0: idx (B, T) -> dropout(tok_emb(idx) + pos_emb(positions)) (B, T, C)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.block_size = gpt.cfg.block_size
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.block_size}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C) + (T, C)


class Final(nn.Module):
    """Last layer: x (B, T, C) -> head(ln_f(x)), the logits (B, T, V)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))  # (B, T, C) @ (C, V) -> (B, T, V)


class LMLoss(nn.Module):
    """loss(logits (B, T, V), targets (B, T)): the mean cross-entropy over B*T positions.

    ``ce`` is the nn.CrossEntropyLoss a tensor-parallel plan swaps (loss_parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.ce(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class Positions(nn.Module):
    """Layer 1 of the tied form: x (B, T, C) token embeddings -> dropout(x + pos_emb(0..T-1))."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.block_size = gpt.cfg.block_size
        self.pos_emb, self.drop = gpt.pos_emb, gpt.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.block_size:
            raise ValueError(f"sequence length {x.shape[1]} exceeds block_size {self.block_size}")
        pos = torch.arange(x.shape[1], device=x.device)
        return self.drop(x + self.pos_emb(pos))  # (B, T, C) + (T, C)


class FinalNorm(nn.Module):
    """The tied form's layer before the head: x (B, T, C) -> ln_f(x)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f = gpt.ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class _OwnEmbedding(TiedLayerSpec):
    """TiedLayerSpec "tok_emb" whose module is the GPT's own embedding (not a new one), so the
    pipeline starts from exactly the GPT's weights, as the untied form does."""

    def __init__(self, emb: nn.Embedding, forward_fn: Callable | None = None) -> None:
        super().__init__("tok_emb", nn.Embedding, forward_fn=forward_fn, tied_weight_attr="weight")
        self.module = emb

    def build(self) -> nn.Module:
        return self.module


def _tied_head(emb: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied head: logits (B, T, V) = x (B, T, C) @ tok_emb.weight (V, C).T."""
    return F.linear(x, emb.weight)


def pipeline_layers(gpt: GPT) -> list:
    """The layer list of ``gpt`` for PipelineModule(layers=..., loss_fn=LMLoss()).

    Untied: [embeddings, block 0, ..., block n-1, final norm + head]. Tied (``tie_weights``):
    [token embedding, positions, blocks..., final norm, head], the first and the last a
    ``TiedLayerSpec`` of key "tok_emb": the stages holding them each keep a copy of the
    embedding, whose gradients the engine sums across those stages before every update
    (pipeline/tied.py), so the copies stay the one tensor of a single process."""
    if not gpt.cfg.tie_weights:
        return [Embed(gpt), *gpt.blocks, Final(gpt)]
    return [
        _OwnEmbedding(gpt.tok_emb),  # idx (B, T) -> (B, T, C)
        Positions(gpt),
        *gpt.blocks,
        FinalNorm(gpt),
        _OwnEmbedding(gpt.tok_emb, forward_fn=_tied_head),
    ]


def pipeline_aux_loss(gpt: GPT) -> Callable[[nn.Module], torch.Tensor | None] | None:
    """PipelineModule's ``aux_loss_fn`` for ``gpt``: each MoE block adds moe_aux * l_aux on its
    own stage, the terms GPT.forward adds to its loss (the last stage's LMLoss cannot see
    them; shardwise verify --fuzz found a pipeline that trained without them). None: no MoE."""
    return moe_aux_loss(gpt.cfg.moe_aux) if gpt.cfg.moe_experts else None


def pipeline_name(name: str, n_layer: int, tied: bool = False) -> str:
    """A GPT module/parameter name (or tp_plan pattern) -> its name in the pipeline form
    (``tied``: the tied form, whose embedding and head are "tied_modules.tok_emb")."""
    head, _, rest = name.partition(".")
    first = 2 if tied else 1  # the first block's index
    if head == "blocks":  # "blocks.2.attn.q" -> "3.attn.q"; "blocks.*.attn.q" -> "*.attn.q"
        index, _, rest = rest.partition(".")
        return f"{index if index == '*' else int(index) + first}.{rest}"
    if tied and head in ("tok_emb", "head"):  # one module on each stage that uses it
        return ".".join(["tied_modules.tok_emb", *([rest] if rest else [])])
    if head in ("tok_emb", "pos_emb", "drop"):
        return f"{first - 1}.{name}"
    if head in ("ln_f", "head"):
        return f"{n_layer + first}.{name}"
    if head == "loss_fn":
        return "loss_fn.ce"
    raise KeyError(f"{name!r} is not a name of the GPT")


def gpt_name(name: str, n_layer: int, tied: bool = False) -> str:
    """pipeline_name's inverse for parameter names: "3.attn.q.weight" -> "blocks.2.attn.q.weight"
    (tied: "tied_modules.tok_emb.weight" -> "tok_emb.weight"; the head is the same tensor)."""
    if tied and name.startswith("tied_modules.tok_emb."):
        return name.removeprefix("tied_modules.")
    index, _, rest = name.partition(".")
    i, first = int(index), 2 if tied else 1
    return rest if i in (first - 1, n_layer + first) else f"blocks.{i - first}.{rest}"


def pipeline_tp_plan(n_layer: int, tied: bool = False) -> dict[str, str]:
    """GPT.tp_plan with the pipeline form's names. The tied form has none: its head multiplies
    by the embedding's weight inside a TiedLayerSpec, which no tensor-parallel style splits."""
    if tied:
        raise ValueError(
            "pipeline_tp_plan: a tied pipeline (tie_weights=True) has no tensor-parallel plan; "
            "with --tp and --pp train untied (no --tie-weights), or tied with tp=1"
        )
    return {pipeline_name(p, n_layer): style for p, style in GPT.tp_plan.items()}
