"""The engine's DeepSpeed call surface: what a ported script relies on, one rule per test."""

import pytest
import torch
import torch.nn.functional as F
from models import make_data, make_model

import shardwise

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _engine(**cfg):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, **cfg}
    return shardwise.initialize(model=make_model(), config=config)


def test_initialize_returns_the_deepspeed_four_tuple():
    engine, opt, loader, sched = _engine()
    assert isinstance(engine, shardwise.Engine)
    assert isinstance(opt, torch.optim.SGD)
    assert loader is None and sched is None
    assert engine.train_batch_size() == 2 and engine.gradient_accumulation_steps() == 1
    assert engine.get_lr() == [0.1]
    assert engine.global_rank == 0 and engine.world_size == 1 and engine.dp_world_size == 1
    assert engine.device == torch.device("cpu")


def test_model_and_config_alone_are_enough():
    # The DeepSpeed tutorial calls initialize(config=..., model=...) with nothing else.
    engine, opt, _, _ = shardwise.initialize(
        model=make_model(), config={"train_batch_size": 4, "optimizer": SGD}
    )
    assert len(opt.param_groups[0]["params"]) == len(list(engine.module.parameters()))


def test_steps_only_at_the_accumulation_boundary():
    engine, *_ = _engine(gradient_accumulation_steps=3)
    x, y = make_data(18)
    before = engine.consolidated_state_dict()["head.weight"]
    boundaries = []
    for i in range(9):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(F.mse_loss(engine(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
        engine.step()
        if i == 1:
            assert torch.equal(engine.consolidated_state_dict()["head.weight"], before)
    assert boundaries == [False, False, True] * 3
    assert engine.global_steps == 3 and engine.micro_steps == 9
    assert engine.global_samples == 3 * engine.train_batch_size()


def test_backward_divides_the_loss_by_accumulation_steps():
    engine, *_ = _engine(gradient_accumulation_steps=4)
    x, y = make_data(2)
    loss = F.mse_loss(engine(x), y)
    engine.backward(loss)
    ref = make_model()
    F.mse_loss(ref(x), y).backward()
    got = engine.module.head.weight.grad
    assert torch.allclose(got, ref.head.weight.grad / 4, atol=1e-7)


def test_client_optimizer_and_scheduler_callables():
    def make_opt(params):
        return torch.optim.SGD(params, lr=0.5)

    def make_sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    engine, opt, _, sched = shardwise.initialize(
        model=make_model(),
        optimizer=make_opt,
        lr_scheduler=make_sched,
        config={"train_batch_size": 2},
    )
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert engine.get_lr() == [0.25], "the scheduler steps with the optimizer"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_scheduler_built_on_the_users_optimizer_sets_the_lr_zero_steps_with(stage):
    # Accelerate's prepare passes the user's optimizer to initialize but keeps a torch
    # scheduler built on it and steps it itself: as with DeepSpeed, whose ZeRO steps the
    # user's optimizer object, the learning rate it sets must be the one the step uses.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s else 1.0)
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config=config)
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    sched.step()  # lr 0 from here on
    before = engine.consolidated_state_dict()
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    moved = [
        k for k, v in engine.consolidated_state_dict().items() if not torch.equal(v, before[k])
    ]
    assert engine.get_lr() == [0.0], f"stage {stage}: the engine's lr {engine.get_lr()}"
    assert not moved, f"stage {stage}: a step at lr 0 moved {moved}"


def test_config_scheduler_is_built_and_stepped():
    engine, _, _, sched = _engine(
        scheduler={
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 0.1,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        }
    )
    assert engine.get_lr() == [0.0]
    x, y = make_data(2)
    lrs = []
    for _ in range(3):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    # DeepSpeed's WarmupLR: after k step() calls the iteration is k-1, lr = max * it / W.
    assert lrs == pytest.approx([0.0, 0.01, 0.02])


def test_step_without_optimizer_says_how_to_fix_it():
    engine, *_ = shardwise.initialize(model=make_model(), config={"train_batch_size": 2})
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    with pytest.raises(shardwise.EngineError, match="must provide optimizer"):
        engine.step()


def test_backward_needs_a_scalar():
    engine, *_ = _engine()
    with pytest.raises(shardwise.EngineError, match="scalar loss"):
        engine.backward(engine(make_data(2)[0]))


@pytest.mark.parametrize(
    "block,key",
    [
        (
            {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 3}},
            "zero_optimization.stage",
        ),
        ({"communication_data_type": "fp16"}, "communication_data_type"),
        (
            {"activation_checkpointing": {"cpu_checkpointing": True}},
            "activation_checkpointing.cpu_checkpointing",
        ),
    ],
)
def test_features_not_built_yet_fail_loudly(block, key):
    with pytest.raises(shardwise.ConfigError, match="not implemented yet") as err:
        _engine(**block)
    assert key in str(err.value), f"the error must name {key}: {err.value}"


def test_config_from_args_and_from_call_is_ambiguous():
    class Args:
        deepspeed_config = "x.json"

    with pytest.raises(shardwise.ConfigError, match="only one"):
        shardwise.initialize(args=Args(), model=make_model(), config={"train_batch_size": 2})


def test_no_model_is_a_clear_error():
    with pytest.raises(ValueError, match="requires a model"):
        shardwise.initialize(config={"train_batch_size": 2})


def test_train_batch_runs_one_optimizer_step_over_gas_micro_batches():
    x, y = make_data(24)
    data = torch.utils.data.TensorDataset(x, y)
    engine, _, loader, _ = shardwise.initialize(
        model=make_model(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
            "optimizer": SGD,
        },
        training_data=data,
        loss_fn=F.mse_loss,
    )
    loss = engine.train_batch()
    assert engine.global_steps == 1 and engine.micro_steps == 3
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_consolidated_state_dict_has_the_model_keys():
    engine, *_ = _engine()
    sd = engine.consolidated_state_dict()
    assert list(sd) == list(make_model().state_dict())
    assert all(t.device.type == "cpu" for t in sd.values())


def test_add_config_arguments():
    import argparse

    parser = shardwise.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "c.json"])
    assert args.deepspeed and args.deepspeed_config == "c.json"
    # DeepSpeed 0.19.8's group "DeepSpeed": its defaults, and the deprecated deepscale flags
    defaults = {"deepspeed": False, "deepspeed_config": None, "deepscale": False}
    assert vars(parser.parse_args([])) == {**defaults, "deepscale_config": None}
    assert parser.parse_args(["--deepscale", "--deepscale_config", "d.json"]).deepscale_config
    assert "DeepSpeed" in [group.title for group in parser._action_groups]


