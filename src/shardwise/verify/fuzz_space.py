"""The space ``shardwise verify --fuzz`` draws from, and one drawn configuration (a ``Case``).

A case is a model (the script's GPT, its MoE variant, a tiny Hugging Face Llama or GPT-2), a
layout (data x tensor x pipeline x context ranks, at most ``MAX_WORLD`` processes, the ZeRO
stage and its offloads, sequence parallelism, the context method, the expert-parallel size) and
a config (micro-batch and accumulation, precision, clipping, activation checkpointing, one
optimizer and one scheduler type with only their required parameters, the pipeline schedule).

Draws are deterministic: ``draw_cases(seed, n)`` draws case i as the i-th draw of one
``random.Random(seed)``. Every case is also a compact JSON object (``to_json``/``from_json``,
defaults left out), so ``shardwise verify --fuzz-case '<json>'`` replays it even after the space
changes. The reference of a case (one process) depends on ``reference_key`` only: the model,
its options with ``ep`` 1, the config without the layout's blocks, and the rows per step.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, fields, replace

MAX_WORLD = 4
MODELS = ("gpt", "gpt-moe", "llama", "gpt2")
PRECISIONS = ("fp32", "bf16", "fp16")
CKPT = (None, "layers", "partition", "interval")  # activation checkpointing flavours
# DeepSpeed's optimizer names and two of torch's; then DeepSpeed's own kernels, refused by
# shardwise (drawn 1 time in 5: a refusal checks less than a run).
OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop")
REFUSED_OPTIMIZERS = ("Lamb", "Lion", "OneBitAdam")
# Scheduler type -> its required parameters only (everything else at its default).
SCHEDULERS: dict[str | None, dict] = {
    None: {},
    "WarmupLR": {},
    "WarmupDecayLR": {"total_num_steps": 3},
    "WarmupCosineLR": {"total_num_steps": 3},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3},
    "LRRangeTest": {},
    "StepLR": {"step_size": 1},
    "ExponentialLR": {"gamma": 0.9},
}
NOISE = (None, "Jitter", "RSample")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per stage
CP_METHODS = ("ring", "ulysses")
# (dp, tp, pp, cp) with dp * tp * pp * cp <= MAX_WORLD.
SIZES = tuple(
    (dp, tp, pp, cp)
    for dp in (1, 2, 4)
    for tp in (1, 2, 4)
    for pp in (1, 2, 4)
    for cp in (1, 2, 4)
    if dp * tp * pp * cp <= MAX_WORLD
)


@dataclass(frozen=True)
class Case:
    """One drawn configuration (field defaults: the plain single-process GPT in fp32)."""

    model: str = "gpt"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    sp: bool = False
    cp_method: str = "ring"
    schedule: str = "1f1b"
    micro: int = 2  # rows per data rank per micro-batch
    gas: int = 1
    precision: str = "fp32"
    clip: float = 0.0
    ckpt: str | None = None
    optimizer: str = "AdamW"
    scheduler: str | None = None
    moe: dict = field(default_factory=dict)  # MoE arguments: k, noisy_gate_policy, ...
    ep: int = 1
    mics: int = 0  # MiCS: ZeRO shard groups of this many data x context ranks; 0: all
    hpz: int = 0  # hpZ: ZeRO-3's secondary shards over this many data x context ranks; 0: off

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def rows(self) -> int:
        """Rows of a global batch: every data rank's micro-batches of one step."""
        return self.micro * self.gas * self.dp

    def to_json(self) -> str:
        """Compact JSON of the fields that differ from the defaults."""
        base = asdict(Case())
        diff = {k: v for k, v in asdict(self).items() if v != base[k]}
        return json.dumps(diff, separators=(",", ":"), sort_keys=True)

    def summary(self) -> str:
        """One short line: model, layout, config."""
        layout = f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero{self.zero}"
        layout += f" mics{self.mics}" if self.mics else ""
        layout += f" hpz{self.hpz}" if self.hpz else ""
        extra = [k for k in ("offload_optimizer", "offload_param", "sp") if getattr(self, k)]
        if self.cp > 1:
            extra.append(self.cp_method)
        if self.pp > 1:
            extra.append(self.schedule)
        moe = f" moe{self.moe} ep{self.ep}" if self.model == "gpt-moe" else ""
        return (
            f"{self.model}{moe} {layout} {' '.join(extra)} | micro {self.micro} gas {self.gas} "
            f"{self.precision} clip {self.clip:g} ckpt {self.ckpt} {self.optimizer} "
            f"{self.scheduler}"
        ).replace("  ", " ")


