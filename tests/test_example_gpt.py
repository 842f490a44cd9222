"""examples/gpt: the model, the data, and one short end-to-end run of train.py."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import example_module
from waits import scaled

GPT_DIR = Path(__file__).resolve().parents[1] / "examples" / "gpt"


def _load(name: str):
    return example_module("gpt", name)


M = _load("model")
D = _load("data")


def tiny(**kw) -> M.GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return M.GPT(M.GPTConfig(**{**cfg, **kw}))


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_and_initial_loss(tie):
    model = tiny(tie_weights=tie)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 50, (2, 3, 16), generator=g)
    assert model(idx).shape == (3, 16, 50)
    # Targets unlike the inputs: a tied head scores each input token high (x . x > 0).
    loss = model(idx, targets)
    assert loss.dim() == 0
    # Near-uniform logits at init: the loss is the entropy of a uniform guess, ln(V).
    assert abs(loss.item() - math.log(50)) < 0.1, loss.item()
    assert (model.head.weight is model.tok_emb.weight) == tie


def test_causal_output_at_t_ignores_later_tokens():
    model = tiny().eval()
    a = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    b = a.clone()
    b[:, 9:] = (b[:, 9:] + 7) % 50  # change every token after position 8
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :9], lb[:, :9], rtol=0, atol=1e-6)
    assert (la[:, 9:] - lb[:, 9:]).abs().max() > 1e-3  # and the later ones do change


def test_no_key_bias_even_with_bias():
    model = tiny(bias=True)
    for block in model.blocks:
        assert block.attn.k.bias is None  # exact grad is zero: Adam would amplify noise
        assert block.attn.q.bias is not None


def test_heads_inferred_from_local_weight():
    """A column shard of q/k/v with half the heads (what TP will hand a rank) still runs."""
    model = tiny().eval()
    attn = model.blocks[0].attn
    half = attn.head_dim  # one of the two heads: its rows of q, k, v and columns of proj
    x = torch.randn(2, 5, 32)
    full = attn(x)
    parts = []
    for h in range(2):
        rows = slice(h * half, (h + 1) * half)
        shard = M.CausalSelfAttention(model.cfg).eval()
        for n in ("q", "k", "v"):
            getattr(shard, n).weight = torch.nn.Parameter(getattr(attn, n).weight[rows])
        shard.proj.weight = torch.nn.Parameter(attn.proj.weight[:, rows])
        parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)


def test_tp_plan_names_real_modules():
    from shardwise.parallel.tensor.fit import check_fit
    from shardwise.parallel.tensor.parallelize import STYLES, match_plan

    model = tiny()
    names = {n for n, _ in model.named_modules()}
    for pattern, style in M.GPT.tp_plan.items():
        assert style in STYLES, (pattern, style)
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        hits = [n for n in names if rx.fullmatch(n)]
        expected = model.cfg.n_layer if "*" in pattern else 1
        assert len(hits) == expected, (pattern, hits)
        assert STYLES[style].runs_as == style, f"{pattern}: {style} is not one of shardwise's own"
        found = {h: (pattern, style) for h in hits}
        check_fit(model, found, sequence_parallel=False)  # module kind, packing, input
    match_plan(model, M.GPT.tp_plan)  # what parallelize checks: every pattern, style and type


def _pipeline(model: M.GPT):
    from shardwise.pipe import PipelineModule

    return PipelineModule(M.pipeline_layers(model), num_stages=1, loss_fn=M.LMLoss())


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_form_is_the_gpt(tie):
    """The layer list computes the GPT's logits and loss, with the GPT's own parameters under
    names that gpt_name maps back one to one (tied: the embedding under tied_modules, the
    head the same tensor)."""
    model = tiny(tie_weights=tie)
    pipe = _pipeline(model)
    idx, targets = torch.randint(0, 50, (2, 3, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pipe(idx), model(idx), rtol=0, atol=0)
    torch.testing.assert_close(pipe.loss_fn(pipe(idx), targets), model(idx, targets))
    renamed = {M.gpt_name(k, 2, tie): v for k, v in pipe.state_dict().items()}
    want = {k for k in model.state_dict() if not (tie and k == "head.weight")}
    assert renamed.keys() == want, f"tie={tie}"
    for k, v in renamed.items():
        assert v.data_ptr() == model.state_dict()[k].data_ptr(), k  # shared, not copied
    for k in pipe.state_dict():
        assert M.pipeline_name(M.gpt_name(k, 2, tie), 2, tie) == k, f"tie={tie}: {k}"


def test_pipeline_tp_plan_names_real_modules():
    """GPT.tp_plan renamed for the pipeline hits the same modules, one pattern each."""
    from shardwise.parallel.tensor.parallelize import match_plan

    model = tiny()
    on_gpt = match_plan(model, M.GPT.tp_plan)
    on_pipe = match_plan(_pipeline(model), M.pipeline_tp_plan(2))
    assert {M.pipeline_name(n, 2): s for n, s in on_gpt.items()} == on_pipe


def test_tied_pipeline_has_no_tp_plan():
    with pytest.raises(ValueError, match="tie_weights"):
        M.pipeline_tp_plan(2, tied=True)


def test_generate_length_and_determinism():
    model = tiny()
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(
        idx, 20, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (2, 23) and out.max() < 50
    again = model.generate(
        idx, 20, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(out, again)
    assert model.generate(idx, 1, temperature=0).shape == (2, 4)
    assert model.training  # generate restores the mode it found


def test_bad_config_names_the_fields():
    with pytest.raises(ValueError, match="n_head"):
        M.GPTConfig(n_embd=30, n_head=4)


# ----------------------------------------------------------------------------- data


def test_corpus_is_deterministic_and_capped():
    a = D.load_corpus(0.2)
    assert len(a) == 200_000
    assert a == D.load_corpus(0.2)
    assert D.load_corpus(0.1) == a[:100_000]  # a prefix: the cap cuts one fixed sequence
    files = D.stdlib_files()
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert not any(f.name.startswith("_sysconfigdata") for f in files)


def test_split_is_deterministic_and_complete():
    text = "".join(chr(65 + i % 26) for i in range(100_000))
    tr, va = D.split_corpus(text, 0.1, chunk=1000)
    assert len(tr) + len(va) == len(text) and len(va) == 10_000
    assert va[:1000] == text[9000:10000]  # the 10th chunk is the first val chunk
    assert (tr, va) == D.split_corpus(text, 0.1, chunk=1000)
    tr, va = D.split_corpus(text[:5000], 0.1, chunk=32_768)  # short: chunks shrink to fit
    assert len(va) == 500 and len(tr) == 4500


def test_tokenizer_round_trip_and_unknown(tmp_path):
    text = D.load_corpus(0.05)
    tok = D.CharTokenizer.from_text(text)
    assert tok.chars == sorted(tok.chars) and D.UNK in tok.chars
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("é€")) == D.UNK * 2  # unseen characters map to UNK
    tok.save(tmp_path / "vocab.json")
    again = D.CharTokenizer.load(tmp_path / "vocab.json")
    assert again.chars == tok.chars


def test_windows_are_shifted_by_one_and_cover_the_tokens():
    tokens = torch.arange(100, dtype=torch.int32)
    ds = D.CharWindows(tokens, block_size=8)
    assert len(ds) == 12  # starts 0, 8, ..., 88; the last needs tokens up to 96
    x, y = ds[3]
    assert x.dtype == torch.long and torch.equal(x, torch.arange(24, 32))
    assert torch.equal(y, x + 1)
    assert torch.equal(ds[-1][0], ds[11][0])
    with pytest.raises(IndexError):
        ds[12]
    assert len(D.CharWindows(tokens, 8, stride=1)) == 92


# ----------------------------------------------------------------------------- end to end


SMALL_RUN = [
    "--steps", "6", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--corpus-mb", "0.2", "--eval-interval", "3", "--eval-windows", "8", "--warmup", "2",
    "--sample-chars", "40",
]  # fmt: skip


def _train(out: Path, nproc: int = 1, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """train.py on a small model: one plain process, or ``nproc`` under the launcher."""
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "shardwise", "run", "--nproc-per-node", str(nproc)
    ]  # fmt: skip
    cmd = [*launch, str(GPT_DIR / "train.py"), "--out", str(out), *SMALL_RUN, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a world of our own, not a rank of whatever world runs the tests
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference run: one process, micro-batch 4 x 2 accumulation steps = 8 windows."""
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


