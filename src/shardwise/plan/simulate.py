"""``shardwise plan --simulate RANK``: the real setup of one rank of a large world, in one process.

The world is torch's fake process group (backend ``"fake"`` on a ``FakeStore``, as torch's
own tests use: every collective returns at once, its input unchanged) and every tensor is a
fake tensor (``FakeTensorMode``: shapes, dtypes, devices, no storage). On that,
``shardwise.initialize`` runs unchanged for the rank asked: the topology and its process
groups, the pipeline partition, the tensor-parallel split, the model's values (a meta-device
model is materialized once cut, module by module), ZeRO's buckets or units and master shards.
What the rank then holds is compared with the planner (``check``), and ``Allocations``
records every tensor the setup created, so a test can tell that no full parameter was ever
held where the layout splits it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.plan.candidates import Layout, to_config
from shardwise.plan.evaluate import Planner
from shardwise.plan.shape import ModelShape
from shardwise.plan.traffic import by_op
from shardwise.training.initialize import initialize


@dataclass
class Allocations(TorchDispatchMode):
    """Every tensor an op creates (not a view of its inputs): its elements, shape and op."""

    made: list[tuple[int, tuple[int, ...], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in seen and t.device.type != "meta":
                self.made.append((t.numel(), tuple(t.shape), str(func)))
        return out

    @property
    def largest(self) -> int:
        """Elements of the largest tensor made."""
        return max((n for n, _, _ in self.made), default=0)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """torch.distributed as ``rank`` of ``world`` on the fake backend, torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - test-only torch module, loaded only to simulate

    if dist.is_initialized():
        raise RuntimeError("--simulate needs a process without torch.distributed set up")
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def simulate(
    model: torch.nn.Module,
    layout: Layout,
    rank: int,
    precision: str = "bf16",
    shape: ModelShape | None = None,
    extra: dict | None = None,
    whole: bool = True,
) -> tuple[Any, Allocations]:
    """``shardwise.initialize`` for ``rank`` of ``layout``'s world, on fake tensors; returns
    the engine and what the setup allocated. ``model`` is built on the meta device (a
    PipelineModule of its layers when ``layout.pp`` > 1). ``whole``: hand the setup the
    model as a script usually does, built whole in the compute dtype (fake: no memory);
    else still on the meta device, for the setup to materialize once cut."""
    cfg = to_config(layout, precision, shape)
    for key, block in (extra or {}).items():
        cfg[key] = {**cfg.get(key, {}), **block} if isinstance(block, dict) else block
    allocations = Allocations()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    with fake_world(rank, layout.world), mode:
        _fakeify(model, mode, dtype if whole else None)
        with allocations:
            engine, *_ = initialize(model=model, config=cfg)
    return engine, allocations


def _fakeify(model: torch.nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> None:
    """The model's (meta) parameters and buffers as fake tensors, so that every op of the
    setup runs under ``mode`` (tied parameters stay tied): on the CPU in ``dtype`` (floating
    ones), or on the meta device when ``dtype`` is None."""
    done: dict[int, torch.Tensor] = {}
    layers = [x for x in getattr(model, "_specs", []) if isinstance(x, torch.nn.Module)]
    for m in [*model.modules(), *(m for x in layers for m in x.modules())]:  # unbuilt stages
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    fake = mode.from_tensor(t.detach())
                    if dtype is not None:
                        cast = dtype if t.is_floating_point() else t.dtype
                        fake = torch.empty(t.shape, dtype=cast, device="cpu")
                    if isinstance(t, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                    done[id(t)] = fake
                table[name] = done[id(t)]


def pipeline_model(model: torch.nn.Module, pp: int) -> torch.nn.Module:
    """What a script passes to initialize for ``pp`` stages: a PipelineModule of the model's
    layers (``pipeline_layers()``), or the model itself."""
    if pp == 1 or isinstance(model, PipelineModule):
        return model
    layers = getattr(model, "pipeline_layers", None)
    if layers is None:
        raise ValueError(
            f"--pp {pp}: {type(model).__name__} is not a PipelineModule and has no "
            "pipeline_layers(): build it as shardwise.pipe.PipelineModule(layers, loss_fn=...)"
        )
    return PipelineModule(layers(), loss_fn=getattr(model, "loss_fn", None))


def report(engine: Any, planner: Planner, layout: Layout, rank: int) -> dict[str, Any]:
    """What the simulated ``rank`` holds, beside what the planner predicts for it."""
    coords = engine.mesh.topology.coord(rank)
    view = planner.stage_view(layout, coords.pp)
    held = engine.memory_breakdown()
    s = view.states
    return {
        "rank": rank,
        "world": layout.world,
        "coords": f"pp {coords.pp}, dp {coords.dp}, tp {coords.tp}",
        "layout": layout.name(),
        "stage": coords.pp,
        "layers": view.layers,
        "memory": {
            "params": s.params,
            "grads": s.grads,
            "optimizer": s.optimizer,
            "activations": int(view.activations),
            "peak": int(view.peak),
        },
        "held": {k: held[k] for k in ("params", "grads", "optimizer")},
        "shards": [(n, tuple(p.shape)) for n, p in engine.module.named_parameters()],
        "comm_ops": by_op(view.calls),
    }
