"""DualPipeV's F&B steps overlap one unit's communication with the other's compute, and change
no result.

In the schedule a steady-state pair is one FORWARD_BACKWARD instruction (the forward of one
chunk, the full backward of the other, torch's OVERLAP_F_B; tests/test_pipe_zb_schedule.py
checks the pairs against torch's plan and the simulated bubble against DeepSeek's formula).
The executor posts both receives before either computation, waits for the activation before
the forward and for the gradient only before the backward, and sends the forward's output
before the backward computes: checked here on a stage with recording links, without
processes. Then PP2, PP4 and TP2 x PP2 (whose messages travel in 1/TP chunks gathered at the
wait) train bit for bit as the same schedule with each pair run one unit after the other
(``"pipeline": {"overlap_forward_backward": false}``, which reaches the schedule: no F&B step
runs then): the same products in the same order.
"""

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module
from torch import nn

import shardwise
from shardwise.parallel.pipeline.executor import StageExecutor
from shardwise.parallel.pipeline.instructions import Instruction, Op
from shardwise.parallel.pipeline.p2p import Incoming
from shardwise.pipe import LayerSpec, PipelineModule


class _Link:
    """Records what the executor asks of a stage's link for chunk ``c``."""

    def __init__(self, c, log):
        self.c, self.log = c, log

    def new_batch(self):
        pass

    def post_activation(self, requires_grad, now=False):
        self.log.append(f"post act {self.c}")
        return Incoming(lambda: self._got("act", torch.ones(2, 4, requires_grad=requires_grad)))

    def post_grads(self, outputs, now=False):
        self.log.append(f"post grad {self.c}")
        return Incoming(lambda: self._got("grad", [torch.ones(2, 4)]))

    def recv_activation(self, requires_grad):
        return self.post_activation(requires_grad, now=True).wait()

    def recv_grads(self, outputs):
        return self.post_grads(outputs, now=True).wait()

    def _got(self, what, value):
        self.log.append(f"wait {what} {self.c}")
        return value

    def send_activation(self, x):
        self.log.append(f"send act {self.c}")

    def send_grads(self, inputs):
        self.log.append(f"send grad {self.c}")


class _Chunks(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log, self.lin = log, nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, chunk=None):
        self.log.append(f"forward {chunk}")
        out = self.lin[chunk](x)
        out.register_hook(lambda g: self.log.append(f"backward {chunk}"))
        return out


class _Strategy:
    def before_backward(self, sync):
        pass

    def after_backward(self, sync):
        pass


def test_an_f_and_b_step_posts_both_receives_before_computing():
    """A middle stage's F0.1&B0 (forward of micro-batch 0 on chunk 1, backward of micro-batch
    0 on chunk 0): the gradient is posted before the forward runs and waited for only after
    the forward's output went out."""
    log = []
    executor = StageExecutor(_Chunks(log), [_Link(0, log), _Link(1, log)], False, False, None)
    fb = Instruction(Op.FORWARD_BACKWARD, 0, 1, pair=(0, 0))
    program = [Instruction(Op.RECV_ACT, 0), Instruction(Op.FORWARD, 0), fb]
    program += [Instruction(op, 0, 1) for op in (Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD)]
    executor.run(program, None, train=True, micro_batches=1, strategy=_Strategy())
    step = log[log.index("forward 0") + 1 : log.index("send grad 0") + 1]
    assert step == [
        "post grad 0",  # B0's gradient is on its way ...
        "post act 1",
        "wait act 1",
        "forward 1",  # ... while F0.1 computes
        "send act 1",  # F0.1's output leaves before B0 computes
        "wait grad 0",
        "backward 0",
        "send grad 0",
    ], log


class _Recording(_Chunks):
    """_Chunks that also records which autograd node each forward's output hangs from."""

    def __init__(self, log):
        super().__init__(log)
        self.nodes = []

    def forward(self, x, chunk=None):
        out = super().forward(x, chunk)
        self.nodes.append(type(out.grad_fn).__name__)
        return out


