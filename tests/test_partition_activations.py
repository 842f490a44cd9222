"""partition_activations: each tensor-parallel rank keeps 1/N of a checkpointed block's input.

Specification: under TP=N (no sequence parallelism) the input of a checkpointed block is the
same on every TP rank; with partitioning each rank keeps ceil(numel / N) elements of it instead
of numel, backward all-gathers it once per block and recomputes, and nothing else changes.

Memory is counted as in test_activation_checkpointing.py (saved-tensor hooks, distinct storages
that are not parameters). Equality is bit for bit (``torch.equal``, CPU, one thread): the
recompute runs the same kernels on the gathered input, which is the forward's input exactly
(an all-gather copies bytes), with the forward's random states, dropout on. The end-to-end table
through the engine (TP2, TP4, DP2 x TP2, ZeRO-1/2) is in test_tp_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import example_module

import shardwise
from shardwise import comm
from shardwise.monitor.memory import saved_storages
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.parallel.tensor import random as tp_random
from shardwise.parallel.tensor.parallelize import parallelize

B, T, C, LAYERS = 2, 8, 16, 3
MODES = ("no checkpointing", "checkpointing", "partitioned")


def _gpt():
    return example_module("gpt", "model")


def tp_gpt(mode: str, dropout: float = 0.1):
    """The example GPT split over the world by its own plan, blocks checkpointed per ``mode``."""
    m = _gpt()
    torch.manual_seed(0)
    cfg = m.GPTConfig(
        vocab_size=13, block_size=T, n_layer=LAYERS, n_head=4, n_embd=C, dropout=dropout
    )
    model = parallelize(m.GPT(cfg), m.GPT.tp_plan, None)
    if mode != "no checkpointing":
        group = torch.distributed.group.WORLD if mode == "partitioned" else None
        apply_activation_checkpointing(model, "all", partition_group=group)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 13, (B, T + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


def saved_bytes(mode: str) -> int:
    """Activation bytes autograd keeps for backward during one forward of the TP GPT."""
    model = tp_gpt(mode, dropout=0.0)
    return sum(saved_storages(lambda: model(*batch(0)), model.parameters()).values())


def saved_bytes_per_mode() -> dict:
    return {m: saved_bytes(m) for m in MODES[1:]}


def test_each_rank_keeps_one_nth_of_every_block_input():
    for tp in (2, 4):
        results = run_distributed(saved_bytes_per_mode, tp)
        block_input = B * T * C * 4  # fp32 bytes of one block's input, kept whole per block
        for rank, got in enumerate(results):
            saved = got["checkpointing"] - got["partitioned"]
            want = LAYERS * (block_input - block_input // tp)
            assert saved == want, f"TP{tp} rank {rank}: saved {saved} bytes, want {want} ({got})"


def train(mode: str, steps: int = 3) -> dict:
    """Losses, all-gathers per backward and final weights of a few SGD steps, dropout on."""
    model = tp_gpt(mode)
    # Every mode draws the same dropout masks: the default and the per-TP-rank streams restart.
    tp_random.model_parallel_seed(7, torch.distributed.get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, gathers = [], []
    for step in range(steps):
        loss = model(*batch(step))
        comm.reset_stats()
        loss.backward()
        gathers.append(comm.stats().get("all_gather", {}).get("calls", 0))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": losses,
        "gathers": gathers,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
    }


def train_per_mode() -> dict:
    return {m: train(m) for m in MODES}


@pytest.mark.parametrize("tp", [2, 4], ids=["TP2", "TP4"])
def test_training_is_bit_equal_with_partitioned_inputs(tp):
    results = run_distributed(train_per_mode, tp)
    for rank, runs in enumerate(results):
        want = runs["no checkpointing"]
        for mode in MODES[1:]:
            got, tag = runs[mode], f"TP{tp} rank {rank} {mode}"
            for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
                assert torch.equal(a, b), f"{tag}: step {step} loss {a.item()} != {b.item()}"
            for key, w in want["params"].items():
                assert torch.equal(got["params"][key], w), f"{tag}: {key} differs"
        # One all-gather per checkpointed block in backward, none otherwise.
        assert runs["partitioned"]["gathers"] == [LAYERS] * 3, f"TP{tp} rank {rank}"
        assert runs["checkpointing"]["gathers"] == [0] * 3, f"TP{tp} rank {rank}"


def test_sequence_parallel_with_partition_activations_is_refused_naming_the_key():
    config = {
        "train_batch_size": 2,
        "tensor_parallel": {"size": 2, "sequence_parallel": True},
        "activation_checkpointing": {"partition_activations": True},
    }
    with pytest.raises(shardwise.ConfigError, match="sequence_parallel") as err:
        shardwise.initialize(model=tp_gpt_unsplit(), config=config)
    assert err.value.key == "activation_checkpointing.partition_activations"


def tp_gpt_unsplit():
    m = _gpt()
    torch.manual_seed(0)
    return m.GPT(m.GPTConfig(vocab_size=13, block_size=T, n_layer=1, n_head=4, n_embd=C))


class _Mpu:
    """Megatron's mpu, as DeepSpeed scripts pass it to ``checkpointing.configure``."""

    def get_tensor_model_parallel_group(self):
        return torch.distributed.group.WORLD

    def get_tensor_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank()


def deepspeed_style(partition: bool) -> dict:
    """DeepSpeed's call path: configure(mpu, partition_activations=...), then checkpoint()."""
    import shardwise.checkpointing as ckpt
    from shardwise.parallel.activation import recompute  # where configure() keeps its state

    before = dict(recompute._state)
    try:
        ckpt.configure(_Mpu(), partition_activations=partition)
        torch.manual_seed(0)
        lin = torch.nn.Linear(C, C)
        x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1), requires_grad=True)
        comm.reset_stats()
        ckpt.checkpoint(lin, x).square().sum().backward()
        gathers = comm.stats().get("all_gather", {}).get("calls", 0)
        return {"gathers": gathers, "grad": x.grad}
    finally:
        recompute._state.update(before)


def deepspeed_style_on_and_off() -> tuple:
    return deepspeed_style(True), deepspeed_style(False)


def test_deepspeed_configure_with_an_mpu_partitions_checkpoint_calls():
    for rank, (on, off) in enumerate(run_distributed(deepspeed_style_on_and_off, 2)):
        assert on["gathers"] == 1 and off["gathers"] == 0, f"rank {rank}: {on}, {off}"
        assert torch.equal(on["grad"], off["grad"]), f"rank {rank}: input gradients differ"
