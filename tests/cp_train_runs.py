"""Context-parallel runs of the example GPT, and the one-process run they must match.

``setup``: what one_process.reference_run trains (one process, plain PyTorch, SGD with
momentum, global-norm clipping), the whole sequence of every window. ``engine_run``: every
rank trains through ``shardwise.initialize`` with ``context_parallel`` (and data, tensor, ZeRO,
activation checkpointing as the layout says), on its data rank's windows, each context rank on
its tokens of them. Both give the step losses (the mean over every token of the global batch)
and the final whole parameters.
"""

from __future__ import annotations

from functools import partial

import torch
from models import make_gpt, make_tokens
from one_process import global_batches

import shardwise
from shardwise import comm
from shardwise.verify import VerifySetup

VOCAB, SEQ, MB, STEPS = 40, 32, 2, 5
GPT = {"vocab_size": VOCAB, "block_size": SEQ, "n_embd": 32}  # 2 blocks, 4 heads (models.py)
SGD = {"lr": 0.2, "momentum": 0.9}  # not Adam: its updates ignore a wrong gradient scale


def make_windows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows of SEQ tokens and their next tokens."""
    return make_tokens(n, VOCAB, SEQ, seed=5)


def setup(
    dp: int, gas: int, causal: bool = True, clip: float = 0.0, steps: int = STEPS
) -> VerifySetup:
    """The run a context-parallel layout makes, for the one-process reference: the whole
    windows of the global batch of MB * dp * gas windows per step (the engine cuts the tokens
    over the context ranks; one process sees every window whole)."""
    config = {"optimizer": {"type": "SGD", "params": SGD}, "gradient_clipping": clip}
    batches = global_batches(make_windows, MB * dp * gas, steps)
    return VerifySetup(partial(make_gpt, causal, **GPT), batches, config)


def _config(layout: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": layout.get("gas", 1),
        "gradient_clipping": layout.get("clip", 0.0),
        "optimizer": {"type": "SGD", "params": SGD},
        "context_parallel": {"size": layout["cp"], "method": layout["method"]},
        "zero_optimization": {"stage": layout.get("zero", 0)},
    }
    if layout.get("zero") == 3:  # shard every parameter, however small
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if layout.get("tp", 1) > 1:
        cfg["tensor_parallel"] = {"size": layout["tp"]}
    if layout.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if layout.get("recompute"):
        cfg["activation_checkpointing"] = {"checkpoint_layers": "all"}
    return cfg


def _micro_batches(engine, x, y, k: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data rank's micro-batches of step ``k`` (whole windows)."""
    dp, rank, out = engine.dp_world_size, engine.dp_rank, []
    for j in range(gas):
        start = ((k * gas + j) * dp + rank) * MB
        out.append((x[start : start + MB], y[start : start + MB]))
    return out


def _step(engine, micro: list, api: str) -> float:
    """One optimizer step; the global mean loss."""
    if api == "train_batch":  # the engine cuts the sequences itself
        return engine.train_batch(iter(micro)).item()
    total = 0.0
    for x, y in micro:
        loss = engine(engine.shard_sequence(x), engine.shard_sequence(y))
        engine.backward(loss)
        engine.step()
        total += loss.item() / len(micro)
    mean = torch.tensor(total)
    comm.all_reduce(mean, group=engine.mesh.dp_cp_group)
    return mean.item() / engine.mesh.topology.dp_cp


def engine_run(layout: dict, steps: int = STEPS, save: str = "", load: str = "") -> dict:
    """``layout``: cp, method, and optionally tp, zero, gas, clip, recompute, causal, api
    ("loop": engine(shard_sequence(x)) / backward / step; "train_batch"; "loader": the loader
    ``initialize`` builds over 64 windows, read by ``train_batch()``). With ``load``, the
    run resumes from that checkpoint and trains the steps after it; with ``save``, it saves
    at the end."""
    gas, api = layout.get("gas", 1), layout.get("api", "loop")
    model = make_gpt(layout.get("causal", True), **GPT)
    data = list(zip(*make_windows(64), strict=True)) if api == "loader" else None
    engine, *_ = shardwise.initialize(model=model, config=_config(layout), training_data=data)
    first = 0
    if load:
        engine.load_checkpoint(load)
        first = engine.global_steps
    x, y = make_windows(MB * engine.dp_world_size * gas * (first + steps))
    losses, norms = [], []
    for k in range(first, first + steps):
        if api == "loader":  # initialize's loader: whole windows, cut by train_batch
            losses.append(engine.train_batch().item())
        else:
            losses.append(_step(engine, _micro_batches(engine, x, y, k, gas), api))
        norms.append(engine.get_global_grad_norm())
    if save:
        engine.save_checkpoint(save)
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params}


