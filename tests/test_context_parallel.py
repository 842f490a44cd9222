"""Context parallelism (docs/context-parallel.md): every layout trains like one process.

Each row trains the example GPT (2 blocks, 4 heads, 32-token windows) for five SGD-momentum
steps, every rank on its data rank's windows and its context rank's tokens of them, and is
compared with one process on whole windows (cp_train_runs.py). SGD, not Adam: Adam's update
ignores a constant factor on the gradient, so an average over the wrong ranks would pass.

Tolerance: fp32. Ring attention adds each query's softmax terms block by block (online
log-sum-exp) and Ulysses runs the same attention on a head slice, so outputs differ from one
process by reduction order only (~1e-7 relative, test_context_attention.py); the gradient
average over data x context ranks adds per-rank sums in another order. Measured: losses within
5e-7 and every parameter within 1e-6 of one process (the plain data-parallel run of the same
model on 4 ranks: the same 5e-7 and 1e-6). Bounds: losses 2e-6, parameters 2e-6 (the data-parallel
bound, tests/equivalence.py). A wrong split is far outside: a rank attending only to its own
tokens is off by ~1e-1 in the first loss; an average missing the context ranks doubles or halves
every update.
"""

from __future__ import annotations

import pytest
from cp_train_runs import STEPS, engine_run, forward_error, gqa_attention, gqa_inputs, setup
from equivalence import assert_params_match
from harness import run_distributed
from one_process import reference_run

from shardwise.config import ConfigError
from shardwise.parallel.context import unshard_sequence

# name, processes, layout (cp, method, dp = processes / (cp * tp))
LAYOUTS = [
    ("cp2-ring", 2, {"cp": 2, "method": "ring"}),
    ("cp2-ulysses", 2, {"cp": 2, "method": "ulysses"}),
    ("cp4-ring", 4, {"cp": 4, "method": "ring"}),
    ("cp4-ulysses", 4, {"cp": 4, "method": "ulysses"}),
    ("cp2-ring-bidirectional", 2, {"cp": 2, "method": "ring", "causal": False}),
    ("cp4-ulysses-bidirectional", 4, {"cp": 4, "method": "ulysses", "causal": False}),
    ("dp2-cp2-ring-clip", 4, {"cp": 2, "method": "ring", "clip": 0.5}),
    ("dp2-cp2-ulysses-gas2", 4, {"cp": 2, "method": "ulysses", "gas": 2}),
    ("dp2-cp2-ring-train_batch-gas2", 4, {"cp": 2, "method": "ring", "gas": 2, "api": "train_batch"}),
    ("dp2-cp2-ring-zero1", 4, {"cp": 2, "method": "ring", "zero": 1}),
    ("dp2-cp2-ulysses-zero2", 4, {"cp": 2, "method": "ulysses", "zero": 2}),
    ("dp2-cp2-ring-zero3", 4, {"cp": 2, "method": "ring", "zero": 3}),
    ("cp2-ulysses-zero3-recompute", 2, {"cp": 2, "method": "ulysses", "zero": 3, "recompute": True}),
    ("cp2-ring-recompute", 2, {"cp": 2, "method": "ring", "recompute": True}),
    ("cp2-tp2-ring-clip", 4, {"cp": 2, "method": "ring", "tp": 2, "clip": 0.5}),
    ("cp2-tp2-ulysses-zero1", 4, {"cp": 2, "method": "ulysses", "tp": 2, "zero": 1}),
]  # fmt: skip


def _dp(nproc: int, layout: dict) -> int:
    return nproc // (layout["cp"] * layout.get("tp", 1))


def _assert_matches(results: list[dict], want: dict, name: str, clip: float = 0.0) -> None:
    for rank, got in enumerate(results):
        tag = f"{name} rank {rank}"
        diff = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
        assert diff < 2e-6, f"{tag}: losses {got['losses']} vs one process {want['losses']}"
        assert_params_match(got["params"], want["params"], "sgd", tag)
        if clip:  # the global norm sees each gradient element once, whole
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
    if clip:
        assert max(want["norms"]) > clip, f"{name}: clipping never engaged; the row is void"


