"""GPU presets say where each number comes from; a time resting on an unmeasured one says so
(issue 31): ``"estimate": true`` in the record, a ``*`` in the table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.plan import PRESETS, Dims, Layout, Planner, build, read_model
from shardwise.plan.cluster import SOURCES, with_overrides
from shardwise.plan.report import table

NUMBERS = ("device_memory", "peak_tflops", "fp32_tflops", "intra_gbps", "inter_gbps",
           "latency_us", "efficiency", "overlap", "optimizer_gbps", "host_gbps",
           "host_optimizer_gbps")  # fmt: skip
SHAPE = read_model(build(Dims(layers=2, hidden=32, heads=2, vocab=32, seq=16)))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_number_has_a_source(name):
    sources = SOURCES[name]
    assert set(NUMBERS) <= set(sources), f"{name}: {sorted(set(NUMBERS) - set(sources))}"
    guessed = {k for k, v in sources.items() if "estimate" in v}
    assert set(PRESETS[name].estimated) == guessed, name
    assert {"peak_tflops", "device_memory"}.isdisjoint(guessed), f"{name}: datasheet numbers"


# (name, cluster, layout, estimated names the record must carry)
CASES = [
    ("preset, one rank", PRESETS["a100-80g"], Layout(1, 1, 1, 0, 1, 4),
     ["efficiency", "optimizer_gbps"]),
    ("preset, data parallel", PRESETS["a100-80g"], Layout(2, 1, 1, 0, 1, 2),
     ["efficiency", "inter_gbps", "intra_gbps", "latency_us", "optimizer_gbps", "overlap"]),
    ("preset, offload", PRESETS["h100-80g"], Layout(1, 1, 1, 1, 1, 4, offload=True),
     ["efficiency", "host_gbps", "host_optimizer_gbps", "optimizer_gbps"]),
    ("calibrated", replace(PRESETS["a100-80g"], estimated=()), Layout(2, 1, 1, 0, 1, 2), []),
    ("flags given", with_overrides(PRESETS["a100-80g"], latency_us=5.0, intra_gbps=100.0,
                                   inter_gbps=10.0), Layout(2, 1, 1, 0, 1, 2),
     ["efficiency", "optimizer_gbps", "overlap"]),
]  # fmt: skip


@pytest.mark.parametrize("name,cluster,layout,want", CASES, ids=[c[0] for c in CASES])
def test_records_flag_estimates(name, cluster, layout, want):
    rec = Planner(SHAPE, cluster, layout.global_batch, 16, "fp32").evaluate(layout)
    assert rec["estimated"] == want and rec["estimate"] == bool(want), name
    text = table([rec], 1)
    assert ("*" in text.splitlines()[2]) == bool(want), f"{name}: table mark"
    assert ("* estimate" in text) == bool(want), f"{name}: footnote"
