"""The manifest is checked like the data, and a load is all or nothing.

- The manifest carries its own checksum: an edited or corrupted manifest is refused by
  ``load_checkpoint``, ``shardwise inspect --verify`` and ``shardwise export``.
- Its shapes and boxes must agree when it is parsed: a ``global_shape`` larger than its pieces
  (export used to allocate it first, 20 GB for one forged tensor) or a box outside its tensor
  is refused before anything is allocated.
- A load checks everything (manifest, files, every tensor it will fill, meta, rank states,
  checksums) before it changes the engine, and on every rank or none: a damaged checkpoint
  leaves each rank's weights, optimizer state, schedule, counters and random state exactly as
  they were (a removed ``meta.counters`` used to fail with a KeyError after the weights and
  optimizer had been overwritten).

Damaged copies of one checkpoint (ZeRO-1 on 2 ranks, after 2 steps) are loaded by a 2-rank
world whose engines have trained a step of their own; "forged" manifests are resealed, so that
only the check under test can catch them.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpointing import config, engine_for, load, save
from harness import run_distributed

from shardwise.checkpoint import export as export_module
from shardwise.checkpoint.export import export_consolidated
from shardwise.checkpoint.manifest import CheckpointError, seal
from shardwise.checkpoint.storage import CheckpointReader
from shardwise.launch.cli import main as cli_main

CFG = config(zero_optimization={"stage": 1})


def _save(path: str) -> None:
    engine = engine_for(CFG, 0.0, seed=0)
    for _ in range(2):
        engine.train_batch()
    save(engine, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The save directory of a ZeRO-1 run on 2 ranks, 2 steps (copied before damage)."""
    path = tmp_path_factory.mktemp("zero1") / "ckpts"
    run_distributed(_save, 2, str(path))
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpts"
    shutil.copytree(saved, dst, ignore=shutil.ignore_patterns(".*"))  # not the job's lock
    return dst


def _edit(save_dir: Path, change, reseal: bool = True) -> None:
    path = save_dir / "global_step2" / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(seal(m) if reseal else m))


