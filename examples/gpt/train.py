"""Train a character-level GPT on CPython's own standard library, on one or many processes.

    python -m shardwise run --nproc-per-node 2 examples/gpt/train.py --out runs/demo
    python examples/gpt/train.py --out runs/one          # one process needs no launcher

Written the way a DeepSpeed user writes a script: build a config dict, call
``shardwise.initialize``, then ``engine(x, y)`` / ``engine.backward(loss)`` / ``engine.step()``;
with ``--pp`` > 1 the model is a ``PipelineModule`` of the GPT's layers and a step is
``engine.train_batch(data)`` (the micro-batches of one step flow through the stages).
Writes to --out: model.safetensors, vocab.json, config.json, metrics.json, loss.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

# model.py and data.py live beside this file, whichever directory the launcher starts us in.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from data import CharTokenizer, CharWindows, build_datasets  # noqa: E402
from model import (  # noqa: E402
    GPT,
    GPTConfig,
    LMLoss,
    gpt_name,
    pipeline_aux_loss,
    pipeline_layers,
    pipeline_tp_plan,
)
from tqdm import tqdm  # noqa: E402

import shardwise  # noqa: E402
from shardwise.metrics import MeanMetric, all_reduce_mean  # noqa: E402
from shardwise.pipe import PipelineModule  # noqa: E402
from shardwise.utils import RepeatingLoader  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpt", help="directory for checkpoint, plot, metrics")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="windows per rank per micro-step")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-steps per optimizer step; the pipeline's micro-batches (default 1, or 2*pp)",
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128, help="context length in characters")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie-weights", action="store_true", help="share tok_emb and head weights")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-interval", type=int, default=50, help="steps between val losses")
    p.add_argument("--eval-windows", type=int, default=256, help="val windows per evaluation")
    p.add_argument("--corpus-mb", type=float, default=3.0, help="MB of stdlib source to use")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (0: what remains)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"),
        help="pipeline schedule (with --pp > 1); interleaved, zbv, dualpipev run 2 chunks a stage",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--sp", action="store_true", help="sequence parallelism between the TP regions (--tp > 1)"
    )
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (splits sequences)")
    p.add_argument("--cp-method", choices=("ring", "ulysses"), default="ring", help="with --cp")
    p.add_argument("--moe-experts", type=int, default=0, help="MoE feed-forward experts (0: MLP)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides dp)")
    p.add_argument("--moe-k", type=int, default=1, help="experts per token: 1 or 2")
    p.add_argument("--config", default=None, help="JSON file merged over the built config")
    p.add_argument("--sample-chars", type=int, default=300, help="length of the final sample")
    args = p.parse_args(argv)
    if args.grad_accum is None:
        # A pipeline idles (p - 1) / (m + p - 1) of a step: give it m = 2p micro-batches.
        args.grad_accum = 1 if args.pp == 1 else 2 * args.pp
    return args


def build_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed-style config dict; --config JSON is merged over it key by key."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        # A short run: weight decay has no time to matter, and skipping it avoids the param
        # groups nanoGPT needs to exempt norms and biases.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.0},
        },
        "scheduler": {
            "type": "WarmupDecayLR",  # linear warmup, then linear decay to 0 at the last step
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": args.warmup,
                "total_num_steps": max(args.steps, 1),
                "warmup_type": "linear",
            },
        },
        "gradient_clipping": 1.0,
        "seed": args.seed,
        "steps_per_print": args.eval_interval,
    }
    # Only the layouts asked for: a size-1 block would still make the config say "pipeline".
    if args.pp > 1:
        cfg["pipeline"] = {"stages": args.pp, "schedule": args.schedule}
        if args.schedule in ("interleaved", "zbv", "dualpipev"):
            cfg["pipeline"]["chunks"] = 2  # zbv, dualpipev: a V, stage 0 holds both ends
    if args.tp > 1:
        cfg["tensor_parallel"] = {"size": args.tp, "sequence_parallel": args.sp}
        if args.pp > 1:  # GPT.tp_plan, named as the PipelineModule names the layers
            cfg["tensor_parallel"]["plan"] = pipeline_tp_plan(args.n_layer, args.tie_weights)
    if args.cp > 1:
        cfg["context_parallel"] = {"size": args.cp, "method": args.cp_method}
    if args.config:
        _merge(cfg, json.loads(Path(args.config).read_text()))
    return cfg


def _merge(base: dict, override: dict) -> None:
    """Nested update: {"optimizer": {"params": {"lr": 1}}} changes only the lr."""
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


@torch.no_grad()
def evaluate(engine: shardwise.Engine, val: CharWindows, n_windows: int, batch: int) -> float:
    """Mean val loss over a fixed, evenly spaced set of windows, split across data ranks.

    Fixed windows make successive values comparable (no sampling noise between evals);
    splitting them by rank makes the evaluation cost 1/dp of one process's.
    """
    n = min(n_windows, len(val))
    picks = [i * len(val) // n for i in range(n)]
    if engine.pipeline is not None:
        return _evaluate_pipeline(engine, val, picks, batch)
    mine = picks[engine.dp_rank :: engine.dp_world_size]
    engine.eval()
    mean = MeanMetric()  # weighted by windows: exact even when dp does not divide n
    for s in range(0, len(mine), batch):
        xs, ys = zip(*(val[i] for i in mine[s : s + batch]), strict=True)
        x, y = torch.stack(xs).to(engine.device), torch.stack(ys).to(engine.device)
        mean.update(engine(engine.shard_sequence(x), engine.shard_sequence(y)).item(), len(xs))
    engine.train()
    return mean.compute(group=engine.mesh.dp_cp_group)  # context ranks: other tokens


def _evaluate_pipeline(
    engine: shardwise.Engine, val: CharWindows, picks: list[int], batch: int
) -> float:
    """evaluate() through the pipeline: ``eval_batch`` runs the micro-batches through the
    stages and returns their mean, averaged over data ranks, on every rank.

    That mean is unweighted, so every data rank gets the same number of windows (the picks
    beyond a multiple of dp are left out) and micro-batches of one size per call: the full
    ones, then one call for the remainder, weighted by windows."""
    per_rank = len(picks) // engine.dp_world_size
    mine = picks[engine.dp_rank :: engine.dp_world_size][:per_rank]
    full = per_rank - per_rank % batch
    total = 0.0
    for part, size in ((mine[:full], batch), (mine[full:], per_rank - full)):
        if not part:
            continue
        micro = []
        for s in range(0, len(part), size):
            xs, ys = zip(*(val[i] for i in part[s : s + size]), strict=True)
            micro.append((torch.stack(xs), torch.stack(ys)))
        total += engine.eval_batch(iter(micro), num_micro_batches=len(micro)).item() * len(part)
    return total / per_rank


def train_step(engine: shardwise.Engine, data: Iterator) -> float:
    """One optimizer step over GAS micro-batches; the loss averaged over them and over ranks."""
    if engine.pipeline is not None:  # the schedule runs forward, backward and step
        return engine.train_batch(data).item()
    loss_sum = 0.0
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = next(data)  # whole windows; under --cp each rank keeps its tokens of them
        x, y = (
            engine.shard_sequence(x.to(engine.device)),
            engine.shard_sequence(y.to(engine.device)),
        )
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()  # updates only at the accumulation boundary
        loss_sum += loss.item()
    # Each rank saw different windows (or, with --cp, other tokens of them): the curve is
    # their mean over the data x context group (tp/pp ranks of one data shard hold the same
    # loss and must not count twice).
    mean = loss_sum / engine.gradient_accumulation_steps()
    return all_reduce_mean(mean, engine.mesh.dp_cp_group)


def setup(args: argparse.Namespace) -> tuple:
    """Data, model and engine, the same on every rank; rank 0 says what it built."""
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    train_set, val_set, tok, corpus = build_datasets(args.corpus_mb, args.block_size)
    gcfg = GPTConfig(
        vocab_size=tok.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
        tie_weights=args.tie_weights,
        moe_experts=args.moe_experts,
        ep=args.ep,
        moe_k=args.moe_k,
    )
    model = GPT(gcfg)
    n_params = model.num_params()  # before tensor parallelism splits the layers in place
    cfg = build_config(args)
    net: torch.nn.Module = model
    if args.pp > 1:  # stages: the embeddings and the first blocks, ..., the last blocks and head
        net = PipelineModule(
            pipeline_layers(model),
            loss_fn=LMLoss(),
            partition_method="type:Block",
            aux_loss_fn=pipeline_aux_loss(model),  # MoE: each stage's load-balancing terms
        )
    engine, _, loader, _ = shardwise.initialize(model=net, config=cfg, training_data=train_set)
    if args.dp and args.dp != engine.dp_world_size:
        raise SystemExit(
            f"--dp {args.dp} but the world of {engine.world_size} processes with pp={args.pp} "
            f"tp={args.tp} cp={args.cp} leaves dp={engine.dp_world_size}: launch dp*pp*tp*cp "
            "processes"
        )
    if engine.global_rank == 0:
        print(
            f"corpus: {corpus['chars']:,} chars of stdlib source (sha256 {corpus['digest']}), "
            f"vocab {tok.vocab_size}, {len(train_set):,} train / {len(val_set):,} val windows\n"
            f"model: {n_params / 1e6:.2f}M params, {gcfg}\n"
            f"layout: {engine.world_size} process(es), dp={engine.dp_world_size} pp={args.pp} "
            f"tp={args.tp} cp={args.cp}; {engine.train_batch_size()} windows of {args.block_size} chars "
            "per step",
            flush=True,
        )
    return engine, loader, val_set, tok, corpus, gcfg, cfg


def train(args: argparse.Namespace) -> dict:
    """Run the training loop; returns the metrics written to metrics.json."""
    engine, loader, val_set, tok, corpus, gcfg, cfg = setup(args)
    tokens_per_step = engine.train_batch_size() * args.block_size

    def val_loss() -> float:
        return evaluate(engine, val_set, args.eval_windows, args.micro_batch)

    # Step 0 is the untrained model: the curve starts from ln(vocab), the uniform guess.
    hist: dict = {"step": [], "train": [], "lr": [], "val_step": [0], "val": [val_loss()]}
    data = iter(RepeatingLoader(loader))  # the loader ends with each epoch; this does not
    bar = tqdm(
        range(1, args.steps + 1), disable=engine.global_rank != 0, desc="train", mininterval=0.5
    )
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        hist["lr"].append(engine.get_lr()[0])  # the lr this step uses
        hist["train"].append(train_step(engine, data))
        hist["step"].append(step)
        tok_s = tokens_per_step / (time.perf_counter() - t0)  # training only, not evaluation
        if step % args.eval_interval == 0 or step == args.steps:
            hist["val_step"].append(step)
            hist["val"].append(val_loss())
        bar.set_postfix_str(
            f"loss {hist['train'][-1]:.3f} val {hist['val'][-1]:.3f} {tok_s:,.0f} tok/s",
            refresh=False,
        )
    bar.close()
    hist["seconds"] = time.perf_counter() - t_start
    save_outputs(engine, args, gcfg, cfg, tok, corpus, hist)
    return hist


def save_outputs(
    engine: shardwise.Engine,
    args: argparse.Namespace,
    gcfg: GPTConfig,
    cfg: dict,
    tok: CharTokenizer,
    corpus: dict,
    hist: dict,
) -> None:
    """Checkpoint, vocab, config, metrics and plot on rank 0; then the sample."""
    # Every rank calls this: gathering a sharded layout's full weights is collective.
    state = engine.consolidated_state_dict()
    if engine.global_rank != 0:
        return
    if engine.pipeline is not None:  # "3.attn.q.weight" -> "blocks.2.attn.q.weight"
        state = {gpt_name(k, gcfg.n_layer, gcfg.tie_weights): v for k, v in state.items()}
        if gcfg.tie_weights:  # the tied form holds one tensor; the GPT names it twice
            state["head.weight"] = state["tok_emb.weight"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(state, out / "model.safetensors")
    tok.save(out / "vocab.json")
    # The consolidated weights hold every expert under its single-process name: ep=1 loads them.
    meta = {
        "model": {**asdict(gcfg), "ep": 1},
        "shardwise": cfg,
        "corpus": corpus,
        "args": vars(args),
    }
    _write_json(out / "config.json", meta)
    _write_json(out / "metrics.json", hist)
    plot_losses(hist, out / "loss.png", tok.vocab_size)
    train_s = f"{hist['train'][0]:.3f} -> {hist['train'][-1]:.3f}" if hist["train"] else "-"
    print(
        f"done: {args.steps} steps in {hist['seconds']:.1f}s; train loss {train_s}, "
        f"val {hist['val'][0]:.3f} -> {hist['val'][-1]:.3f}; "
        f"wrote {out}/{{model.safetensors,vocab.json,config.json,metrics.json,loss.png}}"
    )
    if args.sample_chars > 0:
        print("sample:\n" + sample(out, args.sample_chars, seed=args.seed), flush=True)


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written to a temporary name, then renamed: never a half-written file."""
    from safetensors.torch import save_file

    # safetensors refuses tensors sharing memory (a tied head): store each as its own copy.
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def plot_losses(hist: dict, path: Path, vocab_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(hist["step"], hist["train"], lw=0.8, alpha=0.8, label="train")
    ax.plot(hist["val_step"], hist["val"], "o-", label="val")
    ax.axhline(math.log(vocab_size), color="gray", ls=":", label="uniform guess, ln(vocab)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("char-level GPT on the CPython stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sample(out: Path, n_chars: int, prompt: str = "def ", seed: int = 0) -> str:
    """Text from the checkpoint just written, loaded into a fresh model.

    Sampling from the saved files (not the engine's module) works whatever the layout was,
    and shows at the same time that the checkpoint loads.
    """
    from safetensors.torch import load_file

    meta = json.loads((out / "config.json").read_text())
    tok = CharTokenizer.load(out / "vocab.json")
    model = GPT(GPTConfig(**meta["model"]))
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    idx = torch.tensor([tok.encode(prompt)])
    g = torch.Generator().manual_seed(seed)
    # Temperature 1: at this size, cooler sampling collapses into long runs of spaces (the
    # most likely character after indentation is more indentation).
    ids = model.generate(idx, n_chars, temperature=1.0, top_k=None, generator=g)
    return tok.decode(ids[0])


def shardwise_verify(**model: Any) -> dict:
    """Entry point of ``shardwise verify examples/gpt/train.py --layouts dp2,tp2,pp2``
    (docs/verify.md): a 2-layer GPT, 8 windows per step in 2 micro-batches, this script's
    optimizer and clipping at a constant lr; no dropout, so every layout can match one process.
    ``model`` overrides GPTConfig fields (``shardwise verify --fuzz`` builds the MoE variant
    with ``moe_experts``, ``moe_k``, ``ep`` and ``moe_args``)."""
    small = "--n-layer 2 --n-embd 32 --n-head 2 --block-size 32 --corpus-mb 0.1 --grad-accum 2"
    args = parse_args(small.split())
    train_set, _, tok, _ = build_datasets(args.corpus_mb, args.block_size)
    gcfg = GPTConfig(
        tok.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, **model
    )

    def batches() -> Iterator:
        g = torch.Generator().manual_seed(args.seed)  # the same windows at every call
        while True:
            picks = torch.randint(len(train_set), (8,), generator=g).tolist()
            yield tuple(torch.stack(t) for t in zip(*(train_set[i] for i in picks), strict=True))

    def pipeline(model: GPT) -> PipelineModule:
        pipe = PipelineModule(
            pipeline_layers(model),
            loss_fn=LMLoss(),
            partition_method="type:Block",
            aux_loss_fn=pipeline_aux_loss(model),
        )
        if not gcfg.tie_weights:  # GPT.tp_plan in the pipeline's names (the tied form has none)
            pipe.tp_plan = pipeline_tp_plan(args.n_layer)
        return pipe

    cfg = build_config(args)
    del cfg["scheduler"]  # its warmup holds lr at 0 for the first steps: nothing would move
    return {"model": lambda: GPT(gcfg), "batches": batches, "config": cfg, "pipeline": pipeline}


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
