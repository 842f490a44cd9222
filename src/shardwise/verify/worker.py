"""One layout's run, on every rank: ``python -m shardwise run ... -m shardwise.verify.worker``.

Each rank builds the script's model, loads the reference's initial weights (so every layout
starts from the same values whatever its random calls), lets ``shardwise.initialize`` split it
for the layout, and trains ``steps`` steps on its rows of the same global batches. After each
step the engine gathers the full parameters (``consolidated_state_dict``: ZeRO shards,
tensor-parallel slices and pipeline stages put back under single-process names); rank 0 keeps
them and writes the result files (results.py) for the parent to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from shardwise.parallel.moe.experts import every_expert_name, moe_layers
from shardwise.parallel.moe.groups import expert_rank_groups
from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.topology import Topology
from shardwise.training.initialize import initialize
from shardwise.verify.gradients import GradNorms, zero_gradient
from shardwise.verify.layout_names import REFERENCE, Layout, layout_config, parse_layout
from shardwise.verify.results import RunResult, load_weights, save_result, save_weights
from shardwise.verify.setup import DEFAULT_ENTRY, VerifySetup, batch_rows, load_setup, micro_batches
from shardwise.verify.streams import check_streams, silence_dropout, silence_gate_noise


def _layers(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name prefix, module) of each layer: a PipelineModule holds its layers unregistered
    until ``initialize`` builds its stage, under the names its stage will give them."""
    if not isinstance(net, PipelineModule):
        return [("", net)]
    return [(net._name_of(i), s) for i, s in enumerate(net._specs) if isinstance(s, nn.Module)]


def _single_names(model: nn.Module, net: nn.Module) -> dict[str, str]:
    """Names of ``net`` (a pipeline built from ``model``'s modules) -> ``model``'s names, by
    tensor identity; taken before shardwise replaces any parameter."""
    by_id = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), name)
    names = {}
    for prefix, layer in _layers(net):
        for n, t in layer.state_dict(keep_vars=True).items():
            names[f"{prefix}.{n}" if prefix else n] = by_id.get(id(t), n)
    return names


def _local_experts(model: nn.Module, state: dict, layout: Layout, rank: int) -> dict:
    """The initial weights (every expert under its single-process name) for this rank's
    model, whose MoE layers of ``ep_size`` > 1 hold experts ``ep_rank * L .. + L - 1`` under
    local indices 0..L-1 (parallel/moe/experts.py); the rank's place in its expert-parallel
    group follows from the layout alone, before any process group exists."""
    blocks = [(n, m) for n, m in moe_layers(model) if m.ep_size > 1]
    if not blocks:
        return state
    topo = Topology.build(layout.world, pp=layout.pp, tp=layout.tp, cp=layout.cp)
    out = dict(state)
    for name, layer in blocks:
        ep_ranks = next(g for g in expert_rank_groups(topo, layer.ep_size)[0] if rank in g)
        prefix = f"{name}.experts.deepspeed_experts." if name else "experts.deepspeed_experts."
        first = ep_ranks.index(rank) * layer.num_local_experts
        for key in [k for k in out if k.startswith(prefix)]:
            del out[key]
        for key, value in state.items():
            if key.startswith(prefix):
                i, rest = key[len(prefix) :].split(".", 1)
                if first <= int(i) < first + layer.num_local_experts:
                    out[f"{prefix}{int(i) - first}.{rest}"] = value
    return out


def build_engine(setup: VerifySetup, layout: Layout, init: str | Path, rows: int) -> tuple:
    """(engine, dropouts, name map): the script's model with the initial weights, split for
    ``layout`` by ``shardwise.initialize``. The map covers parameters only: buffers (BatchNorm
    running statistics) follow from the parameters and are not compared."""
    torch.manual_seed(int(setup.config.get("seed", 0)))
    model = setup.model()
    rank = int(os.environ.get("RANK", "0"))
    model.load_state_dict(_local_experts(model, load_weights(init), layout, rank))
    dropouts = silence_dropout(model)
    # In every run, the reference's too: data ranks draw from their own streams, and so do
    # pipeline stages for their own gates (stage 1's first draw is one process's first, made
    # for another gate); one reference serves every layout of its data size.
    silence_gate_noise(model)
    net = model
    if layout.pp > 1:
        if setup.pipeline is None:
            raise ValueError(f"layout {layout.name} needs the setup's 'pipeline' builder")
        net = setup.pipeline(model)
    params = dict(model.named_parameters())
    names = {k: v for k, v in _single_names(model, net).items() if v in params}
    names.update({n: n for n in every_expert_name(model)})  # gathered under global names
    config = layout_config(setup.config, layout, rows)
    engine, *_ = initialize(model=net, config=config, loss_fn=setup.loss_fn)
    if setup.prepare is not None:
        setup.prepare(engine)
    return engine, dropouts, names


