"""The layouts the planner weighs: each a way to spread one training step over the world
(dp x tp x pp), with the config that runs it.

    world = dp x tp x pp   (tensor parallelism inside a node: its ranks are neighbours)
    global batch (sequences) = dp x micro_batch x grad_accum

MiCS (``mics``: ZeRO shards within groups of that many data ranks, replicated across them) is
weighed at the data ranks of one node (procs_per_node / tp) when the data ranks span nodes.

A pipeline runs ``grad_accum`` micro-batches per step through its stages under a schedule:
1F1B, or a zero-bubble one (ZB-H1; ZBV and DualPipeV, two chunks per stage in a V, when the
model has layers for 2 pp virtual stages; DualPipeV with at least 2 pp micro-batches).
``candidates`` lists every layout the library can run for a model and a world; ``to_config``
writes the DeepSpeed-style config that runs one as is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from shardwise.parallel.pipeline.schedule import V_SCHEDULES
from shardwise.parallel.tensor.heads import heads_to_divide
from shardwise.plan.shape import ModelShape

PRECISIONS = ("bf16", "fp16", "fp32")
PIPELINE_SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")  # what candidates enumerate


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool = False
    offload: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    mics: int = 0  # ZeRO shard group size (MiCS); 0: ZeRO shards over all dp ranks

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards over: the MiCS group, else every data rank."""
        return self.mics or self.dp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("sp" if self.sequence_parallel else "")]
        parts += [f"pp{self.pp}", f"z{self.zero_stage}", f"mb{self.micro_batch}x{self.grad_accum}"]
        parts += ["ckpt"] if self.activation_checkpointing else []
        parts += ["offload"] if self.offload else []
        parts += [self.schedule] if self.pp > 1 and self.schedule != "1f1b" else []
        parts += [f"mics{self.mics}"] if self.mics else []
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_sizes(shape: ModelShape, world: int, per_node: int) -> list[int]:
    """Tensor-parallel sizes that fit in a node and split every planned dimension evenly
    (the vocabulary may be padded; heads and MLP widths may not)."""
    if not shape.styles:
        return [1]
    out = []
    for tp in divisors(min(world, per_node)):
        if world % tp:
            continue
        even = all(
            p.shape[p.split] % tp == 0
            for p in shape.params
            if p.split is not None and shape.styles.get(p.module) != "vocab"
        )
        if even and _heads_divide(shape, tp):
            out.append(tp)
    return out


def _heads_divide(shape: ModelShape, tp: int) -> bool:
    """The library's own check (tensor/heads.py): every attention keeps whole heads."""
    if shape.module is None:
        return True
    try:
        heads_to_divide(shape.module, shape.styles, tp)
    except ValueError:
        return False
    return True


def candidates(
    shape: ModelShape,
    world: int,
    per_node: int,
    global_batch: int,
    micro_batches: list[int] | None = None,
) -> Iterator[Layout]:
    """Every layout the library runs for ``shape`` on ``world`` ranks (module docstring).
    ZeRO-3 runs without tensor or pipeline parallelism only (the library refuses the mix);
    sequence parallelism only with tensor parallelism."""
    pps = [p for p in divisors(world) if p <= len(shape.layers)] if shape.pipeline else [1]
    for tp in _tp_sizes(shape, world, per_node):
        for pp in pps:
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            layers = len(shape.layers)
            for lay in _per_mesh(dp, tp, pp, global_batch // dp, micro_batches, layers):
                yield lay
                if lay.zero_stage and _mics_size(dp, tp, per_node):
                    yield replace(lay, mics=_mics_size(dp, tp, per_node))


def _mics_size(dp: int, tp: int, per_node: int) -> int:
    """MiCS's shard group: the data ranks of one node, when the data ranks span several
    (0: no MiCS layout; one node's data ranks are already one group)."""
    local = per_node // tp if per_node % tp == 0 else 0
    return local if 1 < local < dp and dp % local == 0 else 0


def _schedules(pp: int, grad_accum: int, layers: int) -> tuple[str, ...]:
    """The schedules a pipeline of ``pp`` stages can run (module docstring)."""
    if pp == 1:
        return ("1f1b",)
    out = ["1f1b", "zb-h1"]
    if 2 * pp <= layers:
        out += ["zbv"] + (["dualpipev"] if grad_accum >= 2 * pp else [])
    return tuple(out)


def _per_mesh(
    dp: int,
    tp: int,
    pp: int,
    per_replica: int,
    micro_batches: list[int] | None,
    layers: int = 0,
) -> Iterator[Layout]:
    sizes = [m for m in divisors(per_replica) if micro_batches is None or m in micro_batches]
    stages = [0, 1, 2, 3] if tp == pp == 1 else [0, 1, 2]
    for mb in sizes:
        gas = per_replica // mb
        for zero in stages:
            for sp in (False, True) if tp > 1 else (False,):
                for ckpt in (False, True):
                    for offload in (False, True):
                        for sched in _schedules(pp, gas, layers):
                            yield Layout(dp, tp, pp, zero, mb, gas, ckpt, offload, sp, sched)


def precision_block(precision: str) -> dict:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return {} if precision == "fp32" else {precision: {"enabled": True}}


def to_config(layout: Layout, precision: str, shape: ModelShape | None = None) -> dict:
    """The config that runs ``layout`` (AdamW, as the planner's memory model assumes; gradient
    clipping at 1.0, whose norm the traffic counts). With ``pipeline.stages`` > 1 the script
    passes the model as a PipelineModule of its layers (``model.pipeline_layers()``)."""
    cfg: dict = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": layout.zero_stage},
        **precision_block(precision),
    }
    if layout.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if layout.mics:
        cfg["zero_optimization"]["mics_shard_size"] = layout.mics
    is_pipe = shape is not None and shape.module_is_pipeline
    if layout.tp > 1:
        cfg["tensor_parallel"] = {"size": layout.tp, "sequence_parallel": layout.sequence_parallel}
        if layout.pp > 1 and shape is not None and not is_pipe:  # the layers' names in a pipeline
            cfg["tensor_parallel"]["plan"] = shape.pipeline_plan()
    if layout.pp > 1 or is_pipe:
        cfg["pipeline"] = {"stages": layout.pp, "schedule": layout.schedule}
        if layout.schedule in V_SCHEDULES:
            cfg["pipeline"]["chunks"] = 2
        if layout.activation_checkpointing:
            cfg["pipeline"]["activation_checkpoint_interval"] = 1
    elif layout.activation_checkpointing:
        cfg["activation_checkpointing"] = {"checkpoint_layers": "all"}
    return cfg
