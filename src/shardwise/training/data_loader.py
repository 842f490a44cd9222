"""Distributed sampling and loading: every layout sees the same global batches.

The contract: for the same seed, epoch and global batch size ``B``, global step ``k`` trains on
the same set of samples whatever the data-parallel size, so DP=N on micro-batch ``b`` trains
exactly like one process on micro-batch ``N * b``.

The sharding rule (``mb`` = micro-batch size, ``dp`` = data-parallel size,
``gas`` = gradient-accumulation steps, ``B = mb * gas * dp``)::

    order = randperm(n, generator seeded with seed + epoch)    # identical on every rank
    order = order cut (drop_last) or wrapped (pad) to a multiple of B
    rank r, micro-step j of global step k  <-  order[k*B + j*(mb*dp) + r*mb : ... + mb]

Micro-step-major, then rank: the order is read in *rounds* of ``mb * dp`` samples and rank
``r`` takes the ``r``-th contiguous slice of every round, i.e. ``order.view(-1, dp, mb)[:, r]``.
Consequences:

- the union over ranks of micro-step ``j`` is ``order[k*B + j*mb*dp : ... + mb*dp]``, which is
  exactly micro-step ``j`` of one process running micro-batch ``mb * dp`` with the same ``gas``
  (so even BatchNorm statistics per micro-step match under SyncBatchNorm);
- ``gas`` only decides where the epoch is cut: per rank, micro-batch ``m`` is round ``m``;
- with ``mb = gas = 1`` this is torch's ``DistributedSampler`` (rank ``r`` takes
  ``order[r::dp]``), with the same seeding, padding and cutting.

Resuming: ``state_dict()`` records the epoch and the position as *global samples consumed* in
that epoch (a whole number of rounds), so a run resumed, even on another layout, neither repeats
nor skips a sample as long as the position falls on a round of the new layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from shardwise.training.repeating import RepeatingLoader


def epoch_order(
    dataset_len: int,
    epoch: int,
    seed: int = 0,
    shuffle: bool = True,
    global_batch_size: int = 1,
    drop_last: bool = True,
) -> torch.Tensor:
    """The global sample order of one epoch, identical on every rank (int64, length % B == 0).

    ``drop_last`` cuts the order to a multiple of ``global_batch_size`` (no sample seen twice);
    otherwise the order is padded by wrapping around from its start, as torch pads.
    """
    if shuffle:
        gen = torch.Generator()  # CPU generator: the same permutation on every device and rank
        gen.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=gen)
    else:
        order = torch.arange(dataset_len)
    if drop_last:
        return order[: dataset_len - dataset_len % global_batch_size]
    pad = -dataset_len % global_batch_size
    if pad and dataset_len:
        reps = -(-pad // dataset_len)  # the pad may be longer than the dataset itself
        order = torch.cat([order, order.repeat(reps)[:pad]])
    return order


def rank_micro_batches(
    order: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int
) -> torch.Tensor:
    """This rank's micro-batches, shape (num_micro_batches, micro_batch_size).

    ``order`` is read in rounds of ``mb * dp``; rank ``r`` takes slice ``r`` of every round.
    """
    return order.view(-1, dp_size, micro_batch_size)[:, dp_rank]


class _ShardPlan:
    """The rule above plus the resumable state (epoch, rounds consumed) of one rank."""

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
    ) -> None:
        for name, value in (
            ("num_replicas", num_replicas),
            ("micro_batch_size", micro_batch_size),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in 0..{num_replicas - 1} (num_replicas)")
        if dataset_len < 0:
            raise ValueError(f"dataset_len={dataset_len} must be >= 0")
        self.dataset_len = int(dataset_len)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.micro_batch_size = int(micro_batch_size)
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.epoch = 0
        self._rounds_done = 0  # micro-batches this rank has handed out in this epoch
        self._resume = False  # the next iteration starts at _rounds_done, not at 0
        if self.num_micro_batches == 0 and self.dataset_len > 0:
            raise ValueError(
                f"a dataset of {self.dataset_len} samples is smaller than one global batch of "
                f"{self.global_batch_size} (micro {self.micro_batch_size} x accumulation "
                f"{self.gradient_accumulation_steps} x data-parallel {self.num_replicas}) with "
                "drop_last=True: lower train_batch_size or set drop_last=False"
            )

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.num_replicas

    @property
    def round_size(self) -> int:
        """Samples consumed globally by one micro-step of every rank."""
        return self.micro_batch_size * self.num_replicas

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per epoch on this rank (the same on every rank)."""
        n, b = self.dataset_len, self.global_batch_size
        total = n - n % b if self.drop_last else -(-n // b) * b
        return total // self.round_size

    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The whole epoch's order, cut or padded to a multiple of the global batch."""
        e = self.epoch if epoch is None else epoch
        return epoch_order(
            self.dataset_len, e, self.seed, self.shuffle, self.global_batch_size, self.drop_last
        )

    def micro_batches(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's micro-batches of the epoch, shape (num_micro_batches, micro_batch_size)."""
        order = self.global_order(epoch)
        return rank_micro_batches(order, self.micro_batch_size, self.rank, self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle with ``seed + epoch`` and start the epoch from its beginning."""
        self.epoch = int(epoch)
        self._rounds_done = 0
        self._resume = False

    def _start(self) -> int:
        """Where a new iteration begins: the resumed position once, else the epoch start."""
        start = self._rounds_done if self._resume else 0
        self._resume = False
        self._rounds_done = start
        return start

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "samples": self._rounds_done * self.round_size,  # global, layout-independent
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration starts right after the last sample consumed."""
        for key in ("seed", "shuffle", "dataset_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data state has {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}: the sample order would differ"
                )
        samples = int(state["samples"])
        if samples % self.round_size:
            raise ValueError(
                f"data state resumes after {samples} samples, not a multiple of this layout's "
                f"round of {self.round_size} (micro {self.micro_batch_size} x data-parallel "
                f"{self.num_replicas}): resume at a global-step boundary"
            )
        self.epoch = int(state["epoch"])
        self._rounds_done = min(samples // self.round_size, self.num_micro_batches)
        self._resume = True


class DistributedSampler(_ShardPlan, Sampler[int]):
    """Indices of this rank's shard, micro-batch after micro-batch (see the module docstring).

    With the defaults ``micro_batch_size = gradient_accumulation_steps = 1`` this matches
    ``torch.utils.data.DistributedSampler`` index for index. The position in ``state_dict()``
    counts what was drawn from the sampler: a ``DataLoader`` with worker processes draws ahead,
    so use ``DistributedDataLoader`` (which counts delivered batches) for exact resumption.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        *,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        super().__init__(
            dataset_len,
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
            micro_batch_size,
            gradient_accumulation_steps,
        )

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        for batch in self.micro_batches()[start:].tolist():
            for i, index in enumerate(batch):
                if i == len(batch) - 1:
                    self._rounds_done += 1  # counted before the last index leaves
                yield index

    def __len__(self) -> int:
        return self.num_micro_batches * self.micro_batch_size


class DistributedBatchSampler(_ShardPlan, Sampler[list[int]]):
    """This rank's micro-batches as lists of indices (see the module docstring)."""

    def __init__(
        self,
        dataset_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        gradient_accumulation_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(
            dataset_len,
            dp_size,
            dp_rank,
            shuffle,
            seed,
            drop_last,
            micro_batch_size,
            gradient_accumulation_steps,
        )

    def remaining(self) -> list[list[int]]:
        """The micro-batches a new iteration would yield (starts that iteration's position)."""
        return self.micro_batches()[self._start() :].tolist()

    def advance(self) -> None:
        """Record one more micro-batch as consumed."""
        self._rounds_done += 1

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.remaining():
            self.advance()
            yield batch

    def __len__(self) -> int:
        return self.num_micro_batches


class DistributedDataLoader:
    """Iterates this rank's micro-batches of a map-style dataset, resumably.

    A thin layer over ``torch.utils.data.DataLoader``: the position recorded by ``state_dict()``
    counts micro-batches delivered to the caller, not those prefetched by worker processes.
    """

    def __init__(
        self,
        dataset: Any,
        batch_sampler: DistributedBatchSampler,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self._running: RepeatingLoader | None = None

    def repeating(self) -> RepeatingLoader:
        """The endless iterator ``train_batch`` draws from, one per loader: its position is
        this loader's (``state_dict``), so a checkpoint resumes it."""
        if self._running is None:
            self._running = RepeatingLoader(self)
        return self._running

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    @property
    def micro_batch_size(self) -> int:
        return self.batch_sampler.micro_batch_size

    batch_size = micro_batch_size  # torch DataLoader's name for it

    def __iter__(self) -> Iterator[Any]:
        batches = self.batch_sampler.remaining()
        if not batches:
            return
        # torch's loader draws a seed from the global generator unless given one: a private
        # one keeps dropout's stream the same when a resumed run starts an iteration mid-epoch.
        gen = torch.Generator().manual_seed(self.batch_sampler.seed + self.batch_sampler.epoch)
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            generator=gen,
        )
        for batch in loader:
            self.batch_sampler.advance()  # before the yield: a checkpoint taken now includes it
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
        self._running = None  # the next repeating() starts at the resumed position


def build_dataloader(
    dataset: Any,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    gradient_accumulation_steps: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable | None = None,
    drop_last: bool = True,
    num_workers: int = 0,
) -> DistributedDataLoader:
    """This data-parallel rank's loader of micro-batches over a map-style ``dataset``."""
    sampler = DistributedBatchSampler(
        len(dataset),
        micro_batch_size,
        dp_rank,
        dp_size,
        gradient_accumulation_steps,
        shuffle,
        seed,
        drop_last,
    )
    return DistributedDataLoader(dataset, sampler, collate_fn, num_workers)
