"""The ``compile`` block, ``engine.compile`` and which regions compile, without processes.

The layouts themselves are tests/test_compile.py; here: DeepSpeed's keys and defaults (0.14's
``enabled``/``backend``/``kwargs``, 0.19's DeepCompile keys), the refusals naming the key, the
regions chosen (a block list, a model without blocks; a pipeline stage's layers: test_compile.py), and
DeepSpeed's call ``engine.compile()`` after ``initialize`` on one process.
"""

from __future__ import annotations

import pytest
import torch
from models import TinyMLP, make_gpt, make_tokens

import shardwise
from shardwise.config import ConfigError, parse_config
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.parallel.compile import compile_regions, is_compiled
from shardwise.training.compiling import whole_model
from shardwise.verify.layout_names import layout_config, parse_layout

GOOD = [
    # block, what it parses to (enabled, backend, kwargs)
    ({}, (False, "inductor", {})),  # DeepSpeed 0.14's defaults
    ({"enabled": True}, (True, "inductor", {})),
    (
        {"enabled": True, "backend": "aot_eager", "kwargs": {"mode": "default"}},
        (True, "aot_eager", {"mode": "default"}),
    ),  # fmt: skip
    ({"deepcompile": False, "free_activation": True}, (False, "inductor", {})),  # 0.19's keys
]


@pytest.mark.parametrize("block,want", GOOD, ids=[str(b) for b, _ in GOOD])
def test_the_compile_block_takes_deepspeed_keys_and_defaults(block, want):
    c = parse_config({"compile": block}).compile
    assert (c.enabled, c.backend, c.kwargs) == want, f"compile block {block}"


BAD = [
    ({"deepcompile": True}, "compile.deepcompile"),
    ({"kwargs": {"fullgrahp": True}}, "compile.kwargs.fullgrahp"),
    ({"kwargs": {"backend": "eager"}}, "compile.kwargs.backend"),
    ({"enabled": "yes"}, "compile.enabled"),
    ({"enable": True}, "compile.enable"),
]


@pytest.mark.parametrize("block,key", BAD, ids=[k for _, k in BAD])
def test_a_wrong_compile_block_is_refused_naming_the_key(block, key):
    with pytest.raises(ConfigError) as e:
        parse_config({"compile": block})
    assert key in str(e.value), f"compile block {block}: {e.value}"


def _hooked() -> torch.nn.Module:
    gpt = make_gpt()
    gpt.blocks[1].attn.register_forward_pre_hook(lambda m, a: None)  # as ZeRO-3's gathers
    return gpt


def _checkpointed() -> torch.nn.Module:
    gpt = make_gpt()
    apply_activation_checkpointing(gpt, "all")
    return gpt


REGIONS = [
    # case, model, whole (the layout allows one region), the regions' names
    ("blocks", make_gpt, False, ["blocks.0", "blocks.1"]),
    ("whole", make_gpt, True, [""]),  # DP, ZeRO-1/2: nothing eager between blocks
    ("whole, a module hook", _hooked, True, ["blocks.0", "blocks.1"]),
    ("whole, checkpointed blocks", _checkpointed, True, ["blocks.0", "blocks.1"]),
    ("no block list", TinyMLP, False, [""]),
]


@pytest.mark.parametrize("case,build,whole,want", REGIONS, ids=[c[0] for c in REGIONS])
def test_regions_are_the_whole_model_unless_something_stays_eager_between_blocks(
    case, build, whole, want
):
    got = [n for n, _ in compile_regions(build(), whole)]
    assert got == want, f"{case}: regions {got}"


WHOLE = [
    # case, zero_optimization, the model compiles as one region
    ("ZeRO-2", {"stage": 2}, True),
    ("ZeRO-3, every parameter under the persistence threshold", {"stage": 3}, True),
    ("ZeRO-3, a threshold of 1: gathers", {"stage": 3, "stage3_param_persistence_threshold": 1}, False),
    ("ZeRO-3, over the model's persistence budget", {"stage": 3, "stage3_model_persistence_threshold": 1000}, False),
]  # fmt: skip


@pytest.mark.parametrize("case,zero,want", WHOLE, ids=[c[0] for c in WHOLE])
def test_a_layout_compiles_whole_unless_zero3_gathers_between_blocks(case, zero, want):
    """ZeRO-3 that keeps every parameter whole (the test GPT's largest has 1,024 elements,
    under DeepSpeed's default threshold of 100,000) installs no gather hook: nothing runs
    between blocks, as under ZeRO-2; one that shards does, and stays per block."""
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    assert whole_model(cfg, make_gpt()) is want, case


def _train(engine, steps: int = 2) -> list[float]:
    x, y = make_tokens(2 * steps)
    losses = []
    for k in range(steps):
        loss = engine(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_engine_compile_after_initialize_compiles_the_model_and_trains_the_same():
    eager, *_ = shardwise.initialize(model=make_gpt(), config=CONFIG)
    want = _train(eager)
    engine, *_ = shardwise.initialize(model=make_gpt(), config=CONFIG)
    assert not engine.is_compiled
    engine.compile(backend="eager")  # DeepSpeed's call; "eager": dynamo only, no codegen
    assert engine.is_compiled
    assert is_compiled(engine.module), "plain data parallelism: the whole model is one region"
    engine.compile(backend="eager")  # a second call does nothing (DeepSpeed's rule)
    # dynamo's "eager" backend runs the captured graph as is: the same ops, the same sums
    assert _train(engine) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"schedule": [(0, [])]}, "schedule"),
        ({"compiled_autograd_enabled": True}, "compiled_autograd_enabled"),
        ({"backend": "no.such.backend"}, "compile.backend"),
        ({"compile_kwargs": {"modes": "max"}}, "compile_kwargs.modes"),
    ],
)
def test_engine_compile_refuses_what_it_cannot_do(kwargs, says):
    engine, *_ = shardwise.initialize(model=make_gpt(), config=CONFIG)
    with pytest.raises(ValueError) as e:
        engine.compile(**kwargs)
    assert says in str(e.value), f"engine.compile({kwargs}): {e.value}"
    assert not engine.is_compiled, f"engine.compile({kwargs}) compiled something"


@pytest.mark.parametrize(
    "name,method",  # the context-parallel rows: test_compile_cp_ep.py trains them compiled
    [("dp2", None), ("cp2", "ring"), ("cp2xulysses", "ulysses"), ("dp2xcp2", "ring")],
)
def test_verify_compile_sets_the_block_for_layouts_and_the_reference_stays_eager(name, method):
    layout = parse_layout(name)
    compiled = layout_config({}, layout.__class__(**{**vars(layout), "compile": "aot_eager"}), 8)
    assert compiled["compile"] == {"enabled": True, "backend": "aot_eager"}, name
    got = compiled.get("context_parallel", {}).get("method")
    assert got == method, f"{name}: context_parallel.method {got!r} under --compile"
    assert "compile" not in layout_config({}, layout, 8), f"{name}: no --compile: the script's"
    torch._dynamo.reset()
