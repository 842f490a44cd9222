"""Activation checkpointing saves less for backward and changes no result.

Memory is counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves
for backward passes the pack hook. Activation bytes are the distinct storages among them that are
not a parameter's (a Linear saves its weight, which exists anyway). A checkpointed block's own
saves are intercepted by ``torch.utils.checkpoint`` (its hooks are innermost) and never stored;
what it keeps is the block's input, which torch saves through the same hooks (torch 2.13), so
the count includes it.

Equality is bit for bit (``torch.equal``), on CPU with one thread (conftest.py): the recompute
runs the same kernels on the same inputs, so every saved tensor it rebuilds, hence every
gradient, is identical, dropout included once the RNG is replayed. Any tolerance would hide a
recompute that draws another dropout mask (a change of order 1 on the masked elements, about
1e-3 on the loss here).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from equivalence import STEPS, assert_layout_matches, engine_run, setup
from harness import run_distributed
from models import make_gpt
from one_process import reference_run
from torch import nn

import shardwise
from shardwise.checkpointing import checkpoint
from shardwise.parallel.activation import recompute  # configure() keeps its state there
from shardwise.parallel.activation.selective import apply_activation_checkpointing, is_checkpointed
from shardwise.parallel.tensor import random as tp_random
from shardwise.parallel.tensor.random import TP_STREAM, RNGStatesTracker

B, T = 2, 16
SMALL = dict(vocab_size=32, block_size=T, n_layer=4, n_head=2, n_embd=32, dropout=0.1)  # make_gpt


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed)
    )


def saved_for_backward(run, params) -> tuple[int, int]:
    """(tensors saved, activation bytes: distinct non-parameter storages) while ``run()`` runs."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    count, storages = 0, {}

    def pack(t):
        nonlocal count
        count += 1
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return count, sum(storages.values())


# ----------------------------------------------------------------------------- memory
def test_a_checkpointed_block_saves_only_its_input():
    plain = make_gpt(**SMALL)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, "all")
    x = torch.randn(B, T, SMALL["n_embd"], requires_grad=True)
    n_plain, bytes_plain = saved_for_backward(lambda: plain.blocks[0](x), plain.parameters())
    n_ckpt, bytes_ckpt = saved_for_backward(lambda: ckpt.blocks[0](x), ckpt.parameters())
    # Measured: 29 tensors, 86,528 bytes (21 inputs' worth: LayerNorm stats, q/k/v, attention,
    # the 4C-wide MLP hidden, dropout masks) against the input alone, kept for the recompute.
    assert n_plain > 20 and bytes_plain > 15 * x.nbytes, (n_plain, bytes_plain)
    assert (n_ckpt, bytes_ckpt) == (1, x.nbytes), f"checkpointed: {n_ckpt} tensors, {bytes_ckpt} B"


def test_checkpointing_every_block_cuts_saved_activations_tenfold():
    """GPT n_layer=4, C=32, B*T=32, dropout 0.1, loss included. Measured: off, 129 tensors and
    363,140 activation bytes; on, 17 tensors and 33,412 bytes: the 4 block inputs (4,096 bytes
    each) and what the embeddings, final norm, head and loss save (17,028 bytes): 10.9x less.
    """
    plain = make_gpt(**SMALL)
    ckpt = copy.deepcopy(plain)
    names = apply_activation_checkpointing(ckpt, "all")
    assert names == [f"blocks.{i}" for i in range(SMALL["n_layer"])]
    idx = tokens()
    n_plain, bytes_plain = saved_for_backward(lambda: plain(idx, idx), plain.parameters())
    n_ckpt, bytes_ckpt = saved_for_backward(lambda: ckpt(idx, idx), ckpt.parameters())
    assert n_ckpt * 7 < n_plain, f"tensors saved: {n_ckpt} with checkpointing, {n_plain} without"
    assert bytes_ckpt * 10 < bytes_plain, (
        f"activation bytes: {bytes_ckpt} with checkpointing, {bytes_plain} without"
    )


def test_wrapping_keeps_names_and_runs_the_blocks_under_checkpoint():
    plain, ckpt = make_gpt(**SMALL), make_gpt(**SMALL)
    apply_activation_checkpointing(ckpt, ["blocks.[123].mlp", 0])
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_modules()] == [n for n, _ in plain.named_modules()]
    chosen = {n for n, m in ckpt.named_modules() if is_checkpointed(m)}
    assert chosen == {"blocks.0", "blocks.1.mlp", "blocks.2.mlp", "blocks.3.mlp"}, chosen
    copied = copy.deepcopy(ckpt)  # the wrapped forward must call the copy's own modules
    assert copied.blocks[0].forward.__self__ is copied.blocks[0]


