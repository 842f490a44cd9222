"""Names of docs/deepspeed-compat.md used as DeepSpeed scripts use them, each checked against
what DeepSpeed 0.19.8 does (its source: deepspeed/runtime/engine.py, runtime/dataloader.py,
runtime/utils.py, utils/logging.py, accelerator/real_accelerator.py), in one process where one
suffices (tests/scripts/ds_deep_names.py uses the names whose answer depends on the rank, on
two processes). The other names are used by the tests test_deepspeed_compat.py's ``USED_BY``
lists; that file checks that every row of the table has one.
"""

import logging
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import capture_logs
from models import make_data, make_model
from torch.utils.data import DataLoader, DistributedSampler

import shardwise as deepspeed  # the import a ported script changes, and nothing else
from shardwise.accelerator import real_accelerator
from shardwise.devices.accelerators import CpuAccelerator
from shardwise.runtime.dataloader import RepeatingLoader as RuntimeRepeatingLoader
from shardwise.runtime.engine import DeepSpeedEngine as RuntimeDeepSpeedEngine

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _train_step(engine) -> None:
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()


# --- the engine class --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, cls",
    [
        ("deepspeed.DeepSpeedEngine", deepspeed.DeepSpeedEngine),
        ("deepspeed.runtime.engine.DeepSpeedEngine", RuntimeDeepSpeedEngine),
    ],
)
def test_initialize_returns_a_deepspeed_engine_that_is_a_module(spelling, cls):
    # Scripts check `isinstance(model, deepspeed.DeepSpeedEngine)` to tell a wrapped model; the
    # engine is a torch Module in DeepSpeed (class DeepSpeedEngine(Module)), so .train() works.
    engine, *_ = deepspeed.initialize(model=make_model(), config=CONFIG)
    assert isinstance(engine, cls), f"{spelling}: initialize's engine is not one"
    assert isinstance(engine, torch.nn.Module), f"{spelling}: not a torch Module"
    assert engine.train() is engine and engine.training, f"{spelling}: Module.train()"


# --- RepeatingLoader ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, cls",
    [
        ("deepspeed.utils.RepeatingLoader", deepspeed.utils.RepeatingLoader),
        ("deepspeed.runtime.dataloader.RepeatingLoader", RuntimeRepeatingLoader),
    ],
)
def test_repeating_loader_restarts_its_loader_endlessly(spelling, cls):
    # DeepSpeed: an iterator over `loader` that calls iter(loader) again on StopIteration.
    endless = cls([1, 2, 3])
    assert iter(endless) is endless, spelling
    assert [next(endless) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1], spelling
    data = list(range(6))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    endless = cls(DataLoader(data, batch_size=2, sampler=sampler))
    passes = [torch.cat([next(endless) for _ in range(3)]).tolist() for _ in range(2)]
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert passes[0] == orders[0], f"{spelling}: the first pass is the sampler's own order"
    # The documented difference: the loader's sampler moves to the next epoch when it runs
    # out, so the second pass is reshuffled; DeepSpeed's repeats the first order.
    assert passes[1] == orders[1] != orders[0], f"{spelling}: second pass {passes[1]}"


# --- runtime.utils -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 3, 2**64 + 7])  # the last: pytest-randomly's
def test_set_random_seed_seeds_python_numpy_and_torch_as_deepspeed(seed):
    deepspeed.runtime.utils.set_random_seed(seed)
    got = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.seed(seed)  # DeepSpeed's three calls, with the moduli it takes
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
    assert got == (random.random(), float(np.random.rand()), torch.rand(1).item()), seed


MEMORY_LINE = re.compile(r"MA ([\d.]+) GB Max_MA ([\d.]+) GB CA [\d.]+ GB Max_CA [\d.]+ GB")


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the CPU accelerator's peak")
def test_see_memory_usage_prints_deepspeeds_report_and_restarts_the_peak(capsys):
    see = deepspeed.runtime.utils.see_memory_usage
    see("not forced")
    assert capsys.readouterr().out == "", "without force=True DeepSpeed prints nothing"
    block = torch.ones(2**25)  # 128 MiB, touched then freed: the peak keeps it
    del block
    reports = []
    for message in ("after the block", "again"):
        see(message, force=True)
        reports.append(capsys.readouterr().out.splitlines())
    for message, lines in zip(("after the block", "again"), reports, strict=True):
        assert lines[0] == message and MEMORY_LINE.fullmatch(lines[1]), lines
        assert lines[2].startswith("CPU Virtual Memory:  used = "), lines
    (ma, peak), (ma2, peak2) = (map(float, MEMORY_LINE.match(r[1]).groups()) for r in reports)
    # Figures are rounded to 0.01 GiB; the block is 0.125 GiB, the rest moves by a few MiB.
    assert peak - ma >= 0.1, f"the freed block is in the first peak: {reports[0]}"
    assert peak2 - ma2 < 0.05, f"the first report restarted the peak: {reports[1]}"


