"""Checkpoint storage: what ranks save comes back exactly, atomically, checked, never unpickled.

The pieces are made by hand from the tensors of a small module (``Tiny``), split the ways the
layouts split them (see pieces.py): row boxes with padding (tensor parallelism of 5 rows in
2 x 3), flat ranges of a whole tensor (ZeRO), flat ranges of a padded box (both), a 0-dim bf16
buffer, a replicated tensor saved by one rank only. On one process every piece is saved by rank
0, on two each rank saves its own. Everything is compared bit for bit: storage adds no rounding.
"""

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import run_distributed
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from waits import scaled

from shardwise.checkpoint import reader as reader_module
from shardwise.checkpoint.export import assemble, export_consolidated
from shardwise.checkpoint.lock import LOCK
from shardwise.checkpoint.manifest import seal
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.storage import (
    CheckpointError,
    CheckpointReader,
    latest_tag,
    resolve,
    save_pieces,
)
from shardwise.launch.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
KILL_SCRIPT = REPO / "tests" / "scripts" / "ckpt_kill.py"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.emb = nn.Embedding(7, 4, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.tensor(0.75, dtype=torch.bfloat16))


def global_tensors() -> dict[str, torch.Tensor]:
    """Every saved name and its whole value (the model's, plus a master and an Adam moment)."""
    torch.manual_seed(0)
    model = {f"model/{k}": v.detach().clone() for k, v in Tiny().state_dict().items()}
    g = torch.Generator().manual_seed(1)
    return model | {
        "master/lin.weight": torch.randn(5, 6, generator=g),
        "master/emb.weight": torch.randn(7, 4, generator=g),
        "optim/exp_avg/lin.weight": torch.randn(5, 6, generator=g),
    }


def rank_pieces(rank: int) -> list[Piece]:
    """The pieces rank ``rank`` of 2 holds."""
    t = global_tensors()

    def padded(x, rows):  # x with zero rows appended up to ``rows`` (the padding of a split)
        return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])

    w, e, m = (
        padded(t["model/lin.weight"], 6),
        padded(t["model/emb.weight"], 8),
        t["master/lin.weight"],
    )
    rows, erows = (rank * 3, rank * 3 + 3), (rank * 4, rank * 4 + 4)
    e_box = e[erows[0] : erows[1]].reshape(-1)  # 16 elements, the last 4 padding on rank 1
    adam = padded(t["optim/exp_avg/lin.weight"], 6).reshape(-1)[rank * 18 : rank * 18 + 18]
    return [
        Piece("model/lin.weight", (5, 6), (rows, (0, 6)), None, w[rows[0] : rows[1]].clone()),
        Piece("model/lin.bias", (5,), ((0, 5),), None, t["model/lin.bias"], save=rank == 0),
        Piece("model/emb.weight", (7, 4), (erows, (0, 4)), (0, 10), e_box[:10].clone()),
        Piece("model/emb.weight", (7, 4), (erows, (0, 4)), (10, 16), e_box[10:].clone()),
        Piece("model/scale", (), (), None, t["model/scale"], save=rank == 1),
        Piece(
            "master/lin.weight",
            (5, 6),
            ((0, 5), (0, 6)),
            (rank * 15, rank * 15 + 15),
            m.reshape(-1)[rank * 15 : rank * 15 + 15].clone(),
        ),  # fmt: skip
        Piece(
            "master/emb.weight",
            (7, 4),
            (erows, (0, 4)),
            None,
            padded(t["master/emb.weight"], 8)[erows[0] : erows[1]].clone(),
        ),  # fmt: skip
        Piece(
            "optim/exp_avg/lin.weight", (5, 6), ((0, 6), (0, 6)), (rank * 18, rank * 18 + 18), adam
        ),
    ]


def rank_state(rank: int) -> dict:
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "loader": {"epoch": 1, "position": 17 + rank},
        "client": {
            "weights": torch.arange(3.0) * rank,
            3: (1.5, None, "x"),
            "half": np.float16(0.1),
        },
        "step": 10,
    }


def _save_rank(save_dir: str, tag: str, **kw) -> str:
    """On every rank of a 2-process world: save that rank's pieces and state."""
    from shardwise import comm

    rank = comm.get_rank()
    meta = {"step": 10, "layout": {"dp": 2}}
    return save_pieces(save_dir, tag, rank_pieces(rank), rank_state(rank), meta, **kw)


def save(save_dir: Path, world: int, tag: str = "global_step10", **kw) -> Path:
    if world == 1:  # no torch.distributed at all: every piece from rank 0
        pieces = [p for r in (0, 1) for p in rank_pieces(r) if p.save]
        return Path(save_pieces(str(save_dir), tag, pieces, rank_state(0), {"step": 10}, **kw))
    return Path(run_distributed(_save_rank, 2, str(save_dir), tag, **kw)[0])


