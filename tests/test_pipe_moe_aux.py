"""MoE load-balancing losses inside a pipeline: ``PipelineModule(aux_loss_fn=moe_aux_loss(w))``
trains like one process whose loss is task loss + w * sum of every MoE layer's l_aux, under
every schedule, and the losses train_batch and eval_batch report include the auxiliary terms.

The model: Linear, four residual MoE blocks (4 experts, top-1, deterministic gating: no noise,
no random token selection, so one process and the stages route alike), Linear; cut uniformly
so that every stage holds MoE blocks (PP2: blocks 1-2 | 3-4; V placement: stage 0 holds block
1 and the head, stage 1 blocks 2-4). The reference runs the same micro-batches (gating is per
micro-batch) with plain PyTorch. Tolerance (fp32, SGD with momentum, clipping engaged, 10
steps): losses 1e-5 relative, parameters 1e-6 absolute, the bounds of test_pipe_zb_compose.py;
a stage that leaves its auxiliary terms out of the backward or of the reported loss is off by
about AUX * l_aux ~ 0.1 (checked: the reference without them differs by more than 1e-2).
Expert parallelism (ep_size > 1) inside a pipeline stays refused, naming what to change.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from one_process import global_batches, reference_run
from torch import nn

import shardwise
from shardwise.moe.layer import MoE
from shardwise.pipe import LayerSpec, PipelineModule, moe_aux_loss
from shardwise.verify import VerifySetup
from shardwise.verify.fuzz_run import Fuzzer, run_phased
from shardwise.verify.fuzz_setup import case_layout, case_setup
from shardwise.verify.fuzz_space import Case, from_json

H, EXPERTS, AUX = 8, 4, 0.1
STEPS, MB, GAS, LR, CLIP = 10, 2, 4, 0.1, 0.5


class MoEBlock(nn.Module):
    """x + MoE(x): four experts, each with its own weights (MoE builds equal copies)."""

    def __init__(self, width: int, ep_size: int = 1) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
        self.moe = MoE(width, expert, EXPERTS, ep_size=ep_size, k=1, use_rts=False)
        with torch.no_grad():  # drawn from the global stream: the pipeline replays it alike
            for p in self.moe.deepspeed_moe.experts.parameters():
                p.normal_(0.0, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)[0]


def layers(ep_size: int = 1) -> list:
    return [
        LayerSpec(nn.Linear, 6, H),
        *[LayerSpec(MoEBlock, H, ep_size) for _ in range(4)],
        LayerSpec(nn.Linear, H, 1),
    ]


class Reference(nn.Sequential):
    """The same layers in one process; the loss adds weight * sum of the blocks' l_aux."""

    def __init__(self, weight: float = AUX) -> None:
        torch.manual_seed(0)
        super().__init__(*[spec.build() for spec in layers()])
        self.weight = weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(super().forward(x), y)
        return loss + self.weight * sum(b.moe.deepspeed_moe.l_aux for b in list(self)[1:5])


def make_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 3, 6, generator=g)  # 3 tokens per row
    return x, x.sum(-1, keepdim=True).sin()


def _setup(weight: float = AUX) -> VerifySetup:
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": CLIP,
    }
    return VerifySetup(
        lambda: Reference(weight), global_batches(make_data, MB * GAS, STEPS), config
    )


def _train(schedule: str) -> dict:
    chunks = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    placement = "v" if schedule in ("zbv", "dualpipev") else "loop"
    torch.manual_seed(0)
    module = PipelineModule(
        layers(), num_stages=2, loss_fn=F.mse_loss, partition_method="uniform",
        chunks=chunks, placement=placement, aux_loss_fn=moe_aux_loss(AUX),
    )  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "pipeline": {"schedule": schedule, "chunks": chunks},
    }
    engine, *_ = shardwise.initialize(model=module, config=config)
    x, y = make_data(MB * GAS * STEPS)
    data = iter([(x[i : i + MB], y[i : i + MB]) for i in range(0, len(x), MB)])
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data if reads else None).item())
        norms.append(engine.get_global_grad_norm())
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    blocks = [n for n, _ in module.stage_modules() if isinstance(module.get_submodule(n), MoEBlock)]
    evaluated = engine.eval_batch(iter(_eval_batches()) if reads else None).item()
    return {"losses": losses, "norms": norms, "params": params, "blocks": blocks, "eval": evaluated}