# ----------------------------------------------------------------------------- results
def train(model: nn.Module, steps: int = 3) -> dict:
    """A few AdamW steps on one batch stream; losses, last grads, final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(123)  # dropout's stream: the same for both runs
    losses, grads = [], {}
    for step in range(steps):
        idx = tokens(seed=step)
        loss = model(idx, idx)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "grads": grads, "params": dict(model.state_dict())}


def assert_bit_equal(got: dict, want: dict, tag: str) -> None:
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert torch.equal(a, b), f"{tag}: loss of step {i} differs: {a.item()} vs {b.item()}"
    for kind in ("grads", "params"):
        for name, w in want[kind].items():
            diff = (got[kind][name] - w).abs().max().item()
            assert torch.equal(got[kind][name], w), f"{tag}: {kind} {name} differs by {diff:.2e}"


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("layers", ["all", ["blocks.[012].attn", 3], ["blocks.1"]])
def test_training_is_bit_equal_with_checkpointing(layers, dropout):
    want = train(make_gpt(**SMALL | {"dropout": dropout}))
    model = make_gpt(**SMALL | {"dropout": dropout})
    apply_activation_checkpointing(model, layers)
    assert_bit_equal(train(model), want, f"checkpoint_layers={layers} dropout={dropout}")


def test_deepspeed_style_checkpoint_call():
    """``deepspeed.checkpointing.checkpoint(block, x)`` in a model's forward, as Megatron does."""

    class Checkpointed(nn.Module):
        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, idx, targets):
            g = self.gpt
            x = g.drop(g.tok_emb(idx) + g.pos_emb(torch.arange(idx.shape[1])))
            for block in g.blocks:
                x = shardwise.checkpointing.checkpoint(block, x)
            logits = g.head(g.ln_f(x))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    want = train(make_gpt(**SMALL))
    got = train(Checkpointed(make_gpt(**SMALL)))
    got["grads"] = {k.removeprefix("gpt."): v for k, v in got["grads"].items()}
    got["params"] = {k.removeprefix("gpt."): v for k, v in got["params"].items()}
    assert_bit_equal(got, want, "shardwise.checkpointing.checkpoint")


