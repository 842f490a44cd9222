"""The contenders of benchmarks/zero.py, and how each one's model-state bytes are counted.

Every builder returns a ``Contender``: a forward + backward (returns the local loss), an update
(optimizer step + zeroing), and a memory probe giving bytes by kind (params, grads, optimizer,
comm buffers) counted from the engine's live tensors. Each builds its own copy of common.py's
model from the same seed and its own torch AdamW with the same hyper-parameters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from common import make_model, optimizer_tensors  # zero.py puts benchmarks/ on sys.path
from torch import nn

LR, WEIGHT_DECAY = 1e-3, 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ("params", "grads", "optimizer", "comm_buffers")
# ZeRO paper, model states per parameter: (param bytes, grad bytes, optimizer bytes K). fp32
# Adam keeps no separate master (papers.md, "for CPU / fp32 tests"); bf16 is the paper's case.
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


@dataclass
class Contender:
    name: str
    stage: int  # the ZeRO stage it implements (0: plain data parallelism)
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    update: Callable[[], None]
    probe: Callable[[], dict[str, int]]  # bytes by kind, this rank, now
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps_done: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # max over ranks and probe points
    # Buffers the last probe found beside the known states (path, bytes): the report's notes.
    found: list[tuple[str, int]] = field(default_factory=list)
    engine: object = None  # ours / DeepSpeed's engine, for scripts that inspect or A/B it


def formula_bytes(stage: int, dtype: str, psi: int, n: int) -> float:
    """ZeRO's model-state bytes per rank (arXiv 1910.02054 5.1-5.3), stage 0 = plain DP."""
    p, g, k = BYTES_PER_PARAM[dtype]
    return {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }[stage]


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def zero_block(args: argparse.Namespace, stage: int) -> dict:
    """The same ``zero_optimization`` block for us and DeepSpeed, every size explicit: their
    defaults differ (500M-element buckets in DeepSpeed) and would measure different things."""
    return {
        "stage": stage,
        "reduce_bucket_size": args.bucket_elements,
        "allgather_bucket_size": args.bucket_elements,
        "stage3_prefetch_bucket_size": args.prefetch_elements,
        "stage3_param_persistence_threshold": args.persistence_threshold,
    }


def engine_config(args: argparse.Namespace, stage: int, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0 now; ours and torch's is off
        "zero_optimization": zero_block(args, stage),
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,  # a plain torch AdamW, the same as the others'
        "steps_per_print": 10**9,
    }


