"""Block-wise symmetric integer quantization: the payload of ZeRO++'s quantized collectives.

A vector x of n elements is cut into ceil(n/B) blocks of B consecutive elements (the last may
be shorter). Block k gets one fp32 scale, and each element an integer of ``bits`` bits:

    q_max   = 2^(bits-1) - 1                       127 for int8, 7 for int4
    s_k     = max_{i in k} |x_i| / q_max           (s_k = 1 for an all-zero block: q = 0)
    q_i     = round(x_i / s_k)                     in [-q_max, q_max], no clamping needed
    x'_i    = q_i * s_k                            dequantized

Error bound: |x'_i - x_i| = s_k |x_i/s_k - round(x_i/s_k)| <= s_k / 2 for every element, i.e.
at most max|x| / (2 q_max) of its block: 1/254 of the block's largest magnitude at int8, 1/14
at int4 (fp32 rounding of x_i / s_k adds a relative 2^-24, far below). Rounding is to nearest
(deterministic), so the same input gives the same bytes on every rank.

Wire format (``pack``): one uint8 vector, the integers then the scales' bytes:

    int8:  n bytes (q + 128, as uint8)            + 4 ceil(n/B) bytes of fp32 scales
    int4:  ceil(n/2) bytes (two q + 8 per byte,   + 4 ceil(n/B) bytes of fp32 scales
           low nibble first)

so a payload is about n/4 (int8) or n/8 (int4) of the fp32 bytes, plus 4/B per element.
"""

from __future__ import annotations

import math

import torch

# DeepSpeed 0.19's quantized weights (partition_parameters.py, CUDAQuantizer) cut each tensor
# into groups near 8000 elements ("the optimal size is 4k"); its qgZ gradients into
# max(rows, cols, world) groups, blocks of min(rows, cols) elements (hundreds to thousands).
# A flat unit mixes tensors, so the block is a constant here: 4096 for int8 weights (DeepSpeed's
# optimum), 512 for int4 gradients (a smaller block: int4 has 16x fewer levels).
WEIGHT_BLOCK = 4096
WEIGHT_BITS = 8  # ZeRO++ qwZ: int8 weights
GRAD_BLOCK = 512
GRAD_BITS = 4  # ZeRO++ qgZ: int4 gradients (DeepSpeed's all_to_all_quant_reduce: 4 bits)
_SCALE_BYTES = 4  # fp32


def _check(bits: int, block: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits: 4 or 8, got {bits}")
    if block < 2 or block % 2:
        raise ValueError(f"block: an even number >= 2 of elements, got {block}")


def payload_bytes(n: int, bits: int, block: int) -> int:
    """Bytes ``pack`` makes of ``n`` elements (the integers, then the fp32 scales)."""
    _check(bits, block)
    return (n if bits == 8 else (n + 1) // 2) + _SCALE_BYTES * math.ceil(n / block)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: q (int8, ``x.numel()`` values in [-q_max, q_max]) and one fp32 scale
    per block of ``block`` elements (module docstring). Each |q_i s_k - x_i| <= s_k / 2."""
    _check(bits, block)
    q_max = 2 ** (bits - 1) - 1
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    scales = padded.abs().amax(dim=1) / q_max  # [blocks]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block: q = 0
    q = torch.round(padded / scales[:, None]).clamp_(-q_max, q_max).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """x' (fp32, ``q.numel()`` elements) = q_i * s_k of element i's block k."""
    n = q.numel()
    blocks = scales.numel()
    padded = torch.nn.functional.pad(q.float(), (0, blocks * block - n)).view(blocks, block)
    return (padded * scales[:, None]).view(-1)[:n]


def pack(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``x`` quantized into one uint8 vector of ``payload_bytes(x.numel(), bits, block)``."""
    q, scales = quantize(x, bits, block)
    offset = 2 ** (bits - 1)
    u = (q.to(torch.int16) + offset).to(torch.uint8)  # [0, 2 q_max + 1]: unsigned
    if bits == 4:
        u = torch.nn.functional.pad(u, (0, u.numel() % 2)).view(-1, 2)
        u = u[:, 0] | (u[:, 1] << 4)  # low nibble first
    return torch.cat([u, scales.view(torch.uint8)])


def unpack(payload: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """The fp32 vector of ``n`` elements a ``pack`` payload stands for."""
    q_bytes = payload_bytes(n, bits, block) - _SCALE_BYTES * math.ceil(n / block)
    u, scale_bytes = payload[:q_bytes], payload[q_bytes:]
    if bits == 4:
        u = torch.stack([u & 0xF, u >> 4], dim=1).view(-1)[:n]
    q = u.to(torch.int16) - 2 ** (bits - 1)
    return dequantize(q, scale_bytes.clone().view(torch.float32), block)
