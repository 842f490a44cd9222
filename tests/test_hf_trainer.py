"""The Hugging Face Trainer (and Accelerate) on shardwise through the ``deepspeed`` shim:
examples/hf_trainer/run_clm.py, a script in the shape of Transformers' ``run_clm.py``, run
with ``--deepspeed ds_config_zeroN.json`` on 2 processes, the script the same in every run and
only the launcher, config and batch flags changing (docs/hf-trainer.md).

The shim is installed by pip into a fresh venv that sees this environment's packages behind
it (shim_env.py), so the Trainer's own availability check finds it. Each case trains a tiny
GPT-2 (2 layers, width 32, dropout off) for 4 optimizer steps of 8 blocks of 32 characters
(2 processes x 2 per device x 2 accumulated micro-batches), saving a checkpoint at step 2, and
is compared with the same script in one process without DeepSpeed (4 per device x 2).

Every run starts from one saved model (``--model_name_or_path``): built from a config under
ZeRO-3, transformers initializes the weights in another order (rank 0 under
``GatheredParameters``, after construction), so a from-scratch ZeRO-3 run starts elsewhere
than a plain one, with DeepSpeed as here.

Tolerances. fp32: losses and the saved weights within 1e-5 of the one-process run: two
half-batch gradients averaged equal the whole batch's up to float32 rounding (~1e-7), and
4 Adam steps at lr 1e-3 leave that far below 1e-5 (measured: losses 2.4e-7, weights 3.2e-7).
bf16: DeepSpeed's bf16 keeps bf16 weights (8 significant bits, 2**-9 relative rounding), so
against the fp32 reference the losses are held to 2e-3 (measured 3.2e-4) and the saved bf16
weights, which round values near 1 to steps of 2**-7, to 1e-2 (measured 3.5e-3). A resume
repeats the uninterrupted run's steps 3-4 bit for bit: the checkpoint holds weights, Adam,
the schedule, the data position and each rank's RNG.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from shim_env import run_script
from waits import scaled

import shardwise

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer"
STEPS = 4
TINY = "n_embd=32,n_layer=2,n_head=2,n_positions=64,vocab_size=44,bos_token_id=1,eos_token_id=1"
NO_DROPOUT = "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(name: str, python: str, config: Path) -> list[str]:
    if name == "shardwise run":
        return [python, "-m", "shardwise", "run", "--nproc-per-node", "2"]
    if name == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert name == "accelerate launch", name
    accelerate = [python, "-m", "accelerate.commands.launch", "--use_deepspeed"]
    accelerate += ["--num_processes", "2", "--num_machines", "1"]
    return accelerate + [
        "--main_process_port",
        str(_free_port()),
        "--deepspeed_config_file",
        str(config),
    ]


class Runs:
    """Launches of run_clm.py, each once per module, by name."""

    def __init__(self, where: Path, python: str) -> None:
        self.where = where
        self.python = python
        torch.manual_seed(0)
        config = transformers.GPT2Config()
        config.update_from_string(f"{TINY},{NO_DROPOUT}")
        self.init = where / "init"
        transformers.GPT2LMHeadModel(config).save_pretrained(self.init)
        self.done: dict[str, Path] = {}

    def run(self, name: str, launcher: str | None, config: str | None, *flags: str) -> Path:
        if name in self.done:
            return self.done[name]
        out = self.where / name
        cmd = (
            [self.python]
            if launcher is None
            else _launcher(launcher, self.python, EXAMPLE / config)
        )
        cmd += [str(EXAMPLE / "run_clm.py"), "--model_name_or_path", str(self.init)]
        cmd += ["--tokenizer_name", str(EXAMPLE / "tokenizer"), "--block_size", "32"]
        cmd += ["--train_file", str(EXAMPLE / "data" / "train.txt"), "--do_train"]
        cmd += ["--gradient_accumulation_steps", "2", "--max_steps", str(STEPS)]
        cmd += ["--learning_rate", "1e-3", "--seed", "1", "--use_cpu", "--report_to", "none"]
        cmd += ["--logging_steps", "1", "--save_steps", "2", "--output_dir", str(out)]
        cmd += ["--per_device_train_batch_size", "4" if launcher is None else "2", *flags]
        if config is not None:
            cmd += ["--deepspeed", str(EXAMPLE / config)]
        run_script(name, cmd, self.where)
        self.done[name] = out
        return out


def losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def weights(out: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # what save_model wrote
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shim_python):
    return Runs(tmp_path_factory.mktemp("hf_trainer"), shim_python)


# (name, launcher, DeepSpeed config, extra flags, loss tolerance, weight tolerance): the
# module docstring justifies each tolerance.
CASES = [
    ("zero1-bf16", "torchrun", "ds_config_zero1.json", ("--bf16",), 2e-3, 1e-2),
    ("zero2", "accelerate launch", "ds_config_zero2.json", (), 1e-5, 1e-5),
    ("zero3", "shardwise run", "ds_config_zero3.json", (), 1e-5, 1e-5),
]


@pytest.mark.parametrize(("name", "launcher", "config", "flags", "tol", "wtol"), CASES)
def test_run_clm_with_deepspeed_equals_one_process(runs, name, launcher, config, flags, tol, wtol):
    if launcher == "accelerate launch":
        pytest.importorskip("accelerate")
    reference = runs.run("one-process", None, None)
    out = runs.run(name, launcher, config, *flags)
    case = f"{name} under {launcher}"
    # the checkpoint the Trainer wrote through engine.save_checkpoint is shardwise's
    assert (out / "checkpoint-2" / "global_step2" / "manifest.json").is_file(), case
    want, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), f"{case}: steps logged {sorted(got)}"
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= tol, f"{case}: losses {got} vs one process {want} (worst {worst:.2e})"
    ref_w, saved = weights(reference), weights(out)
    assert saved.keys() == ref_w.keys(), case
    if "--bf16" in flags:
        assert all(v.dtype == torch.bfloat16 for v in saved.values()), f"{case}: bf16 weights"
    worst = max((saved[k].float() - ref_w[k]).abs().max().item() for k in ref_w)
    assert worst <= wtol, f"{case}: saved weights differ from one process by {worst:.2e}"


def test_resume_from_checkpoint_repeats_the_uninterrupted_run(runs):
    straight = runs.run("zero3", "shardwise run", "ds_config_zero3.json")
    resumed = runs.run(
        "zero3-resumed",
        "shardwise run",
        "ds_config_zero3.json",
        "--resume_from_checkpoint",
        str(straight / "checkpoint-2"),
    )
    state = json.loads((resumed / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS, state["global_step"]
    assert losses(resumed) == losses(straight), "steps 3-4 after the resume"
    a, b = weights(straight), weights(resumed)
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"resumed weights differ from the uninterrupted run's: {unequal}"


# The shim's environment resolves what docs/deepspeed-compat.md says the hosts call: each
# `deepspeed.a.b` from the deepest module that imports, each `engine.x` on the engine class.
RESOLVE = """
import importlib, json, sys
import deepspeed
bad = [] if deepspeed.SHARDWISE_SHIM else ["deepspeed is not the shim"]
for dotted in json.loads(sys.argv[1]):
    parts = dotted.split(".")
    try:
        if parts[0] == "engine":
            getattr(deepspeed.DeepSpeedEngine, parts[1])
            continue
        for cut in range(len(parts), 0, -1):  # the deepest module that imports
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
        if module.startswith("deepspeed"):  # through the shim, every module is shardwise's
            bad.append(f"{dotted}: from {module}")
    except Exception as e:
        bad.append(f"{dotted}: {type(e).__name__}: {e}")
print(json.dumps(bad))
"""
HOSTS = ("| Accelerate |", "| transformers |", "| Trainer |")


def host_calls() -> list[str]:
    """The names docs/deepspeed-compat.md lists as called by the Trainer and Accelerate."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "deepspeed-compat.md"
    rows = [
        r for r in doc.read_text().splitlines() if r.startswith(HOSTS) and "| refused |" not in r
    ]
    names = {n for r in rows for n in re.findall(r"`((?:deepspeed|engine)(?:\.\w+)+)", r)}
    return sorted(names)


def test_every_call_the_hosts_make_resolves_through_the_shim(runs):
    names = host_calls()
    assert len(names) >= 20, f"the table of the hosts' calls lost its rows: {names}"
    env = {**os.environ, "PYTHONPATH": str(Path(shardwise.__file__).parents[1])}
    proc = subprocess.run(
        [runs.python, "-c", RESOLVE, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not bad, f"not answered by shardwise through the shim: {bad}"