def test_steps_per_print_logs_progress_on_rank_0(caplog):
    engine, *_ = _engine(steps_per_print=2)
    x, y = make_data(2)
    with caplog.at_level("INFO", logger="shardwise"):
        for _ in range(4):
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert [line.split()[0] for line in lines] == ["step=2", "step=4"], lines
    assert "lr=[0.1]" in lines[0] and "grad_norm=" in lines[0], lines[0]


def test_steps_per_print_null_logs_no_step_line(caplog):
    # DeepSpeed's default since 0.15, also given explicitly as null in its configs.
    for case, extra in (("left out", {}), ("null", {"steps_per_print": None})):
        engine, *_ = _engine(**extra)
        x, y = make_data(2)
        with caplog.at_level("INFO", logger="shardwise"):
            for _ in range(3):
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
        assert not lines, f"{case}: {lines}"


def test_step_without_backward_is_skipped_not_counted(caplog):
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.1}}
    engine, *_ = _engine(scheduler=sched)
    lr = engine.get_lr()
    with caplog.at_level("WARNING", logger="shardwise"):
        engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 0, "a step with nothing to apply"
    assert engine.get_lr() == lr, "the LR schedule moved without an update"
    assert "no engine.backward(loss)" in caplog.text


def test_an_explicit_tag_is_checked_like_latest(tmp_path):
    engine, *_ = _engine()
    (tmp_path / "inner").mkdir()
    engine.save_checkpoint(str(tmp_path / "inner"), tag="t")
    from shardwise.checkpoint.manifest import CheckpointError

    with pytest.raises(CheckpointError, match="tag '../inner/t'"):
        engine.load_checkpoint(str(tmp_path / "other"), tag="../inner/t")