def attention_bytes(layout: dict, seq: int) -> dict:
    """Bytes this rank sends in one forward of the GPT under ``layout`` (comm.stats)."""
    model = make_gpt(**GPT)
    engine, *_ = shardwise.initialize(model=model, config=_config(layout))
    x, y = make_windows(MB)
    comm.reset_stats()
    with torch.no_grad():
        engine(engine.shard_sequence(x[:, :seq]), engine.shard_sequence(y[:, :seq]))
    stats = comm.stats()
    engine.destroy()
    return stats


def forward_error(layout: dict, model: str) -> str:
    """The error of initialize (prefixed "initialize ") or else of the first forward under
    ``layout`` ("" if none): ``model`` "no-attention"
    (embedding and head, no shardwise.attention) or "gpt-2-heads"."""
    if model == "no-attention":
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    else:
        net = make_gpt(n_head=2, **GPT)
    try:
        engine, *_ = shardwise.initialize(model=net, config=_config(layout))
    except Exception as e:  # refused before any work
        return f"initialize {type(e).__name__}: {e}"
    x, _ = make_windows(MB)
    try:
        engine(engine.shard_sequence(x))
        return ""
    except Exception as e:  # the message is what the test reads
        return f"{type(e).__name__}: {e}"
    finally:
        engine.destroy()


def gqa_attention(method: str, causal: bool) -> dict:
    """``shardwise.attention(..., enable_gqa=True)`` on this rank's tokens of 4 query heads
    and 2 key/value heads, under a context of the world (rank order): the output and the
    gradients of q, k, v, each rank's tokens."""
    from shardwise.parallel.context.scope import ContextParallel

    world = comm.get_world_size()
    ctx = ContextParallel(world, comm.get_rank(), method, None, tuple(range(world)))
    q, k, v, grad = gqa_inputs()
    q, k, v = (ctx.shard(t, 2).detach().requires_grad_() for t in (q, k, v))
    with ctx.active():
        out = shardwise.attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(ctx.shard(grad, 2))
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def gqa_inputs() -> tuple[torch.Tensor, ...]:
    """q (2, 4, 16, 8), k and v (2, 2, 16, 8), the output's gradient (2, 4, 16, 8)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8)]
    return tuple(torch.randn(s, generator=g) for s in shapes)


def hf_run(family: str, cp: int, method: str, steps: int, mb: int, lr: float, clip: float) -> dict:
    """A Hugging Face model (hf_models.py) trained by ``train_batch`` on whole-sequence
    ``{"input_ids", "labels"}`` micro-batches under context parallelism; this data rank's rows
    of each global batch of mb x dp rows; SGD with momentum, clipping at ``clip``."""
    from hf_models import make_hf_batches, make_hf_model, take

    config = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
        "context_parallel": {"size": cp, "method": method},
    }
    engine, *_ = shardwise.initialize(model=make_hf_model(family), config=config)
    dp, rank = engine.dp_world_size, engine.dp_rank
    data = make_hf_batches(family, mb * dp * steps)
    losses, norms = [], []
    for k in range(steps):
        start = (k * dp + rank) * mb
        losses.append(engine.train_batch(iter([take(data, slice(start, start + mb))])).item())
        norms.append(engine.get_global_grad_norm())
    params = engine.consolidated_state_dict()
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params}


def hf_padding_error() -> str:
    """The error of a Llama batch with padding (a 0 in attention_mask) under cp 2."""
    from hf_models import make_hf_batches, make_hf_model

    config = {"train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": 2}}
    engine, *_ = shardwise.initialize(model=make_hf_model("llama"), config=config)
    batch = make_hf_batches("llama", 2)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, -2:] = 0
    try:
        engine.eval_batch(iter([batch]))
        return ""
    except Exception as e:  # the message is what the test reads
        return f"{type(e).__name__}: {e}"
    finally:
        engine.destroy()