# --------------------------------------------------------------- tensor-parallel RNG trackers
class TrackerDropout(nn.Module):
    """Dropout drawn from a tracker's stream, as tensor-parallel attention dropout is."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x):
        with self.tracker.fork(TP_STREAM):
            return F.dropout(torch.tanh(self.fc(x)), p=0.5)


def test_checkpoint_replays_the_tensor_parallel_tracker_streams():
    """fork() swaps the tracker's state into the default generator, out of torch's own stash:
    without the replay the recompute draws a new mask and the gradient is wrong."""
    tracker = RNGStatesTracker()
    results = []
    for wrap in (False, True):
        tracker.reset()
        tracker.add(TP_STREAM, 7)
        torch.manual_seed(0)
        layer = TrackerDropout(tracker)
        x = torch.randn(4, 8)
        # Two draws per step: recomputing the second must not rewind the stream for the
        # first, and the second step checks the stream is where the plain run leaves it.
        for _ in range(2):
            out = checkpoint(layer, checkpoint(layer, x)) if wrap else layer(layer(x))
            out.square().sum().backward()
        state = tracker.get_states()[TP_STREAM]["cpu"]
        results.append((out.detach(), layer.fc.weight.grad.clone(), state))
    for what, a, b in zip(("output", "grad", "tracker state"), *results, strict=True):
        assert torch.equal(a, b), (
            f"{what} differs with checkpointing: the tracker stream was not replayed and restored"
        )


@pytest.fixture
def default_tracker():
    """The process's default tracker and torch's generator, put back after the test."""
    tracker = tp_random.get_rng_tracker()
    saved = tracker.get_states()
    with torch.random.fork_rng():
        yield tracker
    tracker.reset()
    tracker.set_states(saved)


def test_deepspeed_seeding_names_reach_the_tracker(monkeypatch, default_tracker):
    import shardwise.checkpointing as ckpt

    assert ckpt.get_cuda_rng_tracker() is default_tracker
    monkeypatch.setattr(recompute, "_state", {"block": None, "mpu": None})
    tracker = ckpt.get_cuda_rng_tracker()
    want = torch.Generator().manual_seed(5 + tp_random.TP_SEED_OFFSET + 1).get_state()
    ckpt.model_parallel_cuda_manual_seed(5, tp_rank=1)
    assert torch.equal(tracker.get_states()[TP_STREAM]["cpu"], want), "explicit tp_rank"

    class MPU:  # Megatron's model-parallel unit, as DeepSpeed scripts pass it to configure
        def get_model_parallel_rank(self) -> int:
            return 1

    ckpt.configure(MPU())
    ckpt.model_parallel_cuda_manual_seed(5)
    assert torch.equal(tracker.get_states()[TP_STREAM]["cpu"], want), "rank from configure(mpu)"
    ckpt.configure(None)
    monkeypatch.setattr(recompute.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(recompute.dist, "get_world_size", lambda: 4)
    with pytest.raises(ValueError, match="tp_rank=engine.mesh.tp_rank"):
        ckpt.model_parallel_cuda_manual_seed(5)


# ----------------------------------------------------------------------------- the engine
def test_engine_applies_checkpoint_layers_and_trains_bit_equal():
    def run(ac: dict) -> dict:
        config = {
            "train_micro_batch_size_per_gpu": B,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        }
        engine, *_ = shardwise.initialize(model=make_gpt(**SMALL), config={**config, **ac})
        torch.manual_seed(123)
        losses = []
        for step in range(3):
            idx = tokens(seed=step)
            loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        checkpointed = [n for n, m in engine.module.named_modules() if is_checkpointed(m)]
        return {
            "losses": losses,
            "grads": {},
            "params": engine.consolidated_state_dict(),
            "ckpt": checkpointed,
        }

    want = run({})
    got = run({"activation_checkpointing": {"checkpoint_layers": "all"}})
    assert got["ckpt"] == [f"blocks.{i}" for i in range(SMALL["n_layer"])], got["ckpt"]
    assert want["ckpt"] == []
    assert_bit_equal(got, want, "engine with checkpoint_layers=all")


CLIP = 0.05
AC = {"activation_checkpointing": {"checkpoint_layers": ["fc1", "fc2"]}}
# (name, dp, gas, extra config): the equivalence contract of tests/equivalence.py, tolerances
# as in test_dp.py / test_zero.py (checkpointing itself adds no difference: see above).
LAYOUTS = [
    ("ac-dp1", 1, 2, {}),
    ("ac-dp2", 2, 1, {}),
    ("ac-dp2-gas2-zero2", 2, 2, {"zero_optimization": {"stage": 2}}),
    (
        "ac-dp2-zero3",
        2,
        1,
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    ),
]


def engine_run_counting_runs(*args, **kwargs) -> dict:
    """``equivalence.engine_run``, also counting the runs of checkpointed functions: each
    checkpointed module runs twice per micro-batch (forward, then the recompute in backward)."""
    runs = []
    original = torch.utils.checkpoint.checkpoint

    def counting(fn, *a, **kw):
        def counted(*x, **y):
            runs.append(1)
            return fn(*x, **y)

        return original(counted, *a, **kw)

    torch.utils.checkpoint.checkpoint = counting
    try:
        result = engine_run(*args, **kwargs)
    finally:
        torch.utils.checkpoint.checkpoint = original
    return {**result, "runs": len(runs)}


@pytest.mark.parametrize("name,dp,gas,extra", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_layout_with_checkpointing_trains_like_one_process(name, dp, gas, extra):
    want = reference_run(setup(dp, gas, CLIP, "sgd"), STEPS)
    args = (dp, gas, CLIP, "sgd")
    if dp == 1:
        results = [engine_run_counting_runs(*args, **AC, **extra)]
    else:
        results = run_distributed(engine_run_counting_runs, dp, *args, **AC, **extra)
    assert_layout_matches(results, want, name, "sgd", "fp32", CLIP)
    runs = 2 * len(AC["activation_checkpointing"]["checkpoint_layers"]) * STEPS * gas
    for rank, got in enumerate(results):
        assert got["runs"] == runs, f"layout {name} rank {rank}: {got['runs']} runs, not {runs}"


def gpt_zero3_on_and_off() -> list[dict]:
    """GPT with dropout under ZeRO-3 on this rank, without and with every block checkpointed.
    A checkpointed block's children gather their units in forward and again in the recompute."""
    results = []
    for ac in ({}, {"activation_checkpointing": {"checkpoint_layers": "all"}}):
        config = {
            "train_micro_batch_size_per_gpu": B,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            **ac,
        }
        engine, *_ = shardwise.initialize(model=make_gpt(**SMALL), config=config)
        torch.manual_seed(123 + engine.dp_rank)
        losses = []
        for step in range(2):
            idx = tokens(seed=10 * step + engine.dp_rank)
            loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        results.append({"losses": losses, "grads": {}, "params": engine.consolidated_state_dict()})
    return results