# --- accelerator -------------------------------------------------------------------------------


def test_get_accelerator_is_one_object_and_set_accelerator_replaces_it():
    acc = deepspeed.accelerator.get_accelerator()
    assert deepspeed.accelerator.get_accelerator() is acc, "DeepSpeed keeps one accelerator"
    want = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")
    assert (acc.device_name(), acc.communication_backend_name()) == want
    mine = CpuAccelerator()
    deepspeed.accelerator.set_accelerator(mine)
    try:
        assert deepspeed.accelerator.get_accelerator() is mine, "set_accelerator"
        assert real_accelerator.get_accelerator() is mine, "real_accelerator's spelling"
        with pytest.raises(ValueError, match="pass an accelerator"):
            deepspeed.accelerator.set_accelerator("cpu")  # DeepSpeed asserts the type too
        assert deepspeed.accelerator.get_accelerator() is mine, "a refused one changes nothing"
    finally:
        deepspeed.accelerator.set_accelerator(acc)


# --- utils.log_dist and utils.logger -----------------------------------------------------------


@pytest.mark.parametrize("ranks", [None, [], [0], [1], [-1]])
def test_log_dist_without_torch_distributed_logs_here_as_rank_minus_one(ranks):
    # DeepSpeed's get_dist_msg: not initialized -> log, whatever `ranks` says, as rank -1.
    assert not torch.distributed.is_initialized()
    _, lines = capture_logs(deepspeed.utils.log_dist, "hello", ranks)
    assert lines == ["[Rank -1] hello"], f"ranks={ranks}: {lines}"


def test_utils_logger_carries_the_engines_lines_and_its_level_silences_them():
    # Scripts quiet DeepSpeed with deepspeed.utils.logger.setLevel(logging.WARNING): the logger
    # is the one the engine's own lines go through.
    engine, *_ = deepspeed.initialize(model=make_model(), config={**CONFIG, "steps_per_print": 1})
    log, heard = deepspeed.utils.logger, []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    log.addHandler(handler)
    level = log.level
    try:
        log.setLevel(logging.INFO)
        _train_step(engine)
        at_info = list(heard)
        log.setLevel(logging.WARNING)
        _train_step(engine)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert [m.split()[0] for m in at_info if m.startswith("step=")] == ["step=1"], at_info
    assert heard == at_info, f"at WARNING the engine's INFO lines must stop: {heard}"


# --- names refused, each with the alternative ---------------------------------------------------

REFUSED_NAMES = [  # (dotted name, the import a script writes, a word of the alternative)
    ("deepspeed.ops.lamb.FusedLamb", "from shardwise.ops.lamb import FusedLamb", '"AdamW"'),
    (
        "deepspeed.utils.zero_to_fp32",
        "from shardwise.utils import zero_to_fp32",
        "shardwise export",
    ),
]


@pytest.mark.parametrize(
    "name, statement, instead", REFUSED_NAMES, ids=[n for n, *_ in REFUSED_NAMES]
)
def test_a_refused_name_says_what_to_use_in_either_spelling(name, statement, instead):
    with pytest.raises(
        ImportError, match=re.escape(name) + " is not provided.*" + re.escape(instead)
    ):
        exec(
            statement, {}
        )  # the import a ported script writes (a try/except ImportError probe works)
    package, module = name.split(".")[1:3]  # deepspeed.<package>.<module>
    owner = getattr(deepspeed, package)
    with pytest.raises(AttributeError, match=re.escape(name) + " is not provided"):
        getattr(owner, module)
    assert not hasattr(owner, module), f"{name}: hasattr must be false, as for a missing name"


def test_groups_initialize_raises_as_deepspeeds_naming_where_the_groups_come_from():
    # DeepSpeed 0.19 keeps the deprecated function and raises when it is called (DeprecatedException).
    from shardwise.utils.groups import initialize

    with pytest.raises(ImportError, match="deepspeed.utils.groups.initialize is not provided.*MoE"):
        deepspeed.utils.groups.initialize(ep_size=2)
    assert initialize is deepspeed.utils.groups.initialize
