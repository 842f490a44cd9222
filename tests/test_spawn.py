"""``shardwise.spawn``: N processes with the world already set up, results back in rank order."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from waits import scaled

import shardwise
from shardwise.spawn import SpawnedJob, SpawnError, spawn


def _all_reduce_and_report(rank, scale):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "sum": int(total.item()) * scale,
        "world": dist.get_world_size(),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "detected": shardwise.init_distributed().rank,  # idempotent: the spawned world itself
    }


def _fail_on_rank_one(rank):
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that is gone: spawn must not hang on it


def _sleep(rank):
    time.sleep(120)


def test_spawn_returns_each_ranks_value_in_rank_order():
    job = spawn(_all_reduce_and_report, 2, args=(10,), join=False)
    assert isinstance(job, SpawnedJob) and len(job.pids) == 2
    results = job.join(timeout=scaled(120))
    assert [r["rank"] for r in results] == [0, 1], "rank order"
    for rank, r in enumerate(results):
        assert r["sum"] == 30 and r["world"] == 2, f"rank {rank}: 1 + 2 all-reduced, times 10"
        assert r["env"] == (str(rank), "2", str(rank)), f"rank {rank}: torchrun's variables"
        assert r["detected"] == rank, f"rank {rank}: init_distributed sees the spawned world"


def test_a_failing_rank_is_reraised_with_its_rank_and_traceback():
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_one, 2, timeout=scaled(120))
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed"), message
    assert "KeyError: 'rank one is broken'" in message and "_fail_on_rank_one" in message, message


def test_the_rank_that_failed_for_its_own_reason_is_named(tmp_path):
    # Which dead rank torch's join reports first is up to the OS; when it is a rank whose
    # collective only lost its peer, the report must name the peer that raised by itself.
    import pickle
    from types import SimpleNamespace

    from shardwise.spawn import SpawnedJob

    files = [tmp_path / "rank0.pickle", tmp_path / "rank1.pickle"]
    lost = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"
    files[0].write_bytes(pickle.dumps(lost))
    files[1].write_bytes(pickle.dumps("KeyError: 'rank one is broken'"))
    context = SimpleNamespace(error_files=[str(f) for f in files])
    job = SpawnedJob(context, results=None, nprocs=2, tmpdir=str(tmp_path))
    assert job._root_cause(0, lost) == (1, "KeyError: 'rank one is broken'")
    assert job._root_cause(1, "KeyError: x") == (1, "KeyError: x"), "a real cause is kept"


def test_a_hung_job_times_out_naming_the_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 3"):
        spawn(_sleep, 2, timeout=3)
    assert time.monotonic() - start < scaled(60), "terminated promptly"


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, True])
def test_nprocs_must_be_a_positive_integer(nprocs):
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_sleep, nprocs)


def test_shardwise_spawn_stays_the_function_once_the_module_is_imported():
    # Importing the submodule shardwise.spawn sets the package attribute ``spawn`` to the
    # module, unless shardwise/__init__.py binds the function after importing it eagerly
    # (``from shardwise.spawn import spawn``); a lazy wrapper loses to the module.
    assert shardwise.spawn is spawn, f"shardwise.spawn is {shardwise.spawn!r}, not the function"
