"""The dtypes a tensor description may carry between ranks, as small integer codes.

Pipeline stages send each activation's dtype as its index in ``WIRE_DTYPES`` before the tensor
(parallel/pipeline/p2p.py); a hang fingerprint packs each tensor's dtype as its index + 1, 0
meaning none (diagnose/fingerprint.py). One table, so that every reader of a code agrees with
its writer. Append only: a code never changes its meaning.
"""

from __future__ import annotations

import torch

WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