def visible(save_dir: Path) -> list[str]:
    """The entries of ``save_dir`` a user sees (not the hidden lock and temporary names)."""
    return sorted(n for n in os.listdir(save_dir) if not n.startswith("."))


def assert_same(a, b, where):
    """Equal values and types, recursively; tensors and arrays bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory) -> Path:
    """A checkpoint saved by 2 ranks (tests copy it before damaging it)."""
    return save(tmp_path_factory.mktemp("two") / "ckpts", 2)


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("world", [1, 2])
def test_round_trip_is_exact(world, tmp_path, two_rank_ckpt):
    path = two_rank_ckpt if world == 2 else save(tmp_path, 1)
    assert latest_tag(str(path.parent)) == "global_step10", f"world {world}: latest"
    with CheckpointReader(str(path)) as r:
        assert r.world_size == world and r.meta["step"] == 10, f"world {world}: {r.manifest}"
        for name, value in global_tensors().items():
            assert_same(assemble(r, name), value, f"world {world}: {name}")
        for rank in range(world):
            assert_same(r.rank_state(rank), rank_state(rank), f"world {world}: rank_state({rank})")
        # Every file is a safetensors file the reference library reads as we do.
        for sp in (p for n in r.names() for p in r.pieces(n)):
            with safe_open(str(path / sp.file), "pt") as f:
                assert torch.equal(f.get_tensor(sp.key), r.read(sp)), f"world {world}: {sp}"


def test_padding_is_not_stored(two_rank_ckpt):
    with CheckpointReader(str(two_rank_ckpt)) as r:
        last = [p for p in r.pieces("model/lin.weight") if p.box[0][0] == 3]
        assert [p.box for p in last] == [((3, 5), (0, 6))], "box pieces are cropped to the tensor"
        assert r.read(last[0]).shape == (2, 6)


@pytest.mark.parametrize("verify", [True, False])
def test_slice_reads(verify, two_rank_ckpt, monkeypatch):
    ranges = []
    real = reader_module.read_range
    monkeypatch.setattr(reader_module, "read_range", lambda *a: ranges.append(a[2:4]) or real(*a))
    with CheckpointReader(str(two_rank_ckpt), verify=verify) as r:
        box = r.pieces("model/lin.weight")[0]
        whole = r.read(box)
        ranges.clear()
        assert torch.equal(r.read(box, (slice(1, 3), slice(2, 5))), whole[1:3, 2:5])
        (begin, end), = ranges  # fmt: skip
        # Once the piece is checked (verify) or never (verify=False), a slice reads its rows only.
        assert end - begin == 2 * 6 * 4, f"verify={verify}: read {end - begin} bytes"
        flat = r.pieces("master/lin.weight")[1]
        assert torch.equal(r.read(flat, slice(2, 7)), r.read(flat)[2:7])
        out = torch.empty(2, 6)
        assert r.read(box, (slice(0, 2),), out=out) is out and torch.equal(out, whole[:2])
        out = torch.empty(box.shape)  # straight from the file into it
        assert r.read(box, out=out) is out and torch.equal(out, whole)
        with pytest.raises(CheckpointError, match="step"):
            r.read(box, (slice(0, 3, 2),))
        with pytest.raises(CheckpointError, match="not in checkpoint"):
            r.pieces("model/missing")


def test_a_checked_slice_reads_and_checks_only_its_chunks(tmp_path, monkeypatch):
    # 4 MiB of float32 = 4 checksum chunks of 256 rows each.
    big = torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)
    path = Path(
        save_pieces(
            str(tmp_path),
            "t",
            [Piece("model/big", (1024, 1024), ((0, 1024), (0, 1024)), None, big)],
            {},
            {},
        )
    )
    _flip(
        path / "rank_00000.safetensors",
        _data_offset(path / "rank_00000.safetensors", "model/big") + 3 * 2**20 + 8,
    )
    ranges = []
    real = reader_module.read_range
    monkeypatch.setattr(
        reader_module, "read_range", lambda *a: ranges.append(a[3] - a[2]) or real(*a)
    )
    with CheckpointReader(str(path)) as r:
        (piece,) = r.pieces("model/big")
        assert torch.equal(r.read(piece, (slice(300, 310), slice(5, 9))), big[300:310, 5:9])
        assert ranges == [2**20], f"read {ranges} bytes for 10 rows inside one chunk"
        with pytest.raises(CheckpointError, match=r"model/big.*checksum mismatch in bytes 3145728"):
            r.read(piece, (slice(1000, 1001),))  # the damaged fourth chunk


# ----------------------------------------------------------------------------- atomicity


def _run_kill_script(tmp_path: Path, world: int, phase: str) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    args = [str(tmp_path / "ckpts"), str(tmp_path / "store"), "{rank}", str(world), phase]
    procs = [
        subprocess.Popen(
            [sys.executable, str(KILL_SCRIPT), *(a.format(rank=r) for a in args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    return [(p.wait(timeout=scaled(120)), p.stdout.read()) for p in procs]


@pytest.mark.parametrize("world,phase", [(2, "write"), (1, "publish")])
def test_killed_save_leaves_the_previous_checkpoint(world, phase, tmp_path):
    results = _run_kill_script(tmp_path, world, phase)
    dying = world - 1 if phase == "write" else 0
    assert results[dying][0] == 17, f"{phase}: the rank did not die where planned: {results}"
    assert all(rc != 0 for rc, _ in results), f"{phase}: a rank finished the save: {results}"
    save_dir = tmp_path / "ckpts"
    visible = sorted(n for n in os.listdir(save_dir) if not n.startswith("."))
    assert visible == ["latest", "step1"], f"{phase}: {visible}"
    assert latest_tag(str(save_dir)) == "step1"
    hidden = [n for n in os.listdir(save_dir) if n.startswith(".step2.tmp-")]
    assert hidden, f"{phase}: no trace of the interrupted save: the test killed nothing"
    with CheckpointReader(str(save_dir / "step1")) as r:
        r.verify_all()
        assert r.meta == {"step": 1} and r.read(r.pieces("model/b")[0])[3] == 3.0


def test_a_save_killed_while_overwriting_its_tag_loses_nothing(tmp_path):
    results = _run_kill_script(tmp_path, 1, "overwrite")
    assert results[0][0] == 17, f"the rank did not die between the renames: {results}"
    save_dir = tmp_path / "ckpts"
    assert not (save_dir / "step1").exists(), "the kill came too late: nothing to recover"
    assert [n for n in os.listdir(save_dir) if n.startswith(".step1.old-")], sorted(
        os.listdir(save_dir)
    )
    # Loading the tag (here through ``latest``) puts the previous step1 back, whole.
    with CheckpointReader(resolve(str(save_dir))) as r:
        r.verify_all()
        assert r.meta == {"step": 1}, "not the checkpoint that was complete"
    assert sorted(n for n in os.listdir(save_dir) if not n.startswith(".")) == ["latest", "step1"]


def test_the_next_save_restores_a_tag_an_interrupted_overwrite_moved_aside(tmp_path):
    w = [Piece("model/w", (3,), ((0, 3),), None, torch.ones(3))]
    save_pieces(str(tmp_path), "a", w, {}, {"step": 1})
    os.rename(tmp_path / "a", tmp_path / ".a.old-123")  # as a kill between the renames leaves it
    save_pieces(str(tmp_path), "b", w, {}, {"step": 2})
    assert visible(tmp_path) == ["a", "b", "latest"], "the old 'a' was deleted"
    with CheckpointReader(str(tmp_path / "a")) as r:
        assert r.meta == {"step": 1}


def _save_with_a_bad_rank(save_dir: str) -> str:
    from shardwise import comm

    rank = comm.get_rank()
    bad = torch.zeros(2, dtype=torch.complex64 if rank == 1 else torch.float32)
    try:
        save_pieces(save_dir, "bad", [Piece("model/x", (2,), ((0, 2),), None, bad)], {}, {})
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_rank_that_fails_fails_the_save_on_every_rank(tmp_path):
    messages = run_distributed(_save_with_a_bad_rank, 2, str(tmp_path))
    for rank, m in enumerate(messages):
        assert "rank 1" in m and "complex64" in m, f"rank {rank} got: {m}"
    assert os.listdir(tmp_path) == [LOCK], "a failed save leaves nothing but the job's lock"


def test_overwriting_a_tag_and_rotation(tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    for step in range(1, 6):
        t = torch.full((3,), float(step))
        piece = Piece("model/w", (3,), ((0, 3),), None, t)
        save_pieces(str(tmp_path), f"s{step}", [piece], {}, {}, keep_last=2, step=step)
    save_pieces(
        str(tmp_path), "s5", [Piece("model/w", (3,), ((0, 3),), None, torch.ones(3))], {}, {}
    )
    assert visible(tmp_path) == ["latest", "notes", "s4", "s5"]
    with CheckpointReader(str(tmp_path / "s5")) as r:
        assert torch.equal(r.read(r.pieces("model/w")[0]), torch.ones(3)), "tag overwritten"
    for bad in ("../x", ".hidden", "latest", "a/b", ""):
        with pytest.raises(CheckpointError, match="tag"):
            save_pieces(str(tmp_path), bad, [], {}, {})
    with pytest.raises(CheckpointError, match=r"rank_state\['x'\]"):
        save_pieces(str(tmp_path), "s6", [], {"x": object()}, {})


# ----------------------------------------------------------------------------- integrity


def _damaged(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _data_offset(path: Path, key: str) -> int:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_truncated_missing_and_corrupted_files_are_named(two_rank_ckpt, tmp_path):
    ckpt = _damaged(two_rank_ckpt, tmp_path)
    rank1 = ckpt / "rank_00001.safetensors"
    good = rank1.read_bytes()

    rank1.write_bytes(good[:-10])
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors has \d+ bytes.*truncated"):
        CheckpointReader(str(ckpt))

    rank1.unlink()
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors is missing.*rank 1"):
        CheckpointReader(str(ckpt))

    rank1.write_bytes(good)
    at = good.index(b"position")
    _flip(rank1, next(i for i in range(at, at + 20) if good[i : i + 1].isdigit()))  # 18 -> 19
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors: header checksum"):
        CheckpointReader(str(ckpt))

    rank1.write_bytes(good)
    _flip(rank1, _data_offset(rank1, "master/lin.weight") + 5)  # inside one tensor's bytes
    with CheckpointReader(str(ckpt)) as r:
        with pytest.raises(
            CheckpointError, match=r"rank_00001\.safetensors tensor 'master/lin.weight': checksum"
        ):
            assemble(r, "master/lin.weight")
        assemble(r, "model/lin.weight")  # the other tensors still read
    with pytest.raises(CheckpointError, match="master/lin.weight"):
        CheckpointReader(str(ckpt)).verify_all()

    (ckpt / "manifest.json").write_text('{"format": "shardwise.checkpoint", "version"')
    with pytest.raises(CheckpointError, match=r"manifest\.json is not JSON"):
        CheckpointReader(str(ckpt))


def test_a_manifest_cannot_point_outside_the_checkpoint(two_rank_ckpt, tmp_path):
    ckpt = _damaged(two_rank_ckpt, tmp_path)
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["../../../etc/passwd"] = m["files"].pop("rank_00001.safetensors")
    (ckpt / "manifest.json").write_text(json.dumps(seal(m)))  # a consistent forgery
    with pytest.raises(CheckpointError, match="malformed manifest.*rank_NNNNN"):
        CheckpointReader(str(ckpt))


class Payload:
    """Unpickling this creates ``marker``: the proof that a loader ran attacker code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_is_never_run(two_rank_ckpt, tmp_path):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(probe)))
    assert probe.exists(), "the payload must work when unpickled, or this test proves nothing"

    marker = tmp_path / "pwned"
    ckpt = _damaged(two_rank_ckpt, tmp_path)
    rank1 = ckpt / "rank_00001.safetensors"
    torch.save(
        {"model/lin.weight": Payload(marker)}, rank1
    )  # a torch.save zip where we expect safetensors
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["rank_00001.safetensors"]["size"] = rank1.stat().st_size  # a consistent forgery
    (ckpt / "manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors: .*not a safetensors file"):
        CheckpointReader(str(ckpt))

    (ckpt / "manifest.json").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"manifest\.json is not JSON"):
        CheckpointReader(str(ckpt))
    with pytest.raises(CheckpointError):
        export_consolidated(str(ckpt), str(tmp_path / "out.safetensors"))
    assert not marker.exists(), "loading a checkpoint ran code from it"


