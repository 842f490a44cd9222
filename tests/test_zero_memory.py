"""engine.memory_breakdown() meets the ZeRO paper's model-state formulas, up to padding.

For Psi parameters on N data-parallel ranks with Adam (ZeRO, arXiv 1910.02054, section 5.1):

    mixed precision (bf16)   stage 0: 2+2+12 Psi   1: 2+2 Psi + 12 Psi/N   2: 2 Psi + 14 Psi/N
    fp32                     stage 0: 4+4+8 Psi    1: 4+4 Psi + 8 Psi/N    2: 4 Psi + 12 Psi/N

(in fp32 the master weights are the parameters themselves: no extra copy). Sharded buffers are
padded to a multiple of N, so Psi becomes P = Psi rounded up to N per bucket; we check the exact
bytes against P and that P - Psi < N per bucket. The model has Psi = 173, odd, so no N divides it.
"""

import pytest
import torch.nn.functional as F
from harness import run_distributed
from models import make_data, make_model

import shardwise

DIMS = {"d_in": 6, "hidden": 9, "d_out": 2}
PSI = 6 * 9 + 9 + 9 * 9 + 9 + 9 * 2 + 2
ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}

# bytes per element: (params, grads, optimizer), unsharded part and sharded part
FORMULAS = {
    ("fp32", 0): {"params": (4, 0), "grads": (4, 0), "optimizer": (8, 0)},
    ("fp32", 1): {"params": (4, 0), "grads": (4, 0), "optimizer": (0, 8)},
    ("fp32", 2): {"params": (4, 0), "grads": (0, 4), "optimizer": (0, 8)},
    ("bf16", 0): {"params": (2, 0), "grads": (2, 0), "optimizer": (12, 0)},
    ("bf16", 1): {"params": (2, 0), "grads": (2, 0), "optimizer": (0, 12)},
    ("bf16", 2): {"params": (2, 0), "grads": (0, 2), "optimizer": (0, 12)},
}


def _measure(stage: int, dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": ADAM,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
    }
    engine, *_ = shardwise.initialize(model=make_model(**DIMS), config=config)
    x, y = make_data(2, d_in=DIMS["d_in"], d_out=DIMS["d_out"])
    out = engine(x)
    engine.backward(F.mse_loss(out, y.to(out.dtype)))
    engine.step()
    strategy = engine.strategy
    padded = sum(b.layout.padded for b in getattr(strategy, "buckets", []) if hasattr(b, "layout"))
    return {"memory": engine.memory_breakdown(), "padded": padded or PSI}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype,stage", sorted(FORMULAS))
def test_model_states_match_the_zero_formula(dtype, stage, n):
    got = run_distributed(_measure, n, stage, dtype)[0]
    mem, padded = got["memory"], got["padded"]
    tag = f"{dtype} stage {stage} N={n}"
    assert padded - PSI < n, f"{tag}: padding {padded - PSI} must stay below N"
    size = PSI if stage == 0 and dtype == "fp32" else padded
    for kind, (full, sharded) in FORMULAS[(dtype, stage)].items():
        want = full * size + sharded * padded // n
        assert mem[kind] == want, f"{tag}: {kind} holds {mem[kind]} bytes, formula says {want}"
    assert mem["comm_buffers"] == 0, f"{tag}: buffers left alive after the step"