def test_gpt_under_zero3_dp2_is_bit_equal_with_checkpointing():
    for rank, (want, got) in enumerate(run_distributed(gpt_zero3_on_and_off, 2)):
        assert_bit_equal(got, want, f"GPT ZeRO-3 dp2 rank {rank}, checkpoint_layers=all")


# ----------------------------------------------------------------------------- bad input
BAD = [
    ({"checkpoint_layers": "some"}, "activation_checkpointing.checkpoint_layers", 'or "all"'),
    ({"checkpoint_layers": True}, "activation_checkpointing.checkpoint_layers", "got true"),
    ({"checkpoint_layers": [-1]}, "activation_checkpointing.checkpoint_layers[0]", ">= 0"),
    (
        {"checkpoint_layers": ["blocks.0", "all"]},
        "activation_checkpointing.checkpoint_layers[1]",
        "on its own",
    ),
    (
        {"checkpoint_layers": ["blocks..0"]},
        "activation_checkpointing.checkpoint_layers[0]",
        "not a module name",
    ),
    ({"checkpoint_layers": [1.5]}, "activation_checkpointing.checkpoint_layers", "got a list"),
]


@pytest.mark.parametrize("block,key,message", BAD, ids=[str(b) for b, _, _ in BAD])
def test_bad_config_values_name_the_key(block, key, message):
    with pytest.raises(shardwise.ConfigError, match=message) as err:
        shardwise.initialize(
            model=make_gpt(**SMALL),
            config={"train_batch_size": 2, "activation_checkpointing": block},
        )
    assert err.value.key == key, f"{block}: the error names {err.value.key!r}, not {key!r}"


MODEL_MISMATCH = [
    (["blokcs.*"], "matches no module"),
    ([4], "out of range"),
    (["blocks.0", "blocks.0.mlp"], "inside 'blocks.0'"),
]


@pytest.mark.parametrize("layers,message", MODEL_MISMATCH, ids=[str(m) for _, m in MODEL_MISMATCH])
def test_layers_the_model_lacks_are_refused_by_initialize(layers, message):
    config = {"train_batch_size": 2, "activation_checkpointing": {"checkpoint_layers": layers}}
    with pytest.raises(shardwise.ConfigError, match=message) as err:
        shardwise.initialize(model=make_gpt(**SMALL), config=config)
    assert err.value.key == "activation_checkpointing.checkpoint_layers"


def test_all_needs_a_block_list():
    with pytest.raises(shardwise.ConfigError, match="no nn.ModuleList"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "all")


def test_unsupported_deepspeed_keys_are_refused_by_initialize():
    config = {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True}}
    with pytest.raises(shardwise.ConfigError, match="activation_checkpointing.cpu_checkpointing"):
        shardwise.initialize(model=make_gpt(**SMALL), config=config)


def test_partition_activations_with_one_tensor_parallel_rank_changes_nothing():
    # Nothing to split over (DeepSpeed does the same with one model-parallel rank): accepted,
    # and the blocks run under the plain checkpoint. TP > 1: test_partition_activations.py.
    config = {
        "train_batch_size": 2,
        "activation_checkpointing": {"partition_activations": True, "checkpoint_layers": "all"},
    }
    engine, *_ = shardwise.initialize(model=make_gpt(**SMALL), config=config)
    assert all(is_checkpointed(b) for b in engine.module.blocks)


def test_configure_takes_deepspeeds_arguments_and_refuses_what_it_lacks(monkeypatch):
    import shardwise.checkpointing as ckpt

    monkeypatch.setattr(recompute, "_state", {"block": None, "mpu": None})
    assert not ckpt.is_configured()
    config = {
        "train_batch_size": 8,
        "activation_checkpointing": {"contiguous_memory_optimization": True},
    }
    ckpt.configure(
        None, deepspeed_config=config, num_checkpoints=4, synchronize=True, profile=False
    )
    assert ckpt.is_configured()
    assert recompute._state["block"].number_checkpoints == 4
    assert recompute._state["block"].contiguous_memory_optimization
    ckpt.reset()
    with pytest.raises(shardwise.ConfigError, match="checkpoint_in_cpu") as err:
        ckpt.configure(None, checkpoint_in_cpu=True)
    assert err.value.key == "activation_checkpointing.cpu_checkpointing"
    with pytest.raises(shardwise.ConfigError, match="cpu_checkpointing"):
        ckpt.configure(
            None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}}
        )
    # Accepted; without an mpu there is no group to split over (test_partition_activations.py).
    ckpt.configure(None, partition_activations=True)
    assert recompute._state["block"].partition_activations
    with pytest.raises(shardwise.ConfigError, match="number_checkpoints"):
        ckpt.configure(None, num_checkpoints=0)