# ----------------------------------------------------------------------------- export


def test_export_and_inspect_cli(two_rank_ckpt, tmp_path, capsys):
    save_dir = str(two_rank_ckpt.parent)
    expected = global_tensors()
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", save_dir, str(out)]) == 0
    weights = load_file(str(out))
    model = Tiny()
    model.load_state_dict(weights, strict=True)  # the user's own module, no shardwise
    for name, value in model.state_dict().items():
        assert_same(value, expected[f"model/{name}"], f"export: {name}")

    assert cli_main(["export", save_dir, str(out), "--fp32", "--tag", "global_step10"]) == 0
    weights = load_file(str(out))
    assert_same(weights["emb.weight"], expected["master/emb.weight"], "export --fp32: master")
    assert_same(weights["scale"], expected["model/scale"].float(), "export --fp32: no master")

    capsys.readouterr()
    assert cli_main(["inspect", save_dir, "--verify"]) == 0
    text = capsys.readouterr().out
    for needle in ("tag global_step10", "by 2 ranks", "step: 10", "rank_00001.safetensors",
                   "model/emb.weight", "bfloat16", "7x4", "every checksum matches"):  # fmt: skip
        assert needle in text, f"inspect lacks {needle!r}:\n{text}"
    assert cli_main(["inspect", str(tmp_path)]) == 2, "no checkpoint: an error, not a traceback"
    assert "no manifest.json" in capsys.readouterr().err