def _load_run(out: Path) -> tuple[M.GPT, dict]:
    from safetensors.torch import load_file

    meta = json.loads((out / "config.json").read_text())
    model = M.GPT(M.GPTConfig(**meta["model"]))
    model.load_state_dict(load_file(str(out / "model.safetensors")))  # strict: every key
    return model, json.loads((out / "metrics.json").read_text())


def assert_trains_like(out: Path, reference: Path, case: str) -> None:
    """The run in ``out`` against the one-process ``reference``: losses and every parameter
    within 1e-4 (fp32, six Adam steps: reduction order only; a wrong micro-batch, scale or
    reduction is >= 1e-2 off)."""
    ref_model, ref = _load_run(reference)
    model, got = _load_run(out)
    for key in ("train", "val"):
        diff = max(abs(a - b) for a, b in zip(got[key], ref[key], strict=True))
        assert diff < 1e-4, f"{case}: {key} losses {got[key]} vs one process {ref[key]}"
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4, msg=lambda m, n=n: f"{case} {n}: {m}")


def test_train_script_end_to_end(one_process):
    """A few steps of the real script in one process: every output is written and loads."""
    out = one_process
    for name in ("model.safetensors", "vocab.json", "config.json", "metrics.json", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob("*.tmp"))
    _, metrics = _load_run(out)
    assert len(metrics["train"]) == 6 and metrics["val_step"] == [0, 3, 6]
    assert all(math.isfinite(v) for v in metrics["train"] + metrics["val"])


