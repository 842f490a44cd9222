"""The layouts the planner weighs: each a way to spread one training step over the world
(dp x tp x pp), with the config that runs it.

    world = dp x cp x tp x pp   (tensor parallelism inside a node: its ranks are neighbours)
    global batch (sequences) = dp x micro_batch x grad_accum

MiCS (``mics``: ZeRO shards within groups of that many data ranks, replicated across them) is
weighed at the data ranks of one node (procs_per_node / tp) when the data ranks span nodes;
so is hpZ (``hpz``: ZeRO-3 keeps a secondary copy of its parameter shards over that many data
ranks, so only the first gather of a step crosses nodes; zero/hpz.py).

A pipeline runs ``grad_accum`` micro-batches per step through its stages under a schedule:
GPipe, 1F1B, interleaved 1F1B (two chunks per stage in a loop, micro-batches a multiple of
pp), or a zero-bubble one (ZB-H1; ZBV and DualPipeV, two chunks per stage in a V); the
two-chunk ones when the model has layers for 2 pp virtual stages, DualPipeV with at least
2 pp micro-batches.

Expert parallelism (``ep``, MoE layers) splits each layer's experts over ep data ranks: on
data parallelism only, never with ZeRO-3 (the library refuses both mixes); a model the
planner builds takes any ep dividing its experts, a user's model the ``ep_size`` it was built
with (``MoE(ep_size=...)`` is a constructor argument, not a config key). Context parallelism
(``cp``, ring or Ulysses) splits each sequence over cp ranks, for a model that calls
``shardwise.attention``: without pipelines, sequence parallelism or MoE layers, and Ulysses
only when a tensor-parallel rank's heads divide by cp.
``candidates`` lists every layout the library can run for a model and a world; ``to_config``
writes the DeepSpeed-style config that runs one as is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from shardwise.parallel.context.ulysses import model_heads
from shardwise.parallel.pipeline.schedule import V_SCHEDULES
from shardwise.parallel.tensor.heads import heads_to_divide
from shardwise.plan.shape import ModelShape

PRECISIONS = ("bf16", "fp16", "fp32")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev")  # enumerated


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
    mics: int = 0  # ZeRO shard group size (MiCS); 0: ZeRO shards over all dp x cp ranks
    hpz: int = 0  # hpZ's secondary group size (ZeRO-3); 0: off
    ep: int = 1  # expert-parallel size (inside the data axis: dp % ep == 0)
    cp: int = 1  # context-parallel size (ranks splitting each sequence)
    cp_method: str = "ring"  # or "ulysses"
    qw: bool = False  # ZeRO++ zero_quantized_weights: int8 parameter gathers (stage 3)
    qg: bool = False  # ZeRO++ zero_quantized_gradients: int4 gradient all-to-all (stage 2, 3)

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards over: the MiCS group, else every data x context rank."""
        return self.mics or self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("sp" if self.sequence_parallel else "")]
        parts += [f"cp{self.cp} {self.cp_method}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"pp{self.pp}", f"z{self.zero_stage}", f"mb{self.micro_batch}x{self.grad_accum}"]
        parts += ["ckpt"] if self.activation_checkpointing else []
        parts += ["offload"] if self.offload else []
        parts += [self.schedule] if self.pp > 1 and self.schedule != "1f1b" else []
        parts += [f"mics{self.mics}"] if self.mics else []
        parts += [f"hpz{self.hpz}"] if self.hpz else []
        parts += [k for k in ("qw", "qg") if getattr(self, k)]
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
    seq: int | None = None,
    cp_sizes: list[int] | None = None,
) -> Iterator[Layout]:
    """Every layout the library runs for ``shape`` on ``world`` ranks (module docstring).
    ZeRO-3 runs without tensor or pipeline parallelism only (the library refuses the mix);
    sequence parallelism only with tensor parallelism. ``cp_sizes``: the context sizes to
    try (default: every one a model calling ``shardwise.attention`` can take)."""
    pps = [p for p in divisors(world) if p <= len(shape.layers)] if shape.pipeline else [1]
    for tp in _tp_sizes(shape, world, per_node):
        for cp in _cp_sizes(shape, world // tp, seq, cp_sizes, per_node // tp):
            for pp in pps if cp == 1 else [1]:  # the library runs no pipeline with cp > 1
                if (world // (tp * cp)) % pp:
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                mesh = Layout(dp, tp, pp, 0, 1, 1, cp=cp)
                zero3 = not shape.expert_counts  # the library refuses ZeRO-3 with MoE layers
                mics = _mics_size(dp, tp, per_node) if cp == 1 and zero3 else 0
                for extra in _splits(shape, mesh):
                    for lay in _per_mesh(
                        mesh, global_batch // dp, micro_batches, len(shape.layers), extra, zero3
                    ):
                        yield lay
                        if lay.zero_stage and mics:
                            yield replace(lay, mics=mics)
                        if lay.zero_stage == 3 and mics:  # hpZ: a node's data ranks too
                            yield replace(lay, hpz=mics)


def _cp_sizes(
    shape: ModelShape, ranks: int, seq: int | None, given: list[int] | None, inside: int
) -> list[int]:
    """Context sizes: each rank holds 2 chunks of seq / (2 cp) tokens (token_order.py); MoE
    layers refuse a context split (parallel/moe/experts.py). Unless given, inside a node
    (``inside`` ranks beside a tensor group): its peers trade blocks in every layer, and each
    size costs a trace of its own."""
    mine = [c for c in divisors(ranks) if c <= max(inside, 1)]
    sizes = given if given is not None else mine if shape.context_attention else [1]
    ok = [c for c in sizes if ranks % c == 0 and (seq is None or seq % (2 * c) == 0 or c == 1)]
    return [c for c in ok if c == 1 or not shape.expert_counts]


def _splits(shape: ModelShape, mesh: Layout) -> Iterator[dict]:
    """Expert-parallel sizes and context methods of a mesh: ep > 1 on data parallelism only;
    Ulysses when the heads of a tensor-parallel rank split over cp (ulysses.py's rule)."""
    if mesh.cp > 1:
        yield {"cp_method": "ring"}
        if _ulysses_fits(shape, mesh.cp, mesh.tp):
            yield {"cp_method": "ulysses"}
        return
    for ep in shape.ep_sizes():
        plain = mesh.tp == mesh.pp == 1
        if mesh.dp % ep == 0 and (ep == 1 or plain):
            yield {"ep": ep}


def _ulysses_fits(shape: ModelShape, cp: int, tp: int) -> bool:
    heads = shape.dims.heads if shape.dims is not None else None
    if heads is None and shape.module is not None:
        heads = model_heads(shape.module)
    return heads is None or (heads // tp) % cp == 0


def _mics_size(dp: int, tp: int, per_node: int) -> int:
    """MiCS's shard group: the data ranks of one node, when the data ranks span several
    (0: no MiCS layout; one node's data ranks are already one group)."""
    local = per_node // tp if per_node % tp == 0 else 0
    return local if 1 < local < dp and dp % local == 0 else 0


def _schedules(pp: int, grad_accum: int, layers: int) -> tuple[str, ...]:
    """The schedules a pipeline of ``pp`` stages can run (module docstring)."""
    if pp == 1:
        return ("1f1b",)
    out = ["1f1b", "gpipe", "zb-h1"]
    if 2 * pp <= layers:
        out += ["interleaved"] if grad_accum % pp == 0 else []
        out += ["zbv"] + (["dualpipev"] if grad_accum >= 2 * pp else [])
    return tuple(out)


def _per_mesh(
    mesh: Layout,
    per_replica: int,
    micro_batches: list[int] | None,
    layers: int = 0,
    extra: dict | None = None,
    zero3: bool = True,
) -> Iterator[Layout]:
    dp, tp, pp, cp = mesh.dp, mesh.tp, mesh.pp, mesh.cp
    extra = {"cp": cp, **(extra or {})}
    sizes = [m for m in divisors(per_replica) if micro_batches is None or m in micro_batches]
    stages = [0, 1, 2, 3] if tp == pp == 1 and zero3 else [0, 1, 2]
    for mb in sizes:
        gas = per_replica // mb
        for zero in stages:
            for sp in (False, True) if tp > 1 and cp == 1 else (False,):
                for ckpt in (False, True):
                    # offload_optimizer needs ZeRO (the library refuses stage 0, as DeepSpeed)
                    for offload in (False, True) if zero >= 1 else (False,):
                        for sched in _schedules(pp, gas, layers):
                            yield Layout(
                                dp, tp, pp, zero, mb, gas, ckpt, offload, sp, sched, **extra
                            )


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
    if layout.hpz:
        cfg["zero_optimization"]["zero_hpz_partition_size"] = layout.hpz
    if layout.qw or layout.qg:
        cfg["zero_optimization"]["zero_quantized_weights"] = layout.qw
        cfg["zero_optimization"]["zero_quantized_gradients"] = layout.qg
    is_pipe = shape is not None and shape.module_is_pipeline
    if layout.tp > 1:
        cfg["tensor_parallel"] = {"size": layout.tp, "sequence_parallel": layout.sequence_parallel}
        if layout.pp > 1 and shape is not None and not is_pipe:  # the layers' names in a pipeline
            cfg["tensor_parallel"]["plan"] = shape.pipeline_plan()
    if layout.cp > 1:
        cfg["context_parallel"] = {"size": layout.cp, "method": layout.cp_method}
    if layout.pp > 1 or is_pipe:
        cfg["pipeline"] = {"stages": layout.pp, "schedule": layout.schedule}
        if layout.schedule in (*V_SCHEDULES, "interleaved"):
            cfg["pipeline"]["chunks"] = 2
        if layout.activation_checkpointing:
            cfg["pipeline"]["activation_checkpoint_interval"] = 1
    elif layout.activation_checkpointing:
        cfg["activation_checkpointing"] = {"checkpoint_layers": "all"}
    return cfg