# ----------------------------------------------------------------------------- counting bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2); any other tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def count_bytes(by_kind: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes by kind, each storage counted once under the first kind that holds it (a grad or
    master that views a flat buffer is free). Storages, not views: the whole allocation is
    what the process holds. 0-dim tensors (Adam's step counters) are bookkeeping, left out,
    as shardwise.monitor.memory does."""
    seen: set[int] = set()
    out = {}
    for kind in KINDS:
        total = 0
        for t in by_kind.get(kind, ()):
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.dim() == 0:
                continue
            s = t.untyped_storage()
            if s.data_ptr() == 0 or s.data_ptr() in seen:  # freed (resized to 0) or counted
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
        out[kind] = total
    return out


def reachable_tensors(root: object, prefix: str, max_depth: int = 6) -> dict[str, torch.Tensor]:
    """Tensors reachable from ``root`` through attributes, lists and dicts of DeepSpeed's /
    torch's optimizer and FSDP objects, by path: finds the buffers an engine keeps alive that
    are neither parameters, gradients nor optimizer state (comm buckets, flat copies)."""
    found: dict[str, torch.Tensor] = {}
    visited: set[int] = set()
    stack = [(root, prefix, 0)]
    while stack:
        obj, path, depth = stack.pop()
        if id(obj) in visited or depth > max_depth:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.setdefault(path, obj)
            if hasattr(obj, "ds_tensor"):  # a ZeRO-3 parameter: its partition hangs off it
                stack.append((obj.ds_tensor, f"{path}.ds_tensor", depth + 1))
            continue
        if isinstance(obj, nn.Module):
            continue  # parameters are counted from the module; do not walk the whole model
        if isinstance(obj, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim", "torch.distributed")):
            items = (
                [(f"{path}.{k}", v) for k, v in vars(obj).items()]
                if hasattr(obj, "__dict__")
                else []
            )
        else:
            continue
        stack.extend((v, p, depth + 1) for p, v in items)
    return found


def classify_extra(
    known: dict[str, Iterable[torch.Tensor]], extra: dict[str, torch.Tensor]
) -> tuple[dict[str, list[torch.Tensor]], list[tuple[str, int]]]:
    """Add reachable tensors that no known kind holds: named ``*grad*`` to grads, the rest to
    comm_buffers; also return the rest's paths and bytes (what the report notes)."""
    seen = {
        _local(t).untyped_storage().data_ptr() for ts in known.values() for t in ts if t is not None
    }
    by_kind = {k: list(v) for k, v in known.items()}
    others: list[tuple[str, int]] = []
    # Shortest path first: a flat buffer is named by itself, not by a dict of views into it.
    for path, t in sorted(extra.items(), key=lambda kv: (len(kv[0]), kv[0])):
        s = _local(t).untyped_storage()
        if s.data_ptr() in seen or s.data_ptr() == 0 or t.dim() == 0:
            continue
        seen.add(s.data_ptr())
        kind = "grads" if "grad" in path.lower() else "comm_buffers"
        by_kind.setdefault(kind, []).append(t)
        others.append((f"{kind}: {path}", s.nbytes()))
    return by_kind, others


# ----------------------------------------------------------------------------- contenders


def build_ours(args: argparse.Namespace, stage: int, dtype: str) -> Contender:
    import shardwise

    model = make_model(args)
    engine, *_ = shardwise.initialize(
        model=model, optimizer=adamw(model.parameters()), config=engine_config(args, stage, dtype)
    )

    def backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def probe() -> dict[str, int]:
        b = engine.memory_breakdown()
        return {k: b[k] for k in KINDS}

    c = Contender(f"shardwise Z{stage}", stage, backward, engine.step, probe)
    c.engine = engine
    return c


def build_ddp(args: argparse.Namespace, dtype: str) -> Contender:
    """DDP (stage 0). bf16: the model runs in bf16 (DDP all-reduces bf16 gradients) and AdamW
    steps an fp32 master copy, written back in bf16: the same precision recipe as ours."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(args).to(DTYPES[dtype])
    ddp = DDP(model)  # torch's defaults: 25 MiB buckets, gradients copied into them
    params = list(model.parameters())
    masters = params if dtype == "fp32" else [nn.Parameter(p.detach().float()) for p in params]
    opt = adamw(masters)

    def backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ddp(x, y)
        loss.backward()
        return loss

    def update() -> None:
        if masters is not params:
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float()
        opt.step()
        if masters is not params:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
            for m in masters:
                m.grad = None
        opt.zero_grad()
        model.zero_grad()  # set_to_none, torch's default

    def probe() -> dict[str, int]:
        # DDP's bucket copies of the gradients live in C++; its logging data has their sizes.
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        b = count_bytes(
            {
                "params": params,
                "grads": [p.grad for p in params] + [m.grad for m in masters],
                "optimizer": ([] if masters is params else masters) + optimizer_tensors(opt),
            }
        )
        b["comm_buffers"] = sum(int(s) for s in sizes.split(", ") if s)
        return b

    return Contender("torch DDP", 0, backward, update, probe)


def build_fsdp2(args: argparse.Namespace, dtype: str) -> Contender:
    """FSDP2 (stage 3): fully_shard on every block, then on the root (embeddings, final LN,
    tied head). bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), so the
    sharded parameters stay fp32 and are themselves the master AdamW steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(args)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw: dict = {"mesh": mesh}
    if dtype == "bf16":
        # Ours and DeepSpeed cast the model to bf16 and copy THAT into the fp32 master; an
        # FSDP2 master holding the unrounded init would train other weights (1.6e-2 apart in
        # loss after 3 steps). Round the init the same way, so all start from one point.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = adamw(model.parameters())

    def backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        return loss

    def update() -> None:
        opt.step()
        opt.zero_grad()

    def probe() -> dict[str, int]:
        params = list(model.parameters())
        known = {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": optimizer_tensors(opt),
        }
        extra = {}
        for i, m in enumerate([*model.blocks, model]):
            extra.update(reachable_tensors(m._get_fsdp_state(), f"fsdp[{i}]"))
        by_kind, c.found = classify_extra(known, extra)
        return count_bytes(by_kind)

    c = Contender("torch FSDP2", 3, backward, update, probe)
    return c


def build_deepspeed(args: argparse.Namespace, ds: object, stage: int, dtype: str) -> Contender:
    model = make_model(args)
    opt = adamw(model.parameters())
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=engine_config(args, stage, dtype))

    def backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def probe() -> dict[str, int]:
        params = list(model.parameters())
        zero_opt = engine.optimizer
        inner = getattr(zero_opt, "optimizer", opt)  # the AdamW, now over fp32 partitions
        # ZeRO-3 empties the groups' params after each step: its masters are the state's keys.
        masters = [p for g in inner.param_groups for p in g["params"]] + list(inner.state)
        known = {
            # ZeRO-3 parameters are empty between uses: their partition is ds_tensor.
            "params": [getattr(p, "ds_tensor", None) for p in params] + params,
            "grads": [p.grad for p in params] + [m.grad for m in masters],
            "optimizer": masters + optimizer_tensors(inner),
        }
        by_kind, c.found = classify_extra(known, reachable_tensors(zero_opt, "opt"))
        return count_bytes(by_kind)

    c = Contender(f"DeepSpeed Z{stage}", stage, backward, engine.step, probe)
    c.engine = engine
    return c