# Layouts of the same global batch (8 windows) as the one-process run, so the same seed trains
# the same model: micro-batch x grad-accum x dp = 8.
LAYOUTS = [
    ("pp2", 2, ("--pp", "2", "--micro-batch", "2", "--grad-accum", "4")),
    ("dp2-pp2-tp2", 8, ("--dp", "2", "--pp", "2", "--tp", "2", "--micro-batch", "2",
                        "--grad-accum", "2")),
    # The second stage receives the sequence already split (sequence parallelism).
    ("pp2-tp2-sp", 4, ("--pp", "2", "--tp", "2", "--sp", "--micro-batch", "2",
                       "--grad-accum", "4")),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_pipeline_layouts_train_like_one_process(one_process, tmp_path, name, nproc, extra):
    """--pp (and 3D): the PipelineModule of the GPT's layers trains the one-process model, and
    its consolidated weights, renamed, load into the plain GPT the sampler uses."""
    proc = _train(tmp_path / name, nproc, extra)
    assert "sample:\ndef " in proc.stdout, f"{name}: {proc.stdout}"
    assert "pipeline partition (type:Block): 2 stages" in proc.stderr, f"{name}: {proc.stderr}"
    ref_model, ref = _load_run(one_process)
    model, got = _load_run(tmp_path / name)
    # fp32; tensor parallelism sums the matmuls in another order (~1e-7 relative per op),
    # six Adam steps carry that along: a wrong micro-batch, scale or reduction is >= 1e-2 off.
    for key in ("train", "val"):
        diff = max(abs(a - b) for a, b in zip(got[key], ref[key], strict=True))
        assert diff < 1e-4, f"{name}: {key} losses {got[key]} vs one process {ref[key]}"
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4, msg=lambda m, n=n: f"{name} {n}: {m}")


def test_moe_option_trains_expert_parallel_and_samples_in_one_process(tmp_path):
    """--moe-experts 4 --ep 2: each block's MLP becomes DeepSpeed's MoE split over two
    ranks; the consolidated weights hold all four experts under their one-process names,
    so the plain GPT with ep=1 loads them strictly and samples."""
    extra = ("--moe-experts", "4", "--ep", "2", "--micro-batch", "4")
    proc = _train(tmp_path / "moe", 2, extra)
    assert "sample:\ndef " in proc.stdout, proc.stdout
    model, metrics = _load_run(tmp_path / "moe")  # strict: every expert of every block
    experts = model.blocks[0].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == 4 and model.cfg.ep == 1
    assert metrics["train"][-1] < metrics["train"][0], metrics["train"]


# Context parallelism from the command line, on the same 8 windows per step as one process.
CP_LAYOUTS = [
    ("dp2-cp2-ring", 4, ("--cp", "2", "--micro-batch", "4", "--grad-accum", "1")),
    ("cp2-ulysses", 2, ("--cp", "2", "--cp-method", "ulysses", "--micro-batch", "4",
                        "--grad-accum", "2")),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,extra", CP_LAYOUTS, ids=[x[0] for x in CP_LAYOUTS])
def test_context_parallel_options_train_like_one_process(one_process, tmp_path, name, nproc, extra):
    """--cp N --cp-method: each rank trains on its tokens of its data rank's windows (train,
    validation and the reported losses), and the run is the one-process run."""
    proc = _train(tmp_path / name, nproc, extra)
    assert "x context 2" in proc.stderr, f"{name}: the topology line: {proc.stderr}"
    assert "sample:\ndef " in proc.stdout, f"{name}: {proc.stdout}"
    assert_trains_like(tmp_path / name, one_process, name)
