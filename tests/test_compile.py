"""Every layout, compiled block by block, trains like the eager one-process run.

The table: each layout trains the example GPT (two blocks, width 16) for STEPS steps with
``"compile": {"enabled": true}`` on the same global batches as tests/one_process.py's plain
PyTorch loop (no compile), SGD with momentum and clipping engaged; the pipeline row trains
pipe_models' "blocks" model. Compared: every step's loss and gradient norm and the final
parameters; and, from dynamo's counters (``torch._dynamo.utils.counters``) on every rank: no
graph break at all (the only frames compiled are the blocks' forwards, so a break anywhere
would be inside a block) and no graph compiled after the second step (a recompile).

Tolerance (fp32): "aot_eager" runs the same aten ops as eager after AOTAutograd's
decompositions, Inductor fuses and reorders the sums inside a block (its C++ reductions
vectorize over 8 or 16 lanes), and the layouts themselves reorder sums (test_tp_engine.py
measured 1e-6). Measured here over STEPS steps: losses within 1.1e-7 relative, norms within
2.2e-7, parameters within 1.5e-8 (Inductor's row as aot_eager's). Bounds: 1e-5 relative on losses and norms, 1e-5 absolute on parameters; a lost
reduction or a block skipped by the hooks is off by 1e-2 or more.

Cost: aot_eager for the table (no C++ to build), Inductor for one row (ZeRO-3, whose parameters change storage between calls), one cache directory
per session (``TORCHINDUCTOR_CACHE_DIR``) so that runs of several developers never share one.
"""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_distributed
from models import make_gpt, make_tokens, rank_slice
from one_process import global_batches, reference_run
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module
from pipe_models import setup as pipe_setup

import shardwise
from shardwise.parallel.compile import is_compiled
from shardwise.verify import VerifySetup

STEPS, MB, LR, CLIP = 6, 2, 0.05, 0.3
SGD = {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}

SHARDED = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every parameter gathered

LAYOUTS = [
    # name, world, backend, config blocks; every row on 2 processes (one reused world)
    ("dp2", "aot_eager", {}),
    ("dp2-zero1", "aot_eager", {"zero_optimization": {"stage": 1}}),
    ("dp2-zero2", "aot_eager", {"zero_optimization": {"stage": 2}}),
    ("dp2-zero3", "aot_eager", {"zero_optimization": SHARDED}),
    ("dp2-zero3-whole", "aot_eager", {"zero_optimization": {"stage": 3}}),
    ("dp2-zero3-ckpt", "aot_eager", {"zero_optimization": SHARDED, "ckpt": True}),
    ("tp2", "aot_eager", {"tensor_parallel": {"size": 2}}),
    ("tp2-sp", "aot_eager", {"tensor_parallel": {"size": 2, "sequence_parallel": True}}),
    ("tp2-ckpt", "aot_eager", {"tensor_parallel": {"size": 2}, "ckpt": True}),
    ("pp2", "aot_eager", {"pipeline": True}),
    ("dp2-zero3-inductor", "inductor", {"zero_optimization": SHARDED}),
]
# Compiled regions per row where the layout decides it (parallel/compile.py): the whole model
# unless something runs between blocks (ZeRO-3 gathering, checkpoints): then the 2 blocks.
# dp2-zero3-whole keeps every parameter whole (all under the default persistence threshold).
REGIONS = {"dp2": 1, "dp2-zero3": 2, "dp2-zero3-whole": 1, "tp2": 1, "tp2-ckpt": 2}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("inductor-cache"))


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _config(extra: dict, backend: str, dp: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": CLIP,
        "optimizer": SGD,
        "compile": {"enabled": True, "backend": backend},
        **{k: v for k, v in extra.items() if k not in ("pipeline", "ckpt")},
    }
    if extra.get("ckpt"):
        config["activation_checkpointing"] = {"checkpoint_layers": ["blocks.*"]}
    if extra.get("pipeline"):
        config["train_batch_size"] = MB * dp * 2  # two micro-batches per step
        config["tensor_parallel"] = {"size": 1, "plan": BLOCKS_PLAN}
    return config


def _start(cache: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when Inductor first writes
    torch._dynamo.reset()  # a reused process: counters and caches of the previous row go
    from torch._dynamo.utils import counters

    counters.clear()


def run_layout(extra: dict, backend: str, cache: str) -> dict:
    _start(cache)
    if extra.get("pipeline"):
        return _run_pipeline(extra, backend)
    engine, *_ = shardwise.initialize(model=make_gpt(), config=_config(extra, backend, 2))
    dp, rank = engine.dp_world_size, engine.dp_rank
    x, y = make_tokens(MB * dp * STEPS)
    losses, norms, graphs = [], [], []
    for k in range(STEPS):
        rows = rank_slice(k, 0, rank, MB, dp, 1)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        shardwise.comm.all_reduce(t, group=engine.mesh.dp_group)
        losses.append(t.item() / dp)
        norms.append(engine.get_global_grad_norm())
        graphs.append(_counters()["graphs"])
    params = engine.consolidated_state_dict()
    regions = sum(is_compiled(m) for m in engine.module.modules())
    out = {"losses": losses, "norms": norms, "params": params, "per_step": graphs}
    return {**out, "regions": regions, **_counters()}


def _run_pipeline(extra: dict, backend: str) -> dict:
    engine, *_ = shardwise.initialize(
        model=pipeline_module("blocks", 2), config=_config(extra, backend, 1)
    )
    data = micro_batches("blocks", engine, MB, 2, STEPS)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, norms, graphs = [], [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data if reads else None).item())
        norms.append(engine.get_global_grad_norm())
        graphs.append(_counters()["graphs"])
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "per_step": graphs, **_counters()}


def _reference(extra: dict) -> dict:
    if extra.get("pipeline"):
        return reference_run(pipe_setup("blocks", 1, 2, MB, STEPS, LR, CLIP), STEPS)
    dp = 1 if "tensor_parallel" in extra else 2
    config = {"optimizer": SGD, "gradient_clipping": CLIP}
    return reference_run(
        VerifySetup(make_gpt, global_batches(make_tokens, MB * dp, STEPS), config), STEPS
    )


@pytest.mark.parametrize("name,backend,extra", LAYOUTS, ids=[r[0] for r in LAYOUTS])
def test_compiled_layout_trains_like_one_process(name, backend, extra, cache_dir):
    want = _reference(extra)
    results = run_distributed(run_layout, 2, extra, backend, cache_dir)
    assert max(want["norms"]) > CLIP, f"{name}: clipping never engaged; the test is void"
    for rank, got in enumerate(results):
        tag = f"layout {name} ({backend}) rank {rank}"
        assert got["breaks"] == 0, f"{tag}: {got['breaks']} graph breaks"
        graphs = got["per_step"]  # graphs compiled by the end of each step
        assert graphs[0] >= 1, f"{tag}: nothing was compiled"
        assert graphs[-1] == graphs[1], f"{tag}: recompiled after step 2: {graphs}"
        if name in REGIONS:
            assert got["regions"] == REGIONS[name], f"{tag}: {got['regions']} compiled regions"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
        assert got["params"].keys() == want["params"].keys(), tag
        for key, w in want["params"].items():
            diff = (got["params"][key].float() - w.float()).abs().max().item()
            assert diff <= 1e-5, f"{tag}: {key} differs by {diff:.2e}"
