"""The config's ``checkpoint`` block, through the engine: rotation (``keep_last``) and
DeepSpeed's ``tag_validation`` (ranks passing different tags). Parsing of the block's other
keys is in test_config.py."""

import json
import logging
import os

import pytest
from checkpointing import config, engine_for, load, save
from harness import run_distributed

from shardwise.checkpoint.manifest import CheckpointError


@pytest.mark.parametrize("keep_last", [None, 2])
def test_keep_last_from_the_config_rotates_checkpoints(keep_last, tmp_path):
    cfg = config(checkpoint={"keep_last": keep_last})
    engine = engine_for(cfg, 0.0, seed=0)
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    for _ in range(4):
        engine.train_batch()
        save(engine, str(tmp_path))
    steps = [1, 2, 3, 4] if keep_last is None else [3, 4]  # None keeps everything (DeepSpeed)
    want = {"latest", "notes"} | {f"global_step{s}" for s in steps}
    visible = {n for n in os.listdir(tmp_path) if not n.startswith(".")}  # not the lock
    assert visible == want, f"keep_last={keep_last}"
    fresh = engine_for(cfg, 0.0, seed=99)
    path, _ = load(fresh, str(tmp_path))
    assert path.endswith("global_step4") and fresh.global_steps == 4, f"keep_last={keep_last}"


def _save_with_rank_tags(path: str, mode: str) -> dict:
    """Every rank saves with its own tag ("t<rank>"); the outcome, the warnings, and what a
    load finds (the checkpoint must be whole: every rank's file under one tag)."""
    engine = engine_for(config(checkpoint={"tag_validation": mode}), 0.0, seed=0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise").addHandler(handler)
    try:
        save(engine, path, tag=f"t{engine.global_rank}")
        error, loaded = None, load(engine_for(config(), 0.0, seed=99), path)[0]
    except CheckpointError as e:
        error, loaded = str(e), None
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    warned = [r.getMessage() for r in records if "different checkpoint tags" in r.getMessage()]
    return {"error": error, "warned": warned, "loaded": loaded}


@pytest.mark.parametrize("mode", ["Warn", "Ignore", "Fail"])
def test_tag_validation_when_ranks_pass_different_tags(mode, tmp_path):
    results = run_distributed(_save_with_rank_tags, 2, str(tmp_path), mode)
    for rank, r in enumerate(results):
        tag = f"tag_validation={mode} rank {rank}"
        if mode == "Fail":
            assert r["error"] and "rank 0 't0', rank 1 't1'" in r["error"], f"{tag}: {r}"
        else:
            assert r["error"] is None, f"{tag}: {r['error']}"
            assert r["loaded"].endswith("t0"), f"{tag}: saved under rank 0's tag"
        warns = mode == "Warn" and rank == 0  # rank 0 logs it once
        assert bool(r["warned"]) == warns, f"{tag}: warnings {r['warned']}"
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))  # not the lock
    assert left == ([] if mode == "Fail" else ["latest", "t0"]), f"tag_validation={mode}: {left}"


@pytest.mark.parametrize("verify", [True, False])
def test_verify_decides_whether_a_flipped_byte_is_caught(verify, tmp_path):
    engine = engine_for(config(), 0.0, seed=0)
    engine.train_batch()
    save(engine, str(tmp_path))
    rank_file = tmp_path / "global_step1" / "rank_00000.safetensors"
    raw = bytearray(rank_file.read_bytes())
    n = int.from_bytes(raw[:8], "little")  # safetensors: header length, JSON header, data
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k.startswith("model/"))
    raw[8 + n + header[key]["data_offsets"][0]] ^= 0x01  # a weight's byte: only a checksum sees it
    rank_file.write_bytes(bytes(raw))
    fresh = engine_for(config(checkpoint={"verify": verify}), 0.0, seed=99)
    if verify:
        with pytest.raises(CheckpointError, match="rank_00000.safetensors"):
            load(fresh, str(tmp_path))
    else:  # the documented trade-off: sizes and headers only
        path, _ = load(fresh, str(tmp_path))
        assert path.endswith("global_step1"), "verify=false must still load"


def _save_to_rank_dirs(root: str) -> str | None:
    """Every rank saves into its own directory, as a script naming it from each rank's clock."""
    engine = engine_for(config(), 0.0, seed=0)
    try:
        save(engine, os.path.join(root, f"run-{engine.global_rank}"))
    except CheckpointError as e:
        return str(e)
    return None


def test_ranks_passing_different_save_dirs_fail_the_save_naming_both(tmp_path):
    errors = run_distributed(_save_to_rank_dirs, 2, str(tmp_path))
    for rank, error in enumerate(errors):
        assert error and "different save_dir" in error, f"rank {rank}: {error}"
        assert "run-0" in error and "run-1" in error, f"rank {rank} names both: {error}"
    for rank in range(2):
        left = os.listdir(tmp_path / f"run-{rank}") if (tmp_path / f"run-{rank}").exists() else []
        assert "latest" not in left, f"rank {rank}'s directory claims a checkpoint: {left}"
