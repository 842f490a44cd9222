"""DeepSpeed-style scripts of the kinds users bring, run by ``shardwise run`` on 2 processes
with only their import changed (tests/scripts/ds_*.py; the deeper names and a plain resume are
test_deepspeed_compat.py's, the tutorial loop over initialize's loader test_example_
deepspeed_compat.py's):

- ds_cifar.py, DeepSpeed's CIFAR tutorial: its ZeRO-2 + fp16 + CPU-offload config with fp16
  master weights, inputs cast with ``fp16_enabled()``, and DeepSpeed's monitors on (timers,
  memory, flops profile, comms summary, CSV events). It must learn (the loss falls, accuracy
  well above the 10% of chance) and each monitor must have spoken.
- ds_bert_mlm.py, a masked LM with dropout trained by ``train_batch()`` from initialize's
  loader: stopped at step 3 with a checkpoint and ``client_state``, resumed by a second launch,
  it prints the uninterrupted run's losses to the last digit (8 decimals: the checkpoint holds
  weights, Adam, the LR schedule, the data position and the RNG, so nothing may differ).
- ds_gan.py, two engines (DCGAN's pattern), under ZeRO-2 (where the generator's backward through
  the discriminator's engine once leaked into the discriminator's gradient shards): equal to its
  plain PyTorch twin (one process, the global batch) at every iteration within 1e-5 relative: the 2-rank gradient is the mean of two
  half-batch gradients, equal to the whole batch's up to float32 rounding (~1e-7), which
  8 Adam steps leave far below 1e-5.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def launch(script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2"]
    cmd += [str(SCRIPTS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(300), env=env, cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out.stdout + out.stderr


def test_the_cifar_tutorial_trains_with_fp16_masters_and_every_monitor_speaks(tmp_path):
    config = {
        "train_batch_size": 16,
        "steps_per_print": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 8}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2, "cpu_offload": True},
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 3, "detailed": False},
        "comms_logger": {"enabled": True},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "cifar"},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    out = launch("ds_cifar.py", "--deepspeed", "--deepspeed_config", str(path), "--epochs", "3")
    losses = [float(x) for x in re.findall(r"\] loss: ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], f"the loss must fall: {losses}"
    accuracy = int(re.search(r"on the 256 train images: (\d+) %", out).group(1))
    assert accuracy >= 50, f"{accuracy}% (chance: 10%)"
    assert "optimizer DeepSpeedCPUAdam global_steps 96" in out, out[-2000:]
    assert re.search(r"time \(ms\) \| fwd: [\d.]+ \| bwd: [\d.]+ .*\| step: [\d.]+", out), out
    assert "memory | params: " in out and "Profile Summary at step 3:" in out, out[-3000:]
    assert re.search(r"\nreduce_scatter\n +[\d.]+ \w?B +\d+ ", out), out[-2000:]
    assert (tmp_path / "cifar" / "Train_Samples_loss_scale.csv").exists()


def test_a_bert_style_mlm_resumes_from_its_checkpoint_exactly(tmp_path):
    steps = r"MLM step (\d) loss ([\d.]+) lr ([\d.]+)"
    straight = re.findall(steps, launch("ds_bert_mlm.py", "--save_dir", str(tmp_path)))
    resumed = re.findall(steps, launch("ds_bert_mlm.py", "--save_dir", str(tmp_path), "--resume"))
    assert [s for s, *_ in straight] == list("012345"), straight
    assert resumed == straight[3:], f"resumed {resumed} != {straight[3:]}"
    assert float(straight[-1][1]) < float(straight[0][1]), "it trains"


def test_a_two_engine_gan_equals_its_plain_pytorch_twin(monkeypatch):
    got = [
        json.loads(x)
        for x in re.findall(
            r"GAN (\[.*\])", launch("ds_gan.py", "--iterations", "8", "--zero_stage", "2")
        )
    ]
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import ds_gan

    twin = ds_gan.plain_twin(8)
    assert len(got) == 8, got
    for i, (mine, plain) in enumerate(zip(got, twin, strict=True)):
        assert mine == pytest.approx(list(plain), rel=1e-5), f"iteration {i}: {mine} vs {plain}"
