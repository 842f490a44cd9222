"""shardwise verify takes the zero-bubble schedules: by layout name (``pp2xzbv``) and in the
fuzzer's space (a drawn pipeline case may run zb-h1, zbv or dualpipev, with chunks 2 for the
V ones), without processes."""

import pytest

from shardwise.verify.fuzz_space import Case, draw_cases, layout_blocks
from shardwise.verify.layout_names import LayoutError, layout_config, parse_layout


@pytest.mark.parametrize("name,chunks", [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_a_layout_name_picks_the_schedule(name, chunks):
    layout = parse_layout(f"dp2xpp2x{name}")
    assert (layout.dp, layout.pp, layout.schedule) == (2, 2, name)
    cfg = layout_config({"gradient_accumulation_steps": 4}, layout, 16)
    assert cfg["pipeline"] == {"stages": 2, "schedule": name, "chunks": chunks}
    assert layout_config({}, parse_layout("pp2"), 8)["pipeline"] == {"stages": 2}


def test_a_schedule_without_stages_or_twice_is_refused():
    with pytest.raises(LayoutError, match="add pp2"):
        parse_layout("dp2xzbv")
    with pytest.raises(LayoutError, match="two schedules"):
        parse_layout("pp2xzbvxzb-h1")


def test_the_fuzzer_draws_the_zero_bubble_schedules():
    drawn = {c.schedule for seed in range(10) for c in draw_cases(seed, 60) if c.pp > 1}
    assert {"zb-h1", "zbv", "dualpipev"} <= drawn
    for name, chunks in [("zb-h1", None), ("zbv", 2), ("dualpipev", 2)]:
        block = layout_blocks(Case(pp=2, schedule=name))["pipeline"]
        assert block.get("chunks") == chunks and block["schedule"] == name