def run_layout(
    setup: VerifySetup, layout: Layout, steps: int, init: str | Path, out: str | Path | None
) -> RunResult:
    """Train ``steps`` steps in ``layout``; rank 0 writes the result to ``out`` (if given)."""
    batches = setup_batches(setup, steps)
    built = build_engine(setup, layout, init, batch_rows(batches[0]))
    return train_layout(setup, layout, batches, built, out)


def setup_batches(setup: VerifySetup, steps: int) -> list:
    """The first ``steps`` global batches of the setup."""
    batches = list(itertools.islice(iter(setup.batches()), steps))
    if len(batches) < steps:
        raise ValueError(f"the setup's batches ended after {len(batches)} of {steps} steps")
    return batches


def train_layout(
    setup: VerifySetup, layout: Layout, batches: list, built: tuple, out: str | Path | None
) -> RunResult:
    """One step per global batch on the engine ``build_engine`` returned; the result."""
    engine, dropouts, names = built
    dp, dp_rank = engine.dp_world_size, engine.dp_rank
    probe = GradNorms(engine.module) if layout.world == 1 else None
    losses, norms, params = [], [], []
    for batch in batches:
        loss = engine.train_batch(micro_batches(batch, setup.gas * layout.split, dp, dp_rank))
        losses.append(float(loss))
        norms.append(engine.get_global_grad_norm())
        if probe is not None:
            probe.end_step()
        state = engine.consolidated_state_dict()  # collective: every rank calls it
        params.append({names[k]: v.float() for k, v in state.items() if k in names})
    streams = []
    if dropouts and layout.tp > 1 and engine.pipeline is None:
        first = next(micro_batches(batches[0], setup.gas, dp, dp_rank))
        streams = check_streams(engine, dropouts, first)
    order = [n for n in dict.fromkeys(names.values()) if n in params[0]]
    result = RunResult(layout.name, losses, norms, order, params, streams)
    if probe is not None:
        result.zero_grad = zero_gradient(probe.steps, norms)
    if out is not None and engine.global_rank == 0:
        save_result(result, out)
    return result


def worker_command(
    world: int, worker_args: list[str], module: str = "shardwise.verify.worker"
) -> list[str]:
    """``shardwise run`` (the project's launcher) of ``module`` (this one: a named layout;
    ``fuzz_worker``: a fuzz case) on ``world`` processes."""
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", str(world)]
    return cmd + ["--omp-num-threads", "1", "-m", module, *worker_args]


def write_initial_weights(setup: VerifySetup, path: str | Path) -> None:
    """The weights every run starts from: the script's model, built once under its seed."""
    torch.manual_seed(int(setup.config.get("seed", 0)))
    save_weights(setup.model().state_dict(), path)


def run_reference(
    setup: VerifySetup, steps: int, init: str | Path, layout: Layout = REFERENCE
) -> RunResult:
    """The same setup in this one process: the run every layout must match (``layout``: the
    reference ``reference_for`` gives, REFERENCE unless the model keeps per-rank statistics).
    Always eager: a ``compile`` block of the script's config is left out here."""
    eager = {k: v for k, v in setup.config.items() if k != "compile"}
    return run_layout(dataclasses.replace(setup, config=eager), layout, steps, init, out=None)


def per_rank_statistics(setup: VerifySetup) -> bool:
    """Whether the setup's model computes over the rows one rank sees (MoE gating)."""
    torch.manual_seed(int(setup.config.get("seed", 0)))
    return bool(moe_layers(setup.model()))


def worker_args(
    description: str, what: str, meaning: str, argv: Sequence[str] | None
) -> argparse.Namespace:
    """A worker's command line: SCRIPT, ``--<what>`` (the layout, or a fuzz case), steps, the
    initial weights, the output folder and the entry point. Also one thread per rank, as the
    reference, so runs repeat bit for bit."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("script")
    p.add_argument(f"--{what}", required=True, help=meaning)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--init", required=True, help="safetensors file of the initial weights")
    p.add_argument("--out", required=True)
    p.add_argument("--entry", default=DEFAULT_ENTRY)
    p.add_argument("--compile", default=None, help="torch.compile backend of each block")
    torch.set_num_threads(1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = worker_args("one layout of shardwise verify", "layout", "the layout name", argv)
    setup = load_setup(args.script, args.entry)
    layout = dataclasses.replace(parse_layout(args.layout), compile=args.compile)
    run_layout(setup, layout, args.steps, args.init, args.out)


if __name__ == "__main__":
    main()
