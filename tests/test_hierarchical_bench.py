"""benchmarks/hierarchical.py without root: its flags, its link-byte model and its table.

The benchmark itself needs root (network namespaces, tc) and minutes; these are the parts that
decide what its table says, checked in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import hierarchical as bench  # noqa: E402

# (op, sent, group ranks, me): bytes crossing hosts of 2 ranks each (host = rank // 2).
LINK_CASES = {
    "flat ring, successor on the other host": ("all_gather", 300.0, (0, 1, 2, 3), 1, 300.0),
    "flat ring, successor on the same host": ("all_gather", 300.0, (0, 1, 2, 3), 0, 0.0),
    "flat ring wraps to host 0": ("reduce_scatter", 300.0, (0, 1, 2, 3), 3, 300.0),
    "MiCS replicate pair": ("all_reduce", 100.0, (1, 3), 3, 100.0),
    "MiCS shard pair inside a host": ("all_gather", 100.0, (2, 3), 2, 0.0),
    "all-to-all: 2 of 3 peers away": ("all_to_all", 300.0, (0, 1, 2, 3), 0, 200.0),
    "a group of one": ("all_reduce", 0.0, (2,), 2, 0.0),
}


@pytest.mark.parametrize("case", list(LINK_CASES))
def test_ring_link_bytes(case):
    op, sent, ranks, me, want = LINK_CASES[case]
    got = bench.ring_link_bytes(op, sent, ranks, me, per_host=2)
    assert got == pytest.approx(want), f"{case}: {got} B on the link, want {want}"


def test_flags_default_to_every_contender_and_refuse_unknown_names(capsys):
    assert bench.parse_args([]).names == list(bench.CONTENDERS), "default: all five"
    picked = bench.parse_args(["--only", "MiCS (shard 2),torch FSDP2 HSDP"]).names
    assert picked == ["MiCS (shard 2)", "torch FSDP2 HSDP"], picked
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "ZeRO-4"])
    assert "unknown ['ZeRO-4']" in capsys.readouterr().err, "the error names the bad name"


def test_table_gives_ratios_to_fsdp2_hsdp_and_dashes_where_the_log_is_blind():
    hsdp = bench.Result("torch FSDP2 HSDP", times=[0.1, 0.2, 0.3], losses=[7.0], veth=2e6)
    mics = bench.Result("MiCS (shard 2)", times=[0.3], losses=[7.0], veth=3e6,
                        log_cross=4e6, log_link=2e6)  # fmt: skip
    rows = {line.split("|")[1].strip(): line for line in bench.report([mics, hsdp]).splitlines()}
    cells = [c.strip() for c in rows["MiCS (shard 2)"].split("|")[1:-1]]
    # median 300 ms vs 200 ms; 3 MB vs 2 MB on the link; veth 3 MB vs 2 MB on the ring model
    assert cells[1:] == ["300", "1.50", "3.00", "1.50", "4.00", "2.00", "1.50", "7.0000"], cells
    ref = [c.strip() for c in rows["torch FSDP2 HSDP"].split("|")[1:-1]]
    assert ref[2] == "1.00" and ref[5:8] == ["-", "-", "-"], f"HSDP row: {ref}"
