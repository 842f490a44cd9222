"""Every tensor-parallel style name, shardwise's and Hugging Face's (4.57 and 5.x), on a small
module: split over 2 ranks it computes what the whole module computes (issue 23).

The equivalence table: style x small module. Every rank builds the whole module from one seed,
parallelizes a copy with the row's plan and runs both on the same input: the output (with
sequence parallelism, this rank's positions of it), the input's gradient and every parameter's
gradient (a split one gathered whole) must agree. A Hugging Face name runs through the same
table as the shardwise style it means (tensor/styles.py). Tolerance as in test_tp_layers.py:
fp32, the split only regroups sums (a dot product over in/n features then an all-reduce), a few
ulps of values up to about 8: bound 5e-6; a wrong slice, a missing gradient sum or a gradient
counted twice is off by 1e-2 or more.

Then the refusals: a style that does not fit its module (packed or not, whole or split input,
wrong kind of module) is refused before the model changes, naming the style that fits; and the
docs list every style of the table.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

from shardwise import comm
from shardwise.parallel.tensor.consolidate import gather_whole
from shardwise.parallel.tensor.parallelize import match_plan, parallelize
from shardwise.parallel.tensor.placement import get_placement

ATOL = 5e-6
B, T, D, FF, HEAD, V = 2, 4, 8, 16, 4, 13  # V divisible by neither 2 nor 4: padded vocabulary


class Mlp(nn.Module):
    """fc then proj: the column / row pair."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(self.ln(x))))


class PackedQKV(nn.Module):
    """GPT-2's attention shape: c_attn's outputs are q | k | v, split by ``split_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.split_size = D
        self.c_attn, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.split_size, dim=-1)
        return self.proj(q * torch.tanh(k) + v)


class GateUp(nn.Module):
    """Phi-3's MLP: a fused gate_up_proj whose output the module chunks in two."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(D, 2 * FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HeadNorm(nn.Module):
    """Qwen3's q_norm: a norm over each head's features, after a column split (local heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.q_norm, self.o_proj = nn.Linear(D, D), nn.LayerNorm(HEAD), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (-1, HEAD))  # (B, T, heads on this rank, HEAD)
        return self.o_proj(self.q_norm(q).flatten(-2))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class HeadLoss(nn.Module):
    """An LM head split by vocabulary and the loss over its split logits."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.ce = nn.Linear(D, V), nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        targets = torch.arange(B * T).remainder(V)
        return self.ce(self.head(x).flatten(0, 1), targets)


ZOO = {"mlp": Mlp, "qkv": PackedQKV, "gate_up": GateUp, "head_norm": HeadNorm}
ZOO.update({"embed": Embed, "head_loss": HeadLoss})
MLP, REP = (
    {"fc": "colwise", "proj": "rowwise"},
    {"fc": "colwise_rep", "proj": "rowwise_split_input"},
)
# id: (module, plan, sequence parallelism)
CASES = {
    "colwise rowwise": ("mlp", MLP, False),
    "local_colwise local_rowwise (hf4.57)": ("mlp", {"fc": "local_colwise", "proj": "local_rowwise"}, False),
    "colwise_rep rowwise_split_input": ("mlp", REP, False),
    "colwise_gather_output rowwise_rep (hf)": ("mlp", {"fc": "colwise_gather_output", "proj": "rowwise_rep"}, False),
    "packed_colwise q|k|v": ("qkv", {"c_attn": "packed_colwise", "proj": "rowwise"}, False),
    "packed_colwise gate|up": ("gate_up", {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}, False),
    "replicated_with_grad_allreduce": ("head_norm", {"q_proj": "colwise", "q_norm": "replicated_with_grad_allreduce", "o_proj": "rowwise"}, False),
    "replicate": ("mlp", {"ln": "replicate", **MLP}, False),
    "vocab embedding": ("embed", {"emb": "vocab"}, False),
    "embedding_rowwise (hf5)": ("embed", {"emb": "embedding_rowwise"}, False),
    "vocab head loss_parallel": ("head_loss", {"head": "vocab", "ce": "loss_parallel"}, False),
    "sequence_parallel": ("mlp", {"ln": "sequence_parallel", **MLP}, True),
}  # fmt: skip
# Styles whose equivalence needs a whole model, and the test that shows it.
COVERED_ELSEWHERE = {
    "split_dropout": "test_parallelize.py::test_split_dropout_uses_the_rank_stream",
    "sequence_entry": "test_tp_hf.py::test_sequence_parallel_hugging_face_decoder_trains_like_one_process",
    "sequence_gather": "test_tp_hf.py::test_sequence_parallel_hugging_face_decoder_trains_like_one_process",
}  # fmt: skip


def _inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "embed":
        return torch.randint(0, V, (B, T), generator=g)
    return torch.randn(B, T, D, generator=g).requires_grad_()


def _whole_grad(p: nn.Parameter) -> torch.Tensor:
    placement = get_placement(p)
    return p.grad if placement.is_whole else gather_whole(p.grad, placement, None)