def from_json(text: str) -> Case:
    """The case of ``--fuzz-case``; unknown fields refused, naming them."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--fuzz-case: not JSON ({e}); paste the line the fuzzer printed"
        ) from None
    if not isinstance(data, dict):
        raise ValueError("--fuzz-case: expected a JSON object such as '{\"dp\":2}'")
    known = {f.name for f in fields(Case)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--fuzz-case: unknown fields {unknown}; the fields are {sorted(known)}")
    return Case(**data)


def _moe(rng: random.Random) -> dict:
    """DeepSpeed MoE arguments: 4 experts, k, noise, residual, capacity, dropping."""
    k = rng.choice((1, 2))
    moe = {
        "num_experts": 4,
        "k": k,
        "noisy_gate_policy": rng.choice(NOISE),
        "use_residual": rng.random() < 0.3,
        "capacity_factor": rng.choice((1.0, 2.0)),
        "drop_tokens": rng.random() < 0.5,
    }
    if k == 2:
        moe["top2_2nd_expert_sampling"] = rng.random() < 0.5
    return moe


def draw_case(rng: random.Random) -> Case:
    """One case; every dimension drawn independently (the library refuses what cannot run)."""
    model = rng.choice(MODELS)
    dp, tp, pp, cp = rng.choice(SIZES)
    zero = rng.choice((0, 1, 2, 3))
    case = Case(
        model=model,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        zero=zero,
        offload_optimizer=zero > 0 and rng.random() < 0.3,
        offload_param=rng.random() < (0.4 if zero == 3 else 0.05 if zero else 0.0),
        sp=tp > 1 and rng.random() < 0.5,
        cp_method=rng.choice(CP_METHODS) if cp > 1 else "ring",
        schedule=rng.choice(SCHEDULES) if pp > 1 else "1f1b",
        micro=rng.choice((1, 2)),
        gas=rng.choice((1, 2)),
        precision=rng.choice(PRECISIONS),
        clip=rng.choice((0.0, 1.0)),
        ckpt=rng.choice(CKPT),
        optimizer=rng.choice(REFUSED_OPTIMIZERS if rng.random() < 0.2 else OPTIMIZERS),
        scheduler=rng.choice(tuple(SCHEDULERS)),
    )
    if model == "gpt-moe":
        case = replace(case, moe=_moe(rng), ep=rng.choice([e for e in (1, 2, 4) if dp % e == 0]))
    if case.world == 1 and not (zero or case.offload_optimizer):
        case = replace(case, dp=2)  # one plain process is the reference itself
    case = replace(case, mics=_mics(case))
    return replace(case, hpz=_hpz(case))


def _mics(case: Case) -> int:
    """A MiCS shard size for a sharded case over several data ranks, 1 time in 3: a proper
    divisor of dp x cp. Drawn from the case itself, not from the shared stream, so that the
    draws made before MiCS joined the space (tests/test_verify_fuzz.py's CI_DRAWS) are kept."""
    sizes = [s for s in range(1, case.dp * case.cp) if (case.dp * case.cp) % s == 0]
    rng = random.Random(case.to_json())
    moe = case.model == "gpt-moe"  # refused with MiCS (experts have groups of their own)
    if not case.zero or moe or not sizes or rng.random() >= 1 / 3:
        return 0
    return rng.choice(sizes)


def _hpz(case: Case) -> int:
    """An hpZ group size for a ZeRO-3 case over several data ranks without MiCS, 1 time in 3:
    a divisor above 1 of dp x cp. Drawn from the case itself, as ``_mics``, so the draws made
    before hpZ joined the space keep every other field."""
    sizes = [s for s in range(2, case.dp * case.cp + 1) if (case.dp * case.cp) % s == 0]
    rng = random.Random("hpz" + case.to_json())
    moe = case.model == "gpt-moe"  # ZeRO-3 refuses MoE layers anyway
    if case.zero != 3 or case.mics or moe or not sizes or rng.random() >= 1 / 3:
        return 0
    return rng.choice(sizes)


def draw_cases(seed: int, n: int) -> list[Case]:
    """Cases 0..n-1 of ``seed``: the i-th draw of one ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [draw_case(rng) for _ in range(n)]


def layout_blocks(case: Case) -> dict:
    """The config blocks the layout sets (left out of the reference's config)."""
    zero: dict = {"stage": case.zero}
    if case.mics:
        zero["mics_shard_size"] = case.mics
    if case.hpz:
        zero["zero_hpz_partition_size"] = case.hpz
    if case.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if case.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    blocks: dict = {"zero_optimization": zero}
    if case.tp > 1 or case.sp:
        blocks["tensor_parallel"] = {"size": case.tp, "sequence_parallel": case.sp}
    if case.cp > 1:
        blocks["context_parallel"] = {"size": case.cp, "method": case.cp_method}
    pipe: dict = {"stages": case.pp, "schedule": case.schedule}
    if case.schedule == "interleaved" or case.schedule in V_SCHEDULES:
        pipe["chunks"] = 2
    if case.ckpt == "interval":
        pipe["activation_checkpoint_interval"] = 1
    if case.pp > 1 or case.schedule != "1f1b" or case.ckpt == "interval":
        blocks["pipeline"] = pipe
    if case.ckpt == "partition":  # each TP rank keeps 1/tp of a checkpointed block's input
        blocks["activation_checkpointing"] = {
            "checkpoint_layers": "all",
            "partition_activations": True,
        }
    return blocks


def train_config(case: Case, seed: int = 0) -> dict:
    """The config both runs share: no layout block, no batch size (verify sets them)."""
    cfg: dict = {
        "seed": seed,
        "gradient_accumulation_steps": case.gas,
        "optimizer": {"type": case.optimizer, "params": {}},
    }
    if case.scheduler is not None:
        cfg["scheduler"] = {"type": case.scheduler, "params": dict(SCHEDULERS[case.scheduler])}
    if case.clip:
        cfg["gradient_clipping"] = case.clip
    if case.precision != "fp32":
        cfg[case.precision] = {"enabled": True}
    if case.ckpt == "layers":
        cfg["activation_checkpointing"] = {"checkpoint_layers": "all"}
    return cfg


def reference_key(case: Case) -> str:
    """What the single-process run of ``case`` depends on (one reference per key)."""
    moe = dict(case.moe)
    split = case.dp if moe else 1  # MoE: the one process that splits rows as the ranks do
    return json.dumps([case.model, moe, train_config(case), case.rows, split], sort_keys=True)
