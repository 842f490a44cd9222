"""The engine's pipeline strategy: ``train_batch`` / ``eval_batch`` run a schedule over the
engine's parts (training/parts.py: ``BatchStrategy``).

One ``train_batch`` on stage s of p, with m = gradient_accumulation_steps micro-batches:

    program = make_schedule(name, p, s, m)       # pure data (schedule.py)
    executor.run(program)                        # forwards, backwards, p2p (executor.py)
        ... REDUCE_GRADS   data-parallel reduction (the engine's gradient strategy)
            REDUCE_TIED    tied weights summed over their stages (tied.py)
            OPTIMIZER_STEP the engine's step: global norm over every stage, clip, update
    loss = mean over micro-batches on the last stage, averaged over data ranks, broadcast to
           every stage (plus each stage's auxiliary terms / m, added over the stages, when
           the module has an ``aux_loss_fn``: aux_loss.py)

The first and last stages pull m batches each from their ``data_iter`` (inputs and labels);
the middle stages need none. The gradient norm sums over every stage because the engine
all-reduces it over the model-parallel group (pipeline x tensor ranks of one replica); tied
copies count once (``attach``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.pipeline.executor import StageExecutor
from shardwise.parallel.pipeline.gather import gather_stages
from shardwise.parallel.pipeline.instructions import stage_and_chunk, unpair
from shardwise.parallel.pipeline.meter import ActivationMeter
from shardwise.parallel.pipeline.p2p import Loopback, StageLink
from shardwise.parallel.pipeline.schedule import Op, inference, make_schedule
from shardwise.parallel.pipeline.tied import TiedWeights
from shardwise.parallel.pipeline.zero_bubble import fuse_backward

if TYPE_CHECKING:  # annotations only
    from shardwise.topology import ProcessMesh
    from shardwise.training.parts import TrainParts

logger = logging.getLogger("shardwise")


class PipelineRunner:
    """Runs ``module``'s stage of the pipeline for the engine (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        mesh: ProcessMesh,
        schedule: str = "1f1b",
        compute_dtype: torch.dtype = torch.float32,
        loss_fn: Callable[..., Any] | None = None,
        partitioned: tuple[bool, bool] = (False, False),
        overlap: bool = True,
    ) -> None:
        """``partitioned``: (activations, gradients) sent in 1/TP chunks (p2p.py); ``overlap``:
        the config's ``pipeline.overlap_forward_backward``. The schedule fits the module's
        chunks (setup.py refuses a mismatch, naming the key)."""
        self.module = module
        self.mesh = mesh
        self.schedule = schedule
        # F&B steps (dualpipev) overlap one unit's messages with the other's compute; False
        # runs each pair's units one after the other (instructions.unpair): equal results.
        self.overlap = overlap
        self.stages = mesh.topology.pp
        self.stage_id = mesh.pp_rank
        self.peers = mesh.axis_ranks("pp")
        s = self.stage_id
        self.chunks = module.chunks
        self.placement = module.placement
        # The stage running the model's last layers, which reads the labels and computes the
        # loss: p - 1, or 0 in the V placement.
        self.last_stage = stage_and_chunk(
            self.stages, self.stages * self.chunks - 1, self.placement
        )[0]
        tp = mesh.tp_group if mesh.topology.tp > 1 else None
        self.split_groups = tuple(tp if on else None for on in partitioned)
        self.stage_group, self.stage_root = mesh.stage_group()
        self.tied = TiedWeights(module, mesh)
        self._loop = Loopback()  # chunk -> chunk on this rank (the turn of a V)
        self.executor = StageExecutor(
            module,
            [self._link(c) for c in range(self.chunks)],
            first=s == 0,
            last=s == self.last_stage,
            loss_fn=module.compute_loss if module.loss_fn is not None else loss_fn,
            compute_dtype=compute_dtype,
        )
        if mesh.rank == 0:
            logger.info("%s; schedule %s", module.describe(), schedule)

    def _link(self, chunk: int) -> StageLink:
        """Chunk ``chunk`` is virtual stage w (module.virtual_stage); its neighbours are
        virtual stages w - 1 and w + 1, on the stages the placement gives them; one on this
        stage (the turn of a V) is reached through a Loopback."""
        w, last = self.module.virtual_stage(chunk), self.stages * self.chunks - 1
        prev = self._stage_of(w - 1) if w > 0 else None
        nxt = self._stage_of(w + 1) if w < last else None
        loop = tuple(self._loop if x == self.stage_id else None for x in (prev, nxt))
        prev, nxt = (None if x is None else self.peers[x] for x in (prev, nxt))
        return StageLink(prev, nxt, self.module.dynamic_shape, w, *self.split_groups, loop)

    def _stage_of(self, virtual: int) -> int:
        return stage_and_chunk(self.stages, virtual, self.placement)[0]

    def refusal(self, call: str) -> str:
        """Why ``engine.<call>`` does not exist with a pipeline, and what to call instead."""
        return (
            f"engine.{call} is not available with pipeline parallelism ({self.stages} stages): "
            "the schedule runs forward, backward and step for the whole batch; use "
            "engine.train_batch(data_iter) to train and engine.eval_batch(data_iter) to evaluate"
        )

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """This rank runs the model's last layers (reads the labels, computes the loss): the
        stage p - 1, or stage 0 in the V placement."""
        return self.stage_id == self.last_stage

    # ------------------------------------------------------------------ measuring
    def track_activations(self, enabled: bool = True) -> None:
        """Book the activations each forward stores (``peak_activation_bytes``); costs a
        Python call per saved tensor, so it is off unless asked for."""
        self.executor.meter = ActivationMeter(self.module) if enabled else None
        self.executor.peak_live = self.executor.live

    @property
    def peak_activation_bytes(self) -> int:
        meter = self.executor.meter
        return meter.peak if meter is not None else 0

    @property
    def peak_in_flight(self) -> int:
        """The most micro-batches this stage held between forward and backward."""
        return self.executor.peak_live

    # ------------------------------------------------------------------ batches
    def train_batch(
        self, parts: TrainParts, data_iter: Iterator | None, update: Callable[[], None]
    ) -> torch.Tensor:
        """One step: the schedule's micro-batches; ``update`` (the engine's) at its
        OPTIMIZER_STEP. The micro-step counter moves by the m micro-batches run."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_batch() requires gradients enabled. Use eval_batch() instead."
            )
        if self.is_first_stage() or self.is_last_stage():  # only they read batches
            data_iter = parts.data(data_iter)
        m = parts.batch.gradient_accumulation_steps
        program = make_schedule(self.schedule, self.stages, self.stage_id, m, self.chunks)
        if self.executor.splits is False:  # no layer of this stage splits: B does it all
            program = fuse_backward(program)
        if not self.overlap:
            program = unpair(program, self.stages, self.stage_id, self.chunks, self.placement)

        def step() -> None:
            self.executor.wait_sends()  # nothing this stage sent may change under the update
            update()

        record = self.executor.run(
            program,
            data_iter,
            train=True,
            micro_batches=m,
            strategy=parts.strategy,
            scale=parts.scaler.scale,
            actions={
                Op.REDUCE_TIED: lambda: self.tied.reduce(parts.strategy),
                Op.OPTIMIZER_STEP: step,
            },
        )
        parts.counters.micro_steps += m  # the schedule ran m micro-batches
        return self._mean_loss(record.losses, record.aux_total, m)

    def eval_batch(
        self,
        parts: TrainParts,
        data_iter: Iterator | None,
        return_logits: bool = False,
        num_micro_batches: int | None = None,
    ) -> Any:
        """The mean loss over the micro-batches (every rank); with ``return_logits``, also the
        last stage's outputs concatenated over micro-batches (None on the other stages)."""
        m = num_micro_batches or parts.batch.gradient_accumulation_steps
        with torch.no_grad():
            record = self.executor.run(
                inference(self.stages, self.stage_id, m, self.chunks, self.schedule),
                data_iter,
                train=False,
                micro_batches=m,
                keep_logits=return_logits,
            )
        self.executor.wait_sends()
        loss = self._mean_loss(record.losses, record.aux_total, m)
        if not return_logits:
            return loss
        logits = torch.cat(record.logits) if record.logits else None
        return loss, logits

    def _mean_loss(
        self, losses: list[torch.Tensor], aux: torch.Tensor | None, m: int
    ) -> torch.Tensor:
        """Mean over micro-batches, averaged over the last stage's data ranks, sent to all.
        With the layers' auxiliary terms (aux_loss.py, ``aux``: this stage's sum over the
        batch) every stage adds its sum / m, and the stages' values are added up."""
        total = torch.stack(losses).mean() if self.is_last_stage() else torch.zeros(())
        with_aux = getattr(self.module, "aux_loss_fn", None) is not None  # alike on every stage
        if with_aux and aux is not None:
            total = total + aux / m
        if self.is_last_stage() or with_aux:
            comm.all_reduce(total, group=self.mesh.dp_group)
            total /= self.mesh.topology.dp
        if with_aux:
            comm.all_reduce(total, group=self.mesh.pp_group)
        else:
            comm.broadcast(total, src=self.peers[self.last_stage], group=self.mesh.pp_group)
        return total

    def consolidated_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's entries, tied weights once, on every rank."""
        return gather_stages(state, self.mesh.pp_group, self.peers, self.stage_id)
