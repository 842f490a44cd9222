"""The example GPT trained for a few steps in a layout, measured as the planner predicts it.

``measure(layout, precision, extra)`` runs on every rank of a world: three ``train_batch``
steps of the example GPT (a PipelineModule of its layers when ``pp`` > 1, the plain GPT
otherwise), with the config ``shardwise.plan.to_config`` writes for the layout. It returns
this rank's stage, ``engine.memory_breakdown()`` taken inside the third step's update (after
the gradient reduction, with the optimizer's states allocated: the model states' peak),
``comm.stats()`` of that third step (the steady state), and the peak of saved-tensor bytes.
"""

from __future__ import annotations

import torch
from models import example_module

from shardwise.plan.candidates import Layout, to_config

SMALL = dict(vocab_size=61, block_size=16, n_layer=4, n_head=2, n_embd=32)
EXTRA = {
    "zero_optimization": {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}
}
STEPS = 3


def gpt(tie: bool = False):
    M = example_module("gpt", "model")
    torch.manual_seed(0)
    return M.GPT(M.GPTConfig(**SMALL, tie_weights=tie))


def pipeline(model=None, tie: bool = False):
    """The example's pipeline form (tied: TiedLayerSpec ends, no tensor-parallel plan)."""
    from shardwise.pipe import PipelineModule

    M = example_module("gpt", "model")
    model = model if model is not None else gpt(tie)
    pipe = PipelineModule(M.pipeline_layers(model), loss_fn=M.LMLoss())
    if not model.cfg.tie_weights:
        pipe.tp_plan = M.pipeline_tp_plan(SMALL["n_layer"])
    return pipe


def build_for(layout: Layout, tie: bool = False):
    """The module a script passes to initialize for ``layout``."""
    return pipeline(tie=tie) if layout.pp > 1 else gpt(tie)


def config_for(layout: Layout, precision: str) -> dict:
    cfg = to_config(layout, precision)
    for key, block in EXTRA.items():
        cfg[key] = {**cfg.get(key, {}), **block}
    if layout.pp > 1 and layout.tp > 1:
        M = example_module("gpt", "model")
        cfg["tensor_parallel"]["plan"] = M.pipeline_tp_plan(SMALL["n_layer"])
    return cfg


def batches(seed: int, layout: Layout) -> list:
    """One rank's micro-batches of a step: ``grad_accum`` (ids, targets) pairs."""
    return _batches(seed, layout)


def _batches(seed: int, layout: Layout):
    g = torch.Generator().manual_seed(seed)
    V, T = SMALL["vocab_size"], SMALL["block_size"]
    out = []
    for _ in range(layout.grad_accum):
        x = torch.randint(0, V, (layout.micro_batch, T), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def measure(layout: Layout, precision: str, tie: bool = False) -> dict:
    import shardwise
    from shardwise import comm
    from shardwise.parallel.pipeline.meter import ActivationMeter

    model = build_for(layout, tie)
    engine, *_ = shardwise.initialize(model=model, config=config_for(layout, precision))
    taken = {}
    step = engine.strategy.step

    def step_and_measure(optimizer, coef):
        taken["memory"] = engine.memory_breakdown()
        return step(optimizer, coef)

    engine.strategy.step = step_and_measure
    meter = None
    if engine.pipeline is not None:
        engine.pipeline.track_activations()
    else:
        meter = ActivationMeter(engine.module)
    losses = []
    for k in range(STEPS):
        if k == STEPS - 1:
            comm.reset_stats()
        data = iter(_batches(100 * k + engine.dp_rank, layout))
        if meter is not None:
            with meter.hooks():
                losses.append(float(engine.train_batch(data)))
        else:
            losses.append(float(engine.train_batch(data)))
    peak = meter.peak if meter is not None else engine.pipeline.peak_activation_bytes
    return {
        "stage": engine.mesh.pp_rank,
        "memory": taken["memory"],
        "comm": comm.stats(),
        "activations": peak,
        "losses": losses,
        "tied": {k: p.detach().clone() for k, ps in tied_of(engine).items() for _, p in ps},
    }


def tied_of(engine) -> dict:
    """This stage's tied parameters by key (a pipeline's; none otherwise)."""
    tied = getattr(engine.module, "tied_parameters", None)
    return tied() if engine.pipeline is not None and tied is not None else {}


def measure_staging(layout: Layout, precision: str, save_dir: str) -> dict:
    """One step in ``layout``, then an asynchronous save: this rank's stage and the bytes of
    its checkpoint staging buffers, as ``engine.memory_breakdown()`` counts them."""
    import shardwise

    engine, *_ = shardwise.initialize(model=build_for(layout), config=config_for(layout, precision))
    engine.train_batch(iter(_batches(engine.dp_rank, layout)))
    engine.save_checkpoint(save_dir, async_save=True)
    engine.wait_for_checkpoint()
    staging = engine.memory_breakdown()["checkpoint_staging"]
    engine.destroy()
    return {"stage": engine.mesh.pp_rank, "staging": staging}
