"""A plain Accelerate loop on shardwise through the ``deepspeed`` shim: examples/accelerate/train.py
(``Accelerator(deepspeed_plugin=...)``, ``prepare(model, optimizer, loader, scheduler)``,
``accelerator.backward``, ``optimizer.step()``, ``save_state``/``load_state``), the same script
in every run, only the launcher, the DeepSpeed config and the batch flags changing
(docs/accelerate.md).

The shim is pip-installed in a venv that sees this environment's packages behind it (the
``shim_python`` fixture, shim_env.py), so Accelerate's own availability check finds it. Each
case trains a small MLP (8 -> 32 -> 32 -> 4, tanh) for 6 AdamW steps of 8 samples with a
linear learning-rate decay and gradient clipping at 1.0, and is compared with the same script
in one process without DeepSpeed (4 samples x 2 accumulated micro-batches a step):

- ZeRO-2 under ``shardwise run``, the plugin built in the script
  (``DeepSpeedPlugin(hf_ds_config=...)``), 2 processes x 2 samples x 2 accumulated;
- ZeRO-3 under ``accelerate launch --use_deepspeed --deepspeed_config_file``, 2 processes x 4
  samples, saving with ``save_state`` at step 3; then resumed from it with ``load_state``.

On a machine without GPUs both need the script's ``--use_cpu`` (``PartialState(cpu=True)``
before the Accelerator, as the Trainer's ``--use_cpu`` does): without it Accelerate counts one
process on a CPU and fills ``train_batch_size`` for one.

Tolerances. Losses within 1e-5 of one process: two half-batch gradients averaged equal the
whole batch's up to float32 rounding (~1e-7), and the losses keep that (measured 1.2e-7 for
ZeRO-2, equal for ZeRO-3). Final parameters within 1e-5: Adam divides by sqrt(v), so an
element whose gradient nearly cancels moves by rounding noise times up to lr (1e-2) per step
(design.md); measured 3.4e-6 on one element of 1,476, the others within 1.2e-7. A resume
repeats the uninterrupted run's steps 4-6 bit for bit: the checkpoint holds weights and
Adam's moments (the engine's), the schedule and each rank's RNG (Accelerate's).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from shim_env import run_script

pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "accelerate"
STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(launcher: str | None, python: str, config: str | None) -> list[str]:
    """Everything before the script's own flags."""
    script = str(EXAMPLE / "train.py")
    if launcher is None:
        return [python, script]
    if launcher == "shardwise run":  # the script builds DeepSpeedPlugin(hf_ds_config=...)
        run = [python, "-m", "shardwise", "run", "--nproc-per-node", "2", script]
        return [*run, "--deepspeed", str(EXAMPLE / config)]
    assert launcher == "accelerate launch", launcher  # the launcher builds the plugin
    accelerate = [python, "-m", "accelerate.commands.launch", "--use_deepspeed"]
    accelerate += ["--num_processes", "2", "--num_machines", "1"]
    accelerate += ["--main_process_port", str(_free_port())]
    return [*accelerate, "--deepspeed_config_file", str(EXAMPLE / config), script]


class Runs:
    """Launches of train.py, each once per module, by name."""

    def __init__(self, where: Path, python: str) -> None:
        self.where, self.python = where, python
        self.done: dict[str, Path] = {}

    def run(self, name: str, launcher: str | None, config: str | None, *flags: str) -> Path:
        if name in self.done:
            return self.done[name]
        out = self.where / name
        cmd = _command(launcher, self.python, config)
        cmd += ["--use_cpu", "--max_steps", str(STEPS), "--output_dir", str(out), *flags]
        run_script(name, cmd, self.where)
        self.done[name] = out
        return out


def losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def weights(out: Path) -> dict[str, torch.Tensor]:
    """What ``accelerator.get_state_dict(model)`` gave, gathered under ZeRO-3."""
    return torch.load(out / "model.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shim_python):
    return Runs(tmp_path_factory.mktemp("accelerate"), shim_python)


ONE_PROCESS = ("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
# (name, launcher, DeepSpeed config, the script's batch flags and more)
CASES = [
    ("zero2", "shardwise run", "ds_config_zero2.json",
     ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")),
    ("zero3", "accelerate launch", "ds_config_zero3.json",
     ("--per_device_train_batch_size", "4", "--save_steps", "3")),
]  # fmt: skip


@pytest.mark.parametrize(("name", "launcher", "config", "flags"), CASES, ids=[c[0] for c in CASES])
def test_plain_loop_under_deepspeed_equals_one_process(runs, name, launcher, config, flags):
    reference = runs.run("one-process", None, None, *ONE_PROCESS)
    out = runs.run(name, launcher, config, *flags)
    case = f"{name} under {launcher}"
    want, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), f"{case}: steps logged {sorted(got)}"
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= 1e-5, f"{case}: losses {got} vs one process {want} (worst {worst:.2e})"
    ref_w, final = weights(reference), weights(out)
    assert final.keys() == ref_w.keys(), case
    worst = max((final[k] - ref_w[k]).abs().max().item() for k in ref_w)
    assert worst <= 1e-5, f"{case}: final parameters differ from one process by {worst:.2e}"


def test_load_state_repeats_the_uninterrupted_run(runs):
    _, launcher, config, flags = CASES[1]
    straight = runs.run("zero3", launcher, config, *flags)
    saved = straight / "checkpoint-3"
    # save_state went through engine.save_checkpoint(dir, "pytorch_model"): shardwise's format
    assert (saved / "pytorch_model" / "manifest.json").is_file(), sorted(saved.iterdir())
    resumed = runs.run(
        "zero3-resumed", launcher, config, *flags, "--resume_from_checkpoint", str(saved)
    )
    want = {s: v for s, v in losses(straight).items() if s > 3}
    assert losses(resumed) == want, "steps 4-6 after load_state"
    a, b = weights(straight), weights(resumed)
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"resumed parameters differ from the uninterrupted run's: {unequal}"
