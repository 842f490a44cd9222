"""The V placement of two chunks per stage (zbv, dualpipev), and the config around it, in one
process: which stage runs which layers, where tied weights live, and what is refused.

In a V the 2p virtual stages go down the stages and back up: chunk 0 of stage s is virtual
stage s, chunk 1 is 2p-1-s, so stage 0 holds the first and the last layers (a tied input
embedding and output projection are then on one stage, with nothing to sum across stages).
"""

import pytest
import torch
from pipe_models import lm_layers, mlp_layers
from torch import nn

import shardwise
from shardwise.config import parse_config
from shardwise.parallel.pipeline.instructions import stage_and_chunk, virtual_stage
from shardwise.pipe import PipelineModule

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _stage(layers, p, s, placement):
    torch.manual_seed(0)
    module = PipelineModule(layers, chunks=2, placement=placement)
    module.build_stage(p, s, "uniform")
    return module


def test_virtual_stages_go_down_and_back_up():
    p = 4
    assert [virtual_stage(p, s, 0, "v") for s in range(p)] == [0, 1, 2, 3]
    assert [virtual_stage(p, s, 1, "v") for s in range(p)] == [7, 6, 5, 4]
    assert [virtual_stage(p, s, 1, "loop") for s in range(p)] == [4, 5, 6, 7]
    for w in range(2 * p):
        s, c = stage_and_chunk(p, w, "v")
        assert virtual_stage(p, s, c, "v") == w


def test_a_v_module_runs_the_first_and_the_last_layers_on_stage_0():
    first, last = _stage(mlp_layers(), 2, 0, "v"), _stage(mlp_layers(), 2, 1, "v")
    # 9 layers on 4 virtual stages, uniform: 3, 2, 2, 2 -> virtual 0: 0-2, 1: 3-4, 2: 5-6, 3: 7-8.
    assert [(i, c) for i, _, c in first._funcs] == [(0, 0), (1, 0), (2, 0), (7, 1), (8, 1)]
    assert [(i, c) for i, _, c in last._funcs] == [(3, 0), (4, 0), (5, 1), (6, 1)]
    assert sorted(k.split(".")[0] for k in first.state_dict()) == ["0", "0", "2", "2", "8", "8"]
    text = first.describe()
    assert "stage 0 chunk 1: layers 7-8" in text and "stage 1 chunk 1: layers 5-6" in text
    loop = _stage(mlp_layers(), 2, 0, "loop")
    assert [(i, c) for i, _, c in loop._funcs] == [(0, 0), (1, 0), (2, 0), (5, 1), (6, 1)]


def test_a_tied_embedding_at_both_ends_stays_on_stage_0():
    module = _stage(lm_layers(), 2, 0, "v")
    assert module.tied_stages == {"embed": [0]}  # one copy: nothing to sum across stages
    assert _stage(lm_layers(), 2, 0, "loop").tied_stages == {"embed": [0, 1]}


def test_v_needs_two_chunks():
    with pytest.raises(ValueError, match='placement="v" needs chunks=2'):
        PipelineModule(mlp_layers(), chunks=3, placement="v").build_stage(2, 0, "uniform")
    with pytest.raises(ValueError, match="placement='zigzag'"):
        PipelineModule(mlp_layers(), placement="zigzag")


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "dualpipev"])
def test_the_config_accepts_the_zero_bubble_schedules(name):
    assert parse_config({"pipeline": {"schedule": name}}).pipeline.schedule == name


@pytest.mark.parametrize(
    "pipeline,gas,module,key,match",
    [
        ({"schedule": "zbv"}, 4, "late", "pipeline.chunks", 'set "chunks": 2, not 1'),
        ({"schedule": "zbv", "chunks": 2}, 4, "built", "pipeline.chunks", 'placement="v"'),
        (
            {"schedule": "dualpipev", "chunks": 2},
            3,
            "late",
            "gradient_accumulation_steps",
            "2 \\* ",
        ),
        ({"schedule": "zb-h1", "chunks": 2}, 4, "late", "pipeline.schedule", "one model chunk"),
    ],
)
def test_misuse_is_refused_naming_the_key(pipeline, gas, module, key, match):
    torch.manual_seed(0)
    made = PipelineModule(mlp_layers(), num_stages=2)
    if module == "built":  # as the constructor builds it under torch.distributed
        made.build_stage(2, 0, "parameters")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": SGD,
        "gradient_accumulation_steps": gas,
    }
    config["pipeline"] = {"stages": 2, **pipeline}
    with pytest.raises(shardwise.ConfigError, match=match) as err:
        shardwise.initialize(model=made, config=config)
    assert err.value.key == key


def test_a_module_built_in_a_loop_is_refused_by_a_v_schedule():
    from shardwise.parallel.pipeline import prepare

    module = _stage(mlp_layers(), 2, 0, "loop")
    cfg = parse_config({"pipeline": {"schedule": "zbv", "chunks": 2, "stages": 2}})

    class Mesh:  # the two fields build_stage reads
        topology = type("T", (), {"pp": 2, "dp": 1, "tp": 1, "cp": 1})()
        pp_rank = 0

    with pytest.raises(shardwise.ConfigError, match='placement="v" to PipelineModule') as err:
        prepare.build_stage(cfg, module, Mesh())
    assert err.value.key == "pipeline.schedule"
    assert isinstance(module, nn.Module)