def test_a_full_backward_of_a_split_program_runs_torchs_own_linear():
    """In a program that splits backwards, micro-batch 0 has a full BACKWARD (as in an F&B
    step), micro-batch 1 a B and a W: only micro-batch 1's forward goes through the split
    linear. The split linear's fused backward (a nested autograd call per linear) costs ~6 %
    more CPU on a GPT block; torch's own linear gives the same products."""
    module = _Recording([])
    executor = StageExecutor(module, [_Link(0, []), _Link(1, [])], False, False, None)
    mb = [(Op.RECV_ACT, 0), (Op.FORWARD, 0), (Op.RECV_ACT, 1), (Op.FORWARD, 1)]
    mb += [(Op.RECV_GRAD, 0), (Op.BACKWARD, 0), (Op.SEND_GRAD, 0), (Op.RECV_GRAD, 1)]
    mb += [(Op.BACKWARD_INPUT, 1), (Op.SEND_GRAD, 1), (Op.BACKWARD_WEIGHT, 1)]
    program = [Instruction(op, m, 0) for op, m in mb]
    executor.run(program, None, train=True, micro_batches=2, strategy=_Strategy())
    assert module.nodes[0] == "AddmmBackward0", f"full backward's forward: {module.nodes}"
    assert module.nodes[1] != "AddmmBackward0", f"B and W's forward: {module.nodes}"
    assert executor.splits, "micro-batch 1's B left no W work: the program did not split"


ROWS = [  # (name, model, pp, tp, micro-batches)
    ("pp2-mlp", "mlp", 2, 1, 4),
    ("pp2-lm-tied", "lm", 2, 1, 6),
    ("tp2-pp2-blocks-partitioned", "blocks", 2, 2, 5),
    ("pp4-deep", "deep", 4, 1, 8),  # 8 virtual stages: 9 linears (pipe_models' data of mlp)
]
STEPS, MB = 4, 2


def _module(model, pp):
    if model != "deep":
        return pipeline_module(model, pp, chunks=2, placement="v")
    torch.manual_seed(0)
    layers = [x for _ in range(8) for x in (LayerSpec(nn.Linear, 16, 16), nn.Tanh())]
    layers.append(LayerSpec(nn.Linear, 16, 4))
    return PipelineModule(layers, num_stages=pp, loss_fn=F.mse_loss, chunks=2, placement="v")


def _train(model, pp, tp, gas, overlap):
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "pipeline": {"schedule": "dualpipev", "chunks": 2, "overlap_forward_backward": overlap},
        "tensor_parallel": {"size": tp, "plan": BLOCKS_PLAN if tp > 1 else None},
    }
    engine, *_ = shardwise.initialize(model=_module(model, pp), config=config)
    handlers, steps = engine.pipeline.executor._handlers, []
    run_pair = handlers[Op.FORWARD_BACKWARD]
    handlers[Op.FORWARD_BACKWARD] = lambda st, ins: (steps.append(ins), run_pair(st, ins))
    data = micro_batches("mlp" if model == "deep" else model, engine, MB, gas, STEPS)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses = [engine.train_batch(data if reads else None).item() for _ in range(STEPS)]
    return losses, engine.consolidated_state_dict(), len(steps)


def _both(*args):
    return _train(*args, True), _train(*args, False)


@pytest.mark.parametrize("name,model,pp,tp,gas", ROWS, ids=[r[0] for r in ROWS])
def test_dualpipev_with_overlap_trains_bit_for_bit_as_without(name, model, pp, tp, gas):
    for rank, (on, off) in enumerate(run_distributed(_both, pp * tp, model, pp, tp, gas)):
        assert on[2] > 0 and off[2] == 0, f"{name} rank {rank}: F&B steps run {on[2]}, {off[2]}"
        assert on[0] == off[0], f"{name} rank {rank}: losses {on[0]} vs {off[0]}"
        for k, v in off[1].items():
            assert torch.equal(on[1][k], v), f"{name} rank {rank}: {k}"
