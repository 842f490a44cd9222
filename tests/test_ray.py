"""Ray Train on shardwise (integrations/ray): a regression (tests/scripts/ray_loop.py: MLP, SGD
with momentum, a StepLR, 6 steps of a global batch of 8) trained by ``TorchTrainer`` on 2
workers with a ZeRO-3 engine equals the same model trained by plain torch on 1 worker of the
same Ray cluster; the step-3 checkpoint of the 2-worker run, resumed on 1 worker under ZeRO-1,
continues like the uninterrupted run.

Tolerance 1e-5 on every step's loss and every final parameter (fp32: the runs differ by the
order of one all-reduce's additions, about 1e-7; a missed reduction, a wrong scale, a lost
momentum buffer or scheduler step is >= 1e-3 off). SGD, not Adam, so that rounding noise is
not amplified (docs design notes).

One local Ray cluster for the module (2 CPUs, a small object store, its files under the test's
temporary directory), shut down even when a test fails; two fits, since each starts a worker
group of fresh processes (about 10 s each on a quiet 2-core machine).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install shardwise[ray])")

import ray  # noqa: E402 - after the skip
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
# tests/scripts/ray_loop.py as the module ``ray_loop``, without tests/scripts on sys.path
_spec = importlib.util.spec_from_file_location("ray_loop", SCRIPTS / "ray_loop.py")
ray_loop = sys.modules["ray_loop"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ray_loop)

TOL = 1e-5  # module docstring
SAVE_AT = 3
ZERO3 = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
ZERO1 = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
# Ray Train's extras a test does not need: each is another process per fit.
QUIET_RAY = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # a finished loop is noticed sooner
    "RAY_USAGE_STATS_ENABLED": "0",
    # Token authentication as by default (ray.init turns it on), with the token in the
    # environment instead of a new ~/.ray/auth_token.
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}
SOCKET_ROOM = 107 - 62  # a unix socket path <= 107 bytes; Ray adds <= 62 under its temp dir


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster; yields the directory its runs store checkpoints in."""
    temp = tmp_path_factory.mktemp("ray")
    short = len(str(temp)) > SOCKET_ROOM  # a deep --basetemp: Ray's sockets would not fit
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp")) if short else temp
    ray.cloudpickle.register_pickle_by_value(ray_loop)  # workers do not see tests/scripts
    with pytest.MonkeyPatch.context() as env:
        for name, value in QUIET_RAY.items():
            env.setenv(name, value)
        env.delenv("RAY_AUTH_MODE", raising=False)  # ray.init sets it; restored after
        env.setenv("OMP_NUM_THREADS", "1")  # one thread per rank: repeatable to the bit
        try:
            _start_ray(temp / "t")
            yield tmp_path_factory.mktemp("ray-storage")
        finally:
            ray.shutdown()
            ray.cloudpickle.unregister_pickle_by_value(ray_loop)
            if short:
                shutil.rmtree(temp, ignore_errors=True)


def _start_ray(temp: Path, attempts: int = 3) -> None:
    """``ray.init``; again when its raylet did not register within Ray's fixed 30 s (seen
    at a load average of 110 on 2 cores: a loaded machine, not a failure of this test)."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=2,
                object_store_memory=100 * 2**20,
                _temp_dir=str(temp),
                include_dashboard=False,
            )
            return
        except Exception as e:
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise


def _fit(storage: Path, name: str, workers: int, runs: list):
    trainer = TorchTrainer(
        ray_loop.train_loop,
        train_loop_config={"runs": runs},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=name, storage_path=str(storage)),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def two_workers(cluster):
    """ZeRO-3 on 2 workers, 6 steps, a checkpoint at step 3: (its record, Ray's result)."""
    out = cluster / "two.pt"
    run = {"kind": "shardwise", "out": str(out), "config": ZERO3, "save_at": SAVE_AT}
    result = _fit(cluster, "two-workers", 2, [run])
    return torch.load(out), result


@pytest.fixture(scope="module")
def one_worker(cluster, two_workers):
    """On 1 worker: plain torch (the reference), then ZeRO-1 resumed from the 2-worker run's
    step-3 checkpoint. One fit for both: each fit costs a new worker group."""
    plain, resumed = cluster / "plain.pt", cluster / "resumed.pt"
    saved = two_workers[1].checkpoint.path  # the latest it reported: step 3's
    runs = [
        {"kind": "plain", "out": str(plain)},
        {"kind": "shardwise", "out": str(resumed), "config": ZERO1, "resume_from": saved},
    ]
    result = _fit(cluster, "one-worker", 1, runs)
    return torch.load(plain), torch.load(resumed), result


def _assert_same(got: dict, ref: dict, case: str) -> None:
    steps = sorted(got["losses"])
    diff = max(abs(got["losses"][s] - ref["losses"][s]) for s in steps)
    assert diff < TOL, f"{case}: losses {got['losses']} vs plain torch {ref['losses']}"
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=TOL, msg=case)


