"""DeepSpeed's ``wandb`` and ``comet`` monitors, through the real packages in offline mode.

Each run trains three steps on two ranks and the run files the package wrote are read back:
Weights & Biases' transaction log (``wandb/offline-run-*/run-*.wandb``, LevelDB-style records
of wandb's protobuf ``Record``) and Comet's offline archive (``messages.json`` in a zip). Both
must hold DeepSpeed's events with the values the engine reports, at steps = samples trained,
written by rank 0 alone; Comet's at most once per ``samples_log_interval`` samples. A test
skips only when its package is not installed (``pip install shardwise[wandb]`` / ``[comet]``);
without the package, enabling the block is an ImportError naming the extra, whatever is
installed (the import is made to fail).
"""

import glob
import json
import os
import sys
import time
import zipfile

import pytest
import torch.nn.functional as F
from harness import run_distributed
from models import make_data, make_model
from waits import scaled

import shardwise

MB = 2  # x 2 ranks: 4 samples per step


def _train(blocks: dict, env: dict) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "SGD"}, **blocks}
        config["optimizer"]["params"] = {"lr": 0.1}
        engine, *_ = shardwise.initialize(model=make_model(), config=config)
        x, y = make_data(64)
        losses = []
        for step in range(3):
            rows = slice(
                (2 * step + engine.global_rank) * MB, (2 * step + engine.global_rank + 1) * MB
            )
            loss = F.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        for writer in engine.monitor.writers:  # what the packages do at exit, now
            getattr(writer, "experiment", None) and writer.experiment.end()
            getattr(writer, "wandb", None) and writer.wandb.finish()
        return {"losses": losses, "writers": len(engine.monitor.writers)}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def wandb_records(path: str) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def _records_with_run(path: str, wait_s: float = 20.0) -> list:
    """The file's records once the run's exit record is there: wandb's service process writes
    the transaction log, and on a loaded machine the records were seen to land after
    ``finish()`` returned."""
    deadline = time.monotonic() + scaled(wait_s)
    while True:
        records = wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            assert "run" in kinds and "exit" in kinds, (
                f"{path}: {os.path.getsize(path)} bytes, records {kinds}"
            )
            return records
        time.sleep(0.5)


def test_wandb_writes_deepspeeds_events_to_an_offline_run(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install shardwise[wandb])")
    block = {"wandb": {"enabled": True, "project": "proj", "group": "grp", "team": "team-a"}}
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    got = run_distributed(_train, 2, block, env)
    assert [g["writers"] for g in got] == [1, 0], "rank 0 alone writes"
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    records = _records_with_run(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.entity) == ("proj", "grp", "team-a")
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [r["_step"] for r in rows] == [4, 8, 12], rows
    assert [r["Train/Samples/train_loss"] for r in rows] == pytest.approx(got[0]["losses"])
    assert all(r["Train/Samples/lr"] == pytest.approx(0.1) for r in rows), rows


def test_comet_writes_deepspeeds_events_at_its_interval_offline(tmp_path):
    pytest.importorskip(
        "comet_ml", reason="comet_ml is not installed (pip install shardwise[comet])"
    )
    block = {
        "comet": {"enabled": True, "online": False, "project": "proj", "samples_log_interval": 8}
    }
    env = {"COMET_OFFLINE_DIRECTORY": str(tmp_path)}
    got = run_distributed(_train, 2, block, env)[0]
    (archive,) = glob.glob(str(tmp_path / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").splitlines() if line]
        project = json.loads(z.read("experiment.json"))["project_name"]
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    loss = [
        (m["step"], m["metricValue"]) for m in metrics if m["metricName"].endswith("train_loss")
    ]
    # samples 4, 8, 12: 8 is only 4 after the last logged, 12 is 8 after: logged
    assert [s for s, _ in loss] == [4, 12], loss
    assert [v for _, v in loss] == pytest.approx([got["losses"][0], got["losses"][2]])
    assert project == "proj"


@pytest.mark.parametrize(
    "block, module, extra", [("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet")]
)
def test_without_the_package_enabling_the_block_names_the_extra(block, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=rf"pip install shardwise\[{extra}\]"):
        shardwise.initialize(
            model=make_model(),
            config={"train_micro_batch_size_per_gpu": 1, block: {"enabled": True}},
        )
