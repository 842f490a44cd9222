"""Which layouts the planner enumerates (issue 31): every one the library runs, each shown.

Context parallelism (ring and Ulysses) for a model that attends through shardwise.attention,
GPipe, 1F1B, interleaved and the zero-bubble schedules for pipelines, optimizer offload at
ZeRO stages 1-3, and none the library refuses (context with pipelines, sequence parallelism
or MoE; Ulysses when a tensor-parallel rank's heads do not divide by cp; offload without
ZeRO): every enumerated layout's config is one the library's parser accepts.
"""

from __future__ import annotations

import pytest

from shardwise.config import parse_config
from shardwise.plan import PRESETS, Dims, Planner, build, candidates, read_model, to_config
from shardwise.plan.candidates import Layout
from shardwise.plan.memory import range_params
from shardwise.plan.report import table

GPT = Dims(layers=4, hidden=64, heads=4, vocab=64, seq=32)
SHAPE = read_model(build(GPT))
ALL = list(candidates(SHAPE, 4, 4, 8, seq=GPT.seq))

# (name, predicate a layout must satisfy for at least one enumerated layout)
PRESENT = [
    ("cp2 ring", lambda x: x.cp == 2 and x.cp_method == "ring"),
    ("cp4 ulysses", lambda x: x.cp == 4 and x.cp_method == "ulysses"),
    ("cp2 with tp2", lambda x: x.cp == 2 and x.tp == 2),
    ("cp2 with dp2 zero3", lambda x: x.cp == 2 and x.dp == 2 and x.zero_stage == 3),
    ("gpipe", lambda x: x.pp == 2 and x.schedule == "gpipe"),
    ("interleaved", lambda x: x.pp == 2 and x.schedule == "interleaved"),
    ("offload zero1", lambda x: x.offload and x.zero_stage == 1),
    ("offload zero3", lambda x: x.offload and x.zero_stage == 3),
]
ABSENT = [
    ("cp with a pipeline", lambda x: x.cp > 1 and x.pp > 1),
    ("cp with sequence parallelism", lambda x: x.cp > 1 and x.sequence_parallel),
    ("ulysses, 2 heads per tp rank over cp4", lambda x: x.cp_method == "ulysses" and x.tp * x.cp > 4),
    ("interleaved, micro-batches not a multiple of pp", lambda x: x.schedule == "interleaved" and x.grad_accum % x.pp),
    ("offload without ZeRO", lambda x: x.offload and x.zero_stage == 0),
]  # fmt: skip


@pytest.mark.parametrize("name,has", PRESENT, ids=[p[0] for p in PRESENT])
def test_enumerated(name, has):
    assert any(has(x) for x in ALL), name


@pytest.mark.parametrize("name,has", ABSENT, ids=[p[0] for p in ABSENT])
def test_not_enumerated(name, has):
    assert not any(has(x) for x in ALL), [x.name() for x in ALL if has(x)][:3]


def test_every_enumerated_layout_is_a_config_the_library_accepts():
    """A plan's --write-config must start: each layout's config parses (an offload at
    stage 0 once did not: the benchmark's sweep ran it and the library refused it)."""
    for layout in ALL:
        parse_config(to_config(layout, "fp32", SHAPE))  # raises ConfigError naming the key


def test_context_needs_shardwise_attention_and_an_even_split():
    """A model that does not say it calls shardwise.attention gets no context split unless
    asked (--cp); a sequence that 2 cp chunks do not divide gets none either."""
    plain = read_model(build(GPT))
    plain.context_attention = False
    assert {x.cp for x in candidates(plain, 4, 4, 8, seq=32)} == {1}
    assert {x.cp for x in candidates(plain, 4, 4, 8, seq=32, cp_sizes=[2])} == {2}
    assert {x.cp for x in candidates(SHAPE, 4, 4, 8, seq=12)} == {1, 2}  # 12 % 8 != 0


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_layouts_show_in_table_json_and_config(method):
    """Context parallelism cuts the tokens a rank holds: activations 1/cp of cp1's (within
    the positions' own rows, 10%), traffic on the context axis, the config's block."""
    planner = Planner(SHAPE, PRESETS["a100-80g"], 4, GPT.seq, "fp32")
    one = planner.evaluate(Layout(1, 1, 1, 0, 2, 2))
    two = planner.evaluate(Layout(1, 1, 1, 0, 2, 2, cp=2, cp_method=method))
    ratio = two["memory"]["activations"] / one["memory"]["activations"]
    assert ratio == pytest.approx(0.5, rel=0.1), ratio
    assert two["comm_bytes"]["context"] > 0 and one["comm_bytes"]["context"] == 0
    assert f"2 {method}" in table([two], 1)
    cfg = to_config(Layout(1, 1, 1, 0, 2, 2, cp=2, cp_method=method), "fp32")
    assert cfg["context_parallel"] == {"size": 2, "method": method}


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_a_tied_head_is_held_by_each_stage_using_it(pp):
    """Tied (--arch gpt's default): one copy on one stage; in a pipeline the first stage
    holds the embedding and the last the head, the same (V, h) tensor on both."""
    shape = read_model(build(GPT))
    planner = Planner(shape, PRESETS["a100-80g"], 8, GPT.seq, "fp32")
    lay = Layout(1, 1, pp, 0, 1, 8)
    held = [sum(p.numel for p in range_params(shape, planner.ranges(lay, s))) for s in range(pp)]
    copies = 1 if pp == 1 else 2
    assert sum(held) == shape.numel + (copies - 1) * GPT.vocab * GPT.hidden, held