def test_two_workers_train_like_plain_torch_on_one(two_workers, one_worker):
    (got, result), (plain, _, _) = two_workers, one_worker
    case = "zero3 x 2 workers"
    assert got["seen"]["ray_group_reused"], f"{case}: initialize made its own world"
    assert got["seen"]["world"] == 2, f"{case}: {got['seen']}"
    assert sorted(got["losses"]) == list(range(1, 7)), f"{case}: steps {sorted(got['losses'])}"
    _assert_same(got, plain, case)
    # Ray Train 2 keeps the metrics reported with a checkpoint: rank 0's, at step 3
    kept = {"loss": got["losses"][SAVE_AT], "step": SAVE_AT}
    assert result.metrics == kept, f"{case}: Ray kept {result.metrics}, not {kept}"


def test_resume_at_one_worker_from_a_two_worker_checkpoint_is_exact(two_workers, one_worker):
    (_, saved), (plain, got, _) = two_workers, one_worker
    case = "zero3 x 2 -> zero1 x 1"
    with saved.checkpoint.as_directory() as path:
        files = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
    tag = f"global_step{SAVE_AT}"
    expected = [f"{tag}/manifest.json", f"{tag}/rank_00000.safetensors",
                f"{tag}/rank_00001.safetensors", "latest"]  # fmt: skip
    assert files == expected, f"{case}: the Ray checkpoint holds {files}"
    assert got["seen"]["resumed"] == {"step": SAVE_AT}, f"{case}: client state {got['seen']}"
    assert sorted(got["losses"]) == [4, 5, 6], f"{case}: steps {sorted(got['losses'])}"
    _assert_same(got, plain, case)


# What each rank uploads from a staged save (no process, no cluster): the file it wrote; rank
# 0 also the manifest and `latest`; a rank that wrote nothing reports no checkpoint.
STAGED = ["latest", "global_step3/manifest.json", "global_step3/rank_00000.safetensors",
          "global_step3/rank_00001.safetensors", ".shardwise-lock"]  # fmt: skip
UPLOADS = {
    0: ["global_step3/manifest.json", "global_step3/rank_00000.safetensors", "latest"],
    1: ["global_step3/rank_00001.safetensors"],
    2: None,
}


@pytest.mark.parametrize("rank", list(UPLOADS))
def test_each_rank_uploads_the_part_it_wrote(tmp_path, rank):
    from shardwise.integrations.ray import staging

    stage = staging.make_stage(str(tmp_path))
    assert Path(stage).parent == tmp_path and os.listdir(stage) == [], f"rank {rank}: {stage}"
    for rel in STAGED:
        (Path(stage) / rel).parent.mkdir(parents=True, exist_ok=True)
        (Path(stage) / rel).write_text("global_step3" if rel == "latest" else rel)
    view = staging.upload_view(stage, rank)
    got = None if view is None else sorted(
        str(p.relative_to(view)) for p in Path(view).rglob("*") if p.is_file()
    )  # fmt: skip
    assert got == UPLOADS[rank], f"rank {rank} uploads {got}"
    staging.remove_stage(stage)
    assert not Path(stage).exists(), f"rank {rank}: the stage is left behind"