@pytest.mark.parametrize("name, nproc, layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_context_parallel_trains_like_one_process(name, nproc, layout):
    dp, gas = _dp(nproc, layout), layout.get("gas", 1)
    clip = layout.get("clip", 0.0)
    want = reference_run(setup(dp, gas, layout.get("causal", True), clip), STEPS)
    _assert_matches(run_distributed(engine_run, nproc, layout), want, name, clip)


# name, processes, the saving layout, the loading layout (each trains part of the steps on
# the same global batch: data x accumulation is 2 in every layout)
RESHARDS = [
    ("dp2-cp2-ring-zero1 -> cp4-ulysses-zero1", 4,
     {"cp": 2, "method": "ring", "zero": 1}, {"cp": 4, "method": "ulysses", "zero": 1, "gas": 2}),
    ("cp4-ring-zero3 -> dp2-cp2-ring-zero3", 4,
     {"cp": 4, "method": "ring", "zero": 3, "gas": 2}, {"cp": 2, "method": "ring", "zero": 3}),
    ("cp2-ulysses -> dp2 without a context split", 2,
     {"cp": 2, "method": "ulysses", "gas": 2}, {"cp": 1, "method": "ring"}),
]  # fmt: skip


@pytest.mark.parametrize("name, nproc, saver, loader", RESHARDS, ids=[c[0] for c in RESHARDS])
def test_checkpoints_load_across_context_sizes(name, nproc, saver, loader, tmp_path):
    """Train, save, load into another context size, train on: the same as one process
    training all the steps (weights, optimizer state and step count move)."""
    path = str(tmp_path / "ckpt")
    first, second = STEPS // 2, STEPS - STEPS // 2
    run_distributed(engine_run, nproc, saver, first, save=path)
    results = run_distributed(engine_run, nproc, loader, second, load=path)
    want = reference_run(setup(_dp(nproc, saver), saver.get("gas", 1)), STEPS)
    for got in results:
        got["losses"] = want["losses"][:first] + got["losses"]
    _assert_matches(results, want, name)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_the_loader_of_initialize_feeds_train_batch_like_one_process(method):
    """``initialize(training_data=...)`` and ``train_batch()`` with no iterator: the context
    ranks of a data rank read the same windows and each trains on its tokens of them; the run
    is the one-process engine's on the same loader (same seed, one data rank: same order)."""
    layout = {"cp": 2, "method": method, "api": "loader", "gas": 2}
    want = run_distributed(engine_run, 1, {**layout, "cp": 1})[0]
    _assert_matches(run_distributed(engine_run, 2, layout), want, f"cp2-{method}-loader")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_grouped_query_attention_matches_torch(method, causal):
    """enable_gqa (Llama, Mistral, Qwen: fewer key/value heads): each rank's rows of the
    output and its tokens' gradients are torch's scaled_dot_product_attention(enable_gqa=True)
    on the whole sequence, within fp32 rounding (5e-6, as test_context_attention.py)."""
    import torch

    q, k, v, grad = (t.requires_grad_() for t in gqa_inputs())
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=True
    )
    out.backward(grad)
    want = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    got = run_distributed(gqa_attention, 2, method, causal)
    for name, full in want.items():
        whole = unshard_sequence([r[name] for r in got], 2, 2)
        err = (whole - full).abs().max().item()
        assert err < 5e-6, f"{method} causal={causal}: {name} differs by {err:.1e}"


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_bf16_trains_like_the_one_process_engine(method):
    """bf16 weights and activations (the kernels keep the softmax statistics in fp32): the
    same run as one process's bf16 engine within bf16 rounding (losses 1e-2 relative,
    parameters 4e-3: the data-parallel bf16 bounds, tests/equivalence.py)."""
    layout = {"cp": 2, "method": method, "bf16": True, "gas": 2}
    want = run_distributed(engine_run, 1, {**layout, "cp": 1})[0]
    for rank, got in enumerate(run_distributed(engine_run, 2, layout)):
        tag = f"cp2-{method}-bf16 rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-2), tag
        for name, w in want["params"].items():
            diff = (got["params"][name] - w).abs().max().item()
            assert diff < 4e-3, f"{tag}: {name} differs by {diff:.1e}"


def test_a_model_without_shardwise_attention_is_refused():
    """Its attention would see a quarter of each sequence and train silently wrong."""
    errors = run_distributed(forward_error, 2, {"cp": 2, "method": "ring"}, "no-attention")
    for rank, error in enumerate(errors):
        assert error.startswith("EngineError: context_parallel.size=2"), f"rank {rank}: {error}"
        assert "shardwise.attention(q, k, v" in error, f"rank {rank}: {error}"


def test_ulysses_needs_heads_divisible_by_the_context_size():
    # Refused by initialize, from the model's head count (found by verify --fuzz: it used to
    # wait for the first forward).
    errors = run_distributed(forward_error, 4, {"cp": 4, "method": "ulysses"}, "gpt-2-heads")
    for rank, error in enumerate(errors):
        assert error.startswith("initialize ConfigError: context_parallel.method 'ulysses' "), (
            f"rank {rank}: refused before any work: {error}"
        )
        assert "context_parallel.size" in error and "2" in error, f"rank {rank}: {error}"
        assert "ring" in error, f"rank {rank}: the fix names the other method: {error}"


@pytest.mark.parametrize(
    "block, key",
    [
        ({"context_parallel": {"size": 2}, "tensor_parallel": {"size": 1, "sequence_parallel": True}},
         "tensor_parallel.sequence_parallel"),
        ({"context_parallel": {"size": 2, "method": "rings"}}, "context_parallel.method"),
        ({"context_parallel": {"size": 0}}, "context_parallel.size"),
    ],
)  # fmt: skip
def test_bad_context_configs_are_refused_before_any_work(block, key):
    import torch

    import shardwise

    config = {"train_batch_size": 2, **block}
    with pytest.raises(ConfigError) as err:
        shardwise.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert key in str(err.value), f"{block}: {err.value}"


def test_a_world_the_context_size_does_not_divide_is_refused():
    import torch

    import shardwise
    from shardwise.topology import TopologyError

    config = {"train_batch_size": 2, "context_parallel": {"size": 2}}
    with pytest.raises(TopologyError, match="context_parallel.size"):
        shardwise.initialize(model=torch.nn.Linear(2, 2), config=config)