def style_case(kind: str, plan: dict[str, str], sp: bool) -> dict[str, float]:
    """|split - whole| for the output, the input's gradient and each parameter's gradient."""
    torch.manual_seed(0)
    full = ZOO[kind]()
    split = parallelize(copy.deepcopy(full), plan, None, sequence_parallel=sp)
    x_full, x = _inputs(kind), _inputs(kind)
    y_full, y = full(x_full), split(x)
    w = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(2))
    (y_full * w).sum().backward()
    if sp:  # the row layer reduce-scatters: this rank's positions of the output
        y_full, w = (t.chunk(comm.get_world_size(), dim=1)[comm.get_rank()] for t in (y_full, w))
    (y * w).sum().backward()
    diffs = {"output": (y - y_full).abs().max().item()}
    if x.grad is not None:
        diffs["input grad"] = (x.grad - x_full.grad).abs().max().item()
    want = dict(full.named_parameters())
    for name, p in split.named_parameters():
        diffs[f"grad {name}"] = (_whole_grad(p) - want[name].grad).abs().max().item()
    return diffs


@pytest.mark.parametrize("case", list(CASES))
def test_each_style_computes_like_the_whole_module(case):
    kind, plan, sp = CASES[case]
    for rank, diffs in enumerate(run_distributed(style_case, 2, kind, plan, sp)):
        for what, diff in diffs.items():
            assert diff <= ATOL, f"{case} rank {rank}: {what} differs by {diff:.2e}"


def test_every_style_the_table_runs_has_an_equivalence_test():
    from shardwise.parallel.tensor.styles import STYLES

    tested = {s for _, plan, _ in CASES.values() for s in plan.values()} | set(COVERED_ELSEWHERE)
    untested = sorted(n for n, s in STYLES.items() if s.runs_as and n not in tested)
    assert not untested, f"styles with no equivalence row: {untested}"


# id: (module, plan, what the refusal must say)
REFUSALS = {
    "colwise on a packed q|k|v": ("qkv", {"c_attn": "colwise", "proj": "rowwise"}, "use 'packed_colwise'"),
    "packed_colwise on a plain layer": ("mlp", {"fc": "packed_colwise", "proj": "rowwise"}, "use 'colwise'"),
    "rowwise on a whole input": ("mlp", {"fc": "colwise_rep", "proj": "rowwise"}, "use 'rowwise_split_input'"),
    "rowwise_rep on a split input": ("mlp", {"fc": "colwise", "proj": "rowwise_rep"}, "use 'rowwise'"),
    "rwga on a linear, split input": ("mlp", {"fc": "colwise", "proj": "replicated_with_grad_allreduce"}, "use 'rowwise'"),
    "rwga on a linear, whole input": ("mlp", {"proj": "replicated_with_grad_allreduce"}, "use 'replicate'"),
    "rwga on a norm, whole input": ("mlp", {"ln": "replicated_with_grad_allreduce", **MLP}, "use 'replicate'"),
    "colwise on an embedding": ("embed", {"emb": "colwise"}, "use 'vocab'"),
    "rowwise on a norm": ("mlp", {"ln": "rowwise"}, "not a linear layer"),
    "a refused hf name": ("mlp", {"fc": "packed_rowwise"}, "'packed_rowwise' is fused weights split by row"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_style_that_does_not_fit_is_refused_naming_the_right_one(case):
    kind, plan, says = REFUSALS[case]
    model = ZOO[kind]()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=re.escape(says)):
        parallelize(model, plan, None)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), f"{case}: the model changed"
    assert [type(m) for m in model.modules()] == [type(m) for m in ZOO[kind]().modules()], case


def test_a_plan_naming_a_parameter_stands_for_its_module():
    """transformers 4.57 wrote some plans by parameter ("layers.*.input_layernorm.weight")."""
    styles = match_plan(Mlp(), {"ln.weight": "sequence_parallel", **MLP})
    assert styles["ln"] == "sequence_parallel", styles


@pytest.mark.parametrize("style", ["packed_colwise", "embedding_rowwise", "colwise_gather_output", "rowwise_split_input", "rowwise_rep", "replicated_with_grad_allreduce"])  # fmt: skip
def test_the_config_accepts_every_style_the_library_runs(style):
    from shardwise.config import parse_config

    plan = parse_config({"tensor_parallel": {"plan": {"a": style}}}).tensor_parallel.plan
    assert plan == {"a": style}, style


def test_the_config_refuses_a_refused_style_with_its_reason_not_a_near_name():
    from shardwise.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="'packed_rowwise' is fused weights split by row") as e:
        parse_config({"tensor_parallel": {"plan": {"a": "packed_rowwise"}}})
    assert "did you mean" not in str(e.value), e.value


def test_the_docs_hold_the_style_table():
    from shardwise.parallel.tensor.styles import markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "tensor-parallel.md").read_text()
    assert markdown() in docs, (
        "docs/tensor-parallel.md must hold the table of styles as "
        "shardwise.parallel.tensor.styles.markdown() prints it:\n" + markdown()
    )
