"""shardwise.training.data_loader: disjoint shards, same global batches on every layout, exact resumption.

All pure: a rank's sampler needs no process, so every rank of a layout is instantiated here.
"""

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchDistributedSampler
from torch.utils.data import TensorDataset

from shardwise.training.data_loader import (
    DistributedBatchSampler,
    DistributedSampler,
    RepeatingLoader,
    build_dataloader,
    epoch_order,
)

# (micro_batch_size, gradient_accumulation_steps, dp_size) layouts of one global batch of 24.
LAYOUTS_B24 = [(24, 1, 1), (6, 4, 1), (12, 1, 2), (3, 4, 2), (6, 1, 4), (2, 3, 4), (1, 6, 4)]


def _rank_batches(n, mb, gas, dp, epoch=0, drop_last=True, seed=0):
    """Every rank's micro-batches of one epoch: [rank][micro-batch] -> list of indices."""
    out = []
    for r in range(dp):
        s = DistributedBatchSampler(n, mb, r, dp, gas, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _global_batches(n, mb, gas, dp, **kw):
    """The set of samples of every global step: the union over ranks and micro-steps."""
    per_rank = _rank_batches(n, mb, gas, dp, **kw)
    steps = len(per_rank[0]) // gas
    return [
        sorted(
            i for r in range(dp) for mbatch in per_rank[r][k * gas : (k + 1) * gas] for i in mbatch
        )
        for k in range(steps)
    ]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n", [100, 96, 7])
def test_shards_disjoint_and_cover(n, drop_last):
    mb, gas, dp = 2, 2, 4  # B = 16
    if n < 16 and drop_last:
        with pytest.raises(ValueError, match="smaller than one global batch"):
            DistributedBatchSampler(n, mb, 0, dp, gas, drop_last=drop_last)
        return
    per_rank = _rank_batches(n, mb, gas, dp, drop_last=drop_last)
    flat = [[i for b in batches for i in b] for batches in per_rank]
    everything = [i for f in flat for i in f]
    tag = f"n={n} mb={mb} gas={gas} dp={dp} drop_last={drop_last}"
    assert len({len(f) for f in flat}) == 1, f"{tag}: ranks differ in length"
    assert len(everything) % 16 == 0, tag
    if drop_last:
        assert len(set(everything)) == len(everything) == n - n % 16, f"{tag}: a sample repeats"
    else:
        assert set(everything) == set(range(n)), f"{tag}: a sample is missing"
        assert len(everything) == -(-n // 16) * 16, tag


def test_layouts_share_every_global_batch_and_micro_step():
    """DP=N on micro-batch b gives the same global batches as one process on N*b."""
    n = 100
    reference = _global_batches(n, 24, 1, 1)
    assert len(reference) == 4
    for mb, gas, dp in LAYOUTS_B24:
        tag = f"mb={mb} gas={gas} dp={dp}"
        assert _global_batches(n, mb, gas, dp) == reference, tag
        # Finer: micro-step j's union over ranks equals micro-step j of one process on mb*dp.
        single = _rank_batches(n, mb * dp, gas, 1)[0]
        per_rank = _rank_batches(n, mb, gas, dp)
        for m, batch in enumerate(single):
            union = [i for r in range(dp) for i in per_rank[r][m]]
            assert union == batch, f"{tag}: micro-batch {m} differs from one process"


def test_rule_is_micro_step_major_then_rank():
    mb, gas, dp, n = 2, 3, 2, 40
    order = epoch_order(n, epoch=0, seed=5, global_batch_size=mb * gas * dp).tolist()
    B = mb * gas * dp
    for r in range(dp):
        got = list(DistributedBatchSampler(n, mb, r, dp, gas, seed=5))
        for k in range(len(got) // gas):
            for j in range(gas):
                start = k * B + j * mb * dp + r * mb
                assert got[k * gas + j] == order[start : start + mb], f"rank={r} k={k} j={j}"


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n,dp", [(23, 4), (10, 3), (2, 5)])
def test_matches_torch_distributed_sampler_with_unit_micro_batch(n, dp, drop_last):
    if drop_last and n < dp:
        return
    for r in range(dp):
        ours = DistributedSampler(n, dp, r, shuffle=True, seed=3, drop_last=drop_last)
        theirs = TorchDistributedSampler(
            range(n), num_replicas=dp, rank=r, shuffle=True, seed=3, drop_last=drop_last
        )
        for e in (0, 1):
            ours.set_epoch(e)
            theirs.set_epoch(e)
            tag = f"n={n} dp={dp} rank={r} epoch={e} drop_last={drop_last}"
            assert list(ours) == list(theirs), tag
            assert len(ours) == len(theirs), tag


def test_epoch_reshuffles_and_is_repeatable():
    s = DistributedSampler(64, 2, 1, seed=7)
    first = list(s)
    assert list(s) == first, "the same epoch iterated twice must give the same order"
    s.set_epoch(1)
    second = list(s)
    assert sorted(second) != second and second != first, "set_epoch must reshuffle"
    assert list(DistributedSampler(64, 2, 1, seed=7, shuffle=False)) == list(range(1, 64, 2))


def test_resume_mid_epoch_neither_repeats_nor_skips():
    data = TensorDataset(torch.arange(50))
    mb, gas, dp, rank = 3, 2, 2, 1
    ref = build_dataloader(data, mb, rank, dp, gas, seed=11)
    ref.set_epoch(2)
    full = [b[0].tolist() for b in ref]
    assert len(full) == len(ref) == 8  # 50 -> cut to 48: 4 global steps of 12, gas=2 each

    run = build_dataloader(data, mb, rank, dp, gas, seed=11)
    run.set_epoch(2)
    it = iter(run)
    seen = [next(it)[0].tolist() for _ in range(2)]  # one global step
    state = run.state_dict()
    assert state == {"epoch": 2, "samples": 12, "seed": 11, "shuffle": True, "dataset_len": 50}

    resumed = build_dataloader(data, mb, rank, dp, gas, seed=11)
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    assert seen + rest == full, "resumed run repeated or skipped samples"
    assert [b[0].tolist() for b in resumed] == full, "a second pass restarts the epoch"


def test_resume_on_another_layout_continues_the_global_order():
    """Saved on dp=2 after one global step, resumed on dp=1 with the same global batch."""
    n = 48
    saved = [DistributedBatchSampler(n, 3, r, 2, 2, seed=1) for r in range(2)]
    for s in saved:
        s.set_epoch(4)
        it = iter(s)
        next(it), next(it)
    state = saved[0].state_dict()
    single = DistributedBatchSampler(n, 6, 0, 1, 2, seed=1)
    single.load_state_dict(state)
    fresh = DistributedBatchSampler(n, 6, 0, 1, 2, seed=1)
    fresh.set_epoch(4)
    assert list(single) == list(fresh)[2:], "dp=1 must continue where dp=2 stopped"
    odd = DistributedBatchSampler(n, 5, 0, 1, 1, seed=1)
    with pytest.raises(ValueError, match="round"):
        odd.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        DistributedBatchSampler(n, 6, 0, 1, 2, seed=2).load_state_dict(state)


def test_repeating_loader_advances_epochs_and_resumes_at_epoch_end():
    data = TensorDataset(torch.arange(8))
    loader = build_dataloader(data, 2, 0, 2, seed=0)  # 2 micro-batches per epoch on this rank
    rep = RepeatingLoader(loader)
    got = [next(rep)[0].tolist() for _ in range(6)]
    assert loader.epoch == 2
    expected = []
    for e in range(3):
        loader.set_epoch(e)
        expected += [b[0].tolist() for b in loader]
    assert got == expected

    # A checkpoint taken after the last batch of an epoch resumes at the next epoch.
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    fresh = build_dataloader(data, 2, 0, 2, seed=0)
    fresh.load_state_dict(loader.state_dict())
    loader.set_epoch(1)
    assert next(RepeatingLoader(fresh))[0].tolist() == next(iter(loader))[0].tolist()


def test_collate_fn_and_plain_dataloader_interop():
    data = [(float(i), i % 3) for i in range(12)]
    loader = build_dataloader(data, 3, 1, 2, shuffle=False, collate_fn=lambda b: b)
    assert [list(b) for b in loader] == [data[3:6], data[9:12]]
    sampler = DistributedSampler(12, 2, 1, shuffle=False, micro_batch_size=3)
    plain = torch.utils.data.DataLoader(data, batch_size=3, sampler=sampler)
    assert [b[1].tolist() for b in plain] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("seed", [None, 5])
def test_initialize_training_data_is_shuffled_as_deepspeeds_sampler(seed):
    """docs/deepspeed-compat.md: DeepSpeed's loader draws from torch's DistributedSampler, which
    shuffles with seed 0; here the config's ``seed`` (shardwise's key) replaces that 0."""
    import shardwise  # noqa: PLC0415 - the rest of this file needs no engine

    data = TensorDataset(torch.arange(24.0).view(24, 1), torch.zeros(24, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}
    config |= {} if seed is None else {"seed": seed}
    _, _, loader, _ = shardwise.initialize(
        model=torch.nn.Linear(1, 1), config=config, training_data=data
    )
    got = [int(v) for x, _ in loader for v in x.flatten()]
    theirs = TorchDistributedSampler(data, num_replicas=1, rank=0)  # DeepSpeed's: shuffle, seed 0
    theirs.seed = 0 if seed is None else seed
    assert got == list(theirs), f"seed {seed}: {got}"
    assert got != sorted(got), f"seed {seed}: not shuffled"
