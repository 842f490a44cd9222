"""pipe_partitioned / grad_partitioned: with TP, each TP rank sends 1/N of what crosses a stage.

Specification: under TP2 x PP2 (the "blocks" model split by BLOCKS_PLAN, so the boundary
activation is replicated over the TP pair), turning the two keys on (DeepSpeed's default)
halves the bytes each rank sends point-to-point, adds one all-gather per received message
inside the TP pair, and changes no result: the chunks are reassembled exactly (an all-gather
copies bytes), so losses and parameters are bit-equal (``torch.equal``) to the run with the keys
off. A stage whose output differs across TP ranks is refused with an error naming the key
instead of being silently mixed.
"""

from __future__ import annotations

import torch
from harness import run_distributed
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module

import shardwise
from shardwise import comm
from shardwise.pipe import PipelineModule

MB, GAS, STEPS = 2, 2, 2


def _config(partitioned: bool, plan: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"pipe_partitioned": partitioned, "grad_partitioned": partitioned},
        "tensor_parallel": {"size": 2, "plan": plan},
    }


def train(partitioned: bool) -> dict:
    engine, *_ = shardwise.initialize(
        model=pipeline_module("blocks", 2), config=_config(partitioned, BLOCKS_PLAN)
    )
    data = micro_batches("blocks", engine, MB, GAS, STEPS)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, sent, gathers = [], 0, 0
    for step in range(STEPS):
        comm.reset_stats()
        losses.append(engine.train_batch(data if reads else None))
        stats = comm.stats()
        if step > 0:  # the first batch also sends the shape descriptions
            sent = stats["send"]["bytes"]
            gathers = stats.get("all_gather", {}).get("calls", 0)
    return {
        "losses": losses,
        "params": engine.consolidated_state_dict(),
        "sent": sent,
        "gathers": gathers,
    }


def on_and_off() -> dict:
    return {"on": train(True), "off": train(False)}


def test_each_tp_rank_sends_half_and_nothing_changes():
    for rank, got in enumerate(run_distributed(on_and_off, 4)):
        on, off, tag = got["on"], got["off"], f"TP2xPP2 rank {rank}"
        # Each rank sends GAS tensors of MB x 16 fp32 per batch (stage 0 activations, stage 1
        # their gradients), plus the same small shape description either way: half the data.
        saved = off["sent"] - on["sent"]
        assert saved == GAS * MB * 16 * 4 // 2, f"{tag}: sent {on['sent']} vs {off['sent']} bytes"
        # One all-gather per received message: GAS activations or GAS gradients per batch.
        assert on["gathers"] - off["gathers"] == GAS, f"{tag}: {on['gathers']} all-gathers"
        for step, (a, b) in enumerate(zip(on["losses"], off["losses"], strict=True)):
            assert torch.equal(a, b), f"{tag}: step {step} loss {a.item()} != {b.item()}"
        for key, w in off["params"].items():
            assert torch.equal(on["params"][key], w), f"{tag}: {key} differs"


class RankOffset(torch.nn.Module):
    """Adds the TP rank: a stage output that is NOT the same on the two TP ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.distributed.get_rank() % 2


def split_output_stage(partitioned: bool) -> dict:
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("shardwise").addHandler(handler)
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 16), RankOffset(), torch.nn.Linear(16, 4)]
        model = PipelineModule(
            layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform"
        )
        engine, *_ = shardwise.initialize(model=model, config=_config(partitioned, {}))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(MB, 16, generator=g), torch.randn(MB, 4, generator=g))] * GAS
        reads = engine.is_first_stage() or engine.is_last_stage()
        loss = engine.train_batch(iter(batches) if reads else None)
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    return {"loss": loss, "warned": [m for m in records if "pipe_partitioned" in m]}


def split_output_on_and_off() -> dict:
    return {"on": split_output_stage(True), "off": split_output_stage(False)}


def test_a_stage_output_that_differs_across_tp_ranks_is_sent_whole_with_a_warning():
    results = run_distributed(split_output_on_and_off, 4)
    for rank, got in enumerate(results):
        on, off = got["on"], got["off"]
        assert torch.equal(on["loss"], off["loss"]), f"rank {rank}: the chunks mixed the ranks"
    # Stage 0 is ranks 0 and 1 (TP innermost); its TP rank 0 warns, naming the key.
    assert results[0]["on"]["warned"], "rank 0 did not warn"
    assert not results[0]["off"]["warned"], "warned with the key off"