def _flip_in(save_dir: Path, rank: int, prefix: str) -> None:
    """Flip one bit inside the first stored tensor named ``prefix``... of ``rank``'s file."""
    path = save_dir / "global_step2" / f"rank_{rank:05d}.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k.startswith(prefix))
    raw[8 + n + header[key]["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(raw))


def _inflate(m: dict) -> None:
    m["tensors"]["model/fc1.weight"]["global_shape"] = [100000, 50000]  # 20 GB of float32


def _box_outside(m: dict) -> None:
    m["tensors"]["model/fc1.bias"]["pieces"][0]["box"] = [[0, 33]]


DAMAGE = {  # name: (damage, what the error says, or per rank); every rank is left as it was
    "intact": (lambda d: None, None),
    "meta.counters removed": (
        lambda d: _edit(d, lambda m: m["meta"].pop("counters")),
        "meta.counters",
    ),
    "manifest edited": (
        lambda d: _edit(d, lambda m: m["meta"]["counters"].update(global_steps=7), reseal=False),
        "manifest checksum mismatch",
    ),
    "global_shape inflated": (lambda d: _edit(d, _inflate), r"global_shape \[100000, 50000\]"),
    "box outside the tensor": (lambda d: _edit(d, _box_outside), "exceeds global_shape"),
    "an optimizer state left out": (
        lambda d: _edit(d, lambda m: m["tensors"].pop("optim/exp_avg/fc2.weight")),
        "no tensor 'optim/exp_avg/fc2.weight'",
    ),
    # a bit of rank 1's Adam moments: only rank 1 reads them, every rank must refuse
    "rank 1's optimizer state corrupted": (
        lambda d: _flip_in(d, 1, "optim/exp_avg"),
        [  # per rank
            r"rank 1 cannot load the checkpoint, so no rank does: .*checksum mismatch",
            r"rank_00001.safetensors tensor 'optim/exp_avg/.*checksum mismatch",
        ],
    ),
    "loss scaler damaged": (
        lambda d: _edit(d, lambda m: m["meta"].update(loss_scaler={"scale": 1.0})),
        "meta.loss_scaler",
    ),
}


def _snapshot(engine) -> dict:
    return {
        "params": {k: v.clone() for k, v in engine.consolidated_state_dict().items()},
        "optim": {
            (id(p), k): v.clone()
            for p, state in engine.optimizer.state.items()
            for k, v in state.items()
        },
        "lr": engine.get_lr(),
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps),
        "rng": torch.get_rng_state(),
        "data": engine.training_dataloader.state_dict(),
    }


def _changes(a: dict, b: dict) -> list[str]:
    out = [k for k in ("lr", "counters", "data") if a[k] != b[k]]
    out += [f"param {k}" for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    if a["optim"].keys() != b["optim"].keys() or any(
        not torch.equal(v, b["optim"][k]) for k, v in a["optim"].items()
    ):
        out.append("optimizer state")
    return out + (["rng"] if not torch.equal(a["rng"], b["rng"]) else [])


def _load_damaged(path: str) -> dict:
    engine = engine_for(CFG, 0.0, seed=99)
    engine.train_batch()  # a state of its own: weights, Adam moments, schedule, counters
    before = _snapshot(engine)
    try:
        load(engine, path)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "changed": _changes(before, _snapshot(engine))}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_checkpoint_changes_nothing_on_any_rank(name, saved, tmp_path):
    damage, expected = DAMAGE[name]
    save_dir = _copy(saved, tmp_path)
    damage(save_dir)
    for rank, r in enumerate(run_distributed(_load_damaged, 2, str(save_dir))):
        tag = f"{name}, rank {rank}"
        if expected is None:  # the control: an intact checkpoint loads, and changes it all
            assert r["error"] is None, f"{tag}: {r['error']}"
            assert {"lr", "counters", "optimizer state", "rng"} <= set(r["changed"]), tag
            continue
        assert r["error"] is not None, f"{tag}: loaded"
        want = expected[rank] if isinstance(expected, list) else expected
        assert re.search(want, r["error"]), f"{tag}: {r['error']}"
        assert r["changed"] == [], f"{tag}: the failed load changed {r['changed']}"


def test_the_cli_checks_the_manifest_checksum(saved, tmp_path, capsys):
    save_dir = _copy(saved, tmp_path)
    assert cli_main(["inspect", str(save_dir), "--verify"]) == 0, "intact: no error"
    assert "step 2," in capsys.readouterr().out
    _edit(save_dir, lambda m: m["meta"]["counters"].update(global_steps=7), reseal=False)
    out = tmp_path / "model.safetensors"
    for argv in (["inspect", str(save_dir), "--verify"], ["export", str(save_dir), str(out)]):
        assert cli_main(argv) == 2, argv
        assert "manifest checksum mismatch" in capsys.readouterr().err, argv
    assert not out.exists()


def test_export_refuses_an_inflated_shape_before_allocating_it(saved, tmp_path, monkeypatch):
    save_dir = _copy(saved, tmp_path)
    _edit(save_dir, _inflate)

    def allocating(*args):
        raise AssertionError("export assembled (allocated) a tensor of the forged shape")

    monkeypatch.setattr(export_module, "assemble", allocating)
    with pytest.raises(CheckpointError, match=r"fc1.weight.*5000000000 elements, its pieces"):
        export_consolidated(str(save_dir), str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("tag", ["../x", "../ckpts/global_step2", "/etc", "latest"])
def test_an_explicit_tag_is_checked_like_latest(saved, tmp_path, tag, capsys):
    save_dir = _copy(saved, tmp_path)
    for argv in (["inspect", str(save_dir), "--tag", tag],
                 ["export", str(save_dir), str(tmp_path / "m.safetensors"), "--tag", tag]):  # fmt: skip
        assert cli_main(argv) == 2, argv
        assert f"tag {tag!r}" in capsys.readouterr().err, argv
    engine = engine_for(CFG, 0.0, seed=99)
    with pytest.raises(CheckpointError, match="tag"):
        load(engine, str(save_dir), tag=tag)


def test_a_version_1_manifest_still_loads(saved, tmp_path):
    """Written before the manifest had a checksum and a step: read without them."""
    save_dir = _copy(saved, tmp_path)

    def as_version_1(m: dict) -> None:
        del m["step"]
        m["version"] = 1

    _edit(save_dir, as_version_1, reseal=False)
    path = save_dir / "global_step2" / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "manifest_crc32"}))  # fmt: skip
    with CheckpointReader(str(save_dir / "global_step2")) as r:
        r.verify_all()
        assert r.manifest["step"] is None
    engine = engine_for(CFG, 0.0, seed=99)
    assert load(engine, str(save_dir))[0].endswith("global_step2")
    assert engine.global_steps == 2