def _eval_batches() -> list:
    x, y = make_data(MB * GAS * (STEPS + 1))
    return [(x[i : i + MB], y[i : i + MB]) for i in range(MB * GAS * STEPS, len(x), MB)]


def _one_process_eval(params: dict) -> float:
    """eval_batch's loss in one process: the trained weights in eval mode, the mean over the
    micro-batches of task loss + AUX * sum of l_aux (the gates' eval capacity on each)."""
    model = Reference()
    model.load_state_dict(params)
    model.eval()
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in _eval_batches()) / GAS


@pytest.fixture(scope="module")
def one_process() -> dict:
    want = reference_run(_setup(), STEPS, split=GAS)  # one micro-batch per gate, as the stages
    plain = reference_run(_setup(weight=0.0), STEPS, split=GAS)
    assert max(want["norms"]) > CLIP, "clipping never engaged; the test is void"
    gap = max(abs(a - b) for a, b in zip(want["losses"], plain["losses"], strict=True))
    assert gap > 1e-2, f"the auxiliary terms move the loss by {gap:.1e} only; the test is void"
    return want


SCHEDULES = ["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_moe_aux_losses_train_like_one_process_under_a_pipeline(one_process, schedule):
    want, runs = one_process, run_distributed(_train, 2, schedule)
    # DeepSpeed's train_batch: the last stage's mean loss (task + every stage's terms, as
    # Megatron-DeepSpeed carries them), the same number on every stage.
    assert runs[0]["losses"] == runs[1]["losses"], f"pp2 {schedule}: the stages report apart"
    for rank, got in enumerate(runs):
        tag = f"pp2 {schedule} rank {rank}"
        assert got["blocks"], f"{tag}: this stage holds no MoE block; the cut tests nothing"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
        for k, w in want["params"].items():
            diff = (got["params"][k] - w).abs().max().item()
            assert diff <= 1e-6, f"{tag}: {k} differs by {diff:.2e}"
        evaluated = _one_process_eval(want["params"])
        assert got["eval"] == pytest.approx(evaluated, rel=1e-5), f"{tag}: eval_batch"


def _refusal_with_experts_split() -> str:
    module = PipelineModule(layers(ep_size=2), num_stages=2, loss_fn=F.mse_loss)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    try:
        shardwise.initialize(model=module, config=config)
    except NotImplementedError as refusal:
        return str(refusal)
    return "accepted"


def test_expert_parallelism_inside_a_pipeline_is_refused_naming_the_keys_and_the_fix():
    """MoE(ep_size=2) on two stages is not implemented: initialize says so on every stage, with
    the MoE argument, the config keys and their values, and the fix (docs/support-matrix.md)."""
    for rank, text in enumerate(run_distributed(_refusal_with_experts_split, 2)):
        for part in ("MoE(ep_size=2)", "pipeline.stages=2", "tensor_parallel.size=1", "ep_size=1"):
            assert part in text, f"pp2 ep2 rank {rank}: {part!r} not in {text!r}"


# ---------------------------------------------------------------- shardwise verify --fuzz
# The fuzzer's MoE GPT in a pipeline (examples/gpt: pipeline_aux_loss), each case as
# ``shardwise verify --fuzz-case`` runs it (3 steps, AdamW, verify's tolerance), the layout in
# this suite's 2-process world instead of a launch of its own. The 1f1b row was a finding
# before verify turned the gates' random parts off for pipelines: stage 1 drew for its gate
# what one process drew for the model's first.
FUZZ_CASES = [
    Case(model="gpt-moe", pp=2, gas=2, moe={"num_experts": 4, "k": 1}),
    Case(model="gpt-moe", pp=2, gas=4, schedule="zbv", moe={"num_experts": 4, "k": 2}),
]


def _layout_run(text: str, init: str):
    case = from_json(text)
    setup = case_setup(case, None, "shardwise_verify", layout_side=True)
    return run_phased(setup, case_layout(case), 3, Path(init), None)


class _InWorld(Fuzzer):
    def _launch(self, case, init, out):
        return run_distributed(_layout_run, case.world, case.to_json(), str(init))[0]


@pytest.mark.parametrize("case", FUZZ_CASES, ids=lambda c: c.summary().split(" |")[0])
def test_the_fuzzer_accepts_moe_gpt_in_a_pipeline(case, tmp_path):
    outcome = _InWorld(None, "shardwise_verify", 3, 240.0, tmp_path).run(case)
    assert outcome.kind == "ok", f"{case.summary()}: {outcome.kind}: {outcome.detail}"
