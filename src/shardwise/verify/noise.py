"""How far a normalizing optimizer can move one element on rounding noise alone, over a run.

Adagrad and RMSprop divide the gradient by the square root of a running sum of its squares:

    Adagrad:  G_t = G_(t-1) + g_t^2,                p -= lr_t g_t / (sqrt(G_t) + eps)
    RMSprop:  v_t = a v_(t-1) + (1 - a) g_t^2,      p -= lr_t g_t / (sqrt(v_t) + eps)

so the size of a step does not depend on the size of the gradient: since G_t >= g_t^2 and
v_t >= (1 - a) g_t^2, every step moves an element by at most

    U_t = gain lr_t,   gain = 1 (Adagrad), 1 / sqrt(1 - a) (RMSprop; torch's a = 0.99: 10)

(RMSprop's momentum m sums the steps with weights m^k: gain / (1 - m)). At step 1 the bound is
reached: the move is gain lr sign(g). Two runs whose gradients differ by a reduction-order error
e (a layout sums the same products in another order) agree on an element where |g| >> e: there
the error passes to the step as e / sqrt(G_t), shrinking as G_t grows. Where |g| is no larger
than e (a gradient that nearly cancels), the sign is a coin toss in each run, and each step can
move the two copies apart by up to 2 U_t; over N steps such an element can end

    2 sum_t U_t <= 2 N gain lr_peak

apart: with Adagrad's default lr of 1e-2, 2e-2 after one step and 6e-2 after three; with
RMSprop's, 0.2 after one. The precision's own cap (compare.py, ``param_max``) is below that, so
a correct layout whose noise flips one sign fails it; the cap becomes the larger of the two.
What still tells a wrong layout from noise is the share of a tensor's elements that move
(compare.py): noise flips the few elements whose gradient is below e, a bug moves most.
Beyond step 1 the same gain sets how far an element that did not flip moves: the step
gain lr r (|r| <= 1, a function of the element's gradients) carries the gradients' relative
error e / |g|, so the two runs' moves differ by about gain lr e / |g|, beyond compare.py's
``param`` where |g| < e gain lr / param. Gradients are spread flat around 0 at that scale, so
the share of such elements grows linearly with gain lr: compare.py's fp32 share (0.1%, 25x the
rate measured with Adam at its lr 1e-3, gain 1) becomes 0.1% x gain lr_peak / 1e-3 (RMSprop at
torch's defaults: 10%; measured with ZeRO-3 hpZ on the tiny Llama, verify --fuzz seed 15
case 2: 5 of 2048, 0.24%, none beyond 9.3e-5, against 4e-5 x 100 = 0.4% predicted).
Adam keeps the bounds compare.py measured for it (its m / sqrt(v) is not bounded by 1 beyond
step 1 and its measured moves stay within them); SGD does not normalize (no amplification).
"""

from __future__ import annotations

import math

# torch's defaults (the DeepSpeed JSON names these optimizers with torch's classes).
DEFAULT_LR = {"adagrad": 1e-2, "rmsprop": 1e-2}
RMSPROP_ALPHA = 0.99
ADAM_SHARE, ADAM_LR = 1e-3, 1e-3  # compare.py's fp32 share and the Adam lr it was measured at
# DeepSpeed's schedulers that set the lr themselves, with the key of their peak and its default
# (DeepSpeed 0.19: warmup_max_lr 0.001; OneCycle's cycle_max_lr and LRRangeTest's min lr).
SCHEDULER_PEAK = {
    "WarmupLR": ("warmup_max_lr", 1e-3),
    "WarmupDecayLR": ("warmup_max_lr", 1e-3),
    "OneCycle": ("cycle_max_lr", None),
    "LRRangeTest": ("lr_range_test_min_lr", 1e-3),
}


def _gain(kind: str, params: dict) -> float | None:
    """Largest |step| / lr of one element, or None where it has no bound derived here."""
    if kind == "adagrad":
        return 1.0
    if kind == "rmsprop" and not params.get("centered"):
        alpha = float(params.get("alpha", RMSPROP_ALPHA))
        return 1.0 / math.sqrt(1.0 - alpha) / (1.0 - float(params.get("momentum", 0.0)))
    return None


def _peak_lr(config: dict, lr: float, steps: int) -> float:
    """The largest lr of the run: the optimizer's, or a scheduler's peak above it (LRRangeTest
    grows its lr by ``step_rate`` every ``step_size`` steps)."""
    sched = config.get("scheduler") or {}
    kind, params = sched.get("type"), sched.get("params") or {}
    if kind not in SCHEDULER_PEAK:
        return lr  # torch's StepLR / ExponentialLR and WarmupCosineLR only scale lr down
    key, default = SCHEDULER_PEAK[kind]
    peak = float(params.get(key, default if default is not None else lr))
    if kind == "LRRangeTest":
        rate, size = params.get("lr_range_test_step_rate", 1.0), params.get("lr_range_test_step_size", 2000)  # fmt: skip
        peak *= 1.0 + float(rate) * steps / float(size)
    return max(lr, peak)


def largest_step(config: dict, steps: int) -> float:
    """gain lr_peak: the most one step of the config's optimizer moves an element (0 for
    optimizers without a bound here)."""
    opt = config.get("optimizer") or {}
    kind, params = str(opt.get("type", "")).lower(), opt.get("params") or {}
    gain = _gain(kind, params)
    if gain is None:
        return 0.0
    lr = float(params.get("lr", DEFAULT_LR[kind]))
    return gain * _peak_lr(config, lr, steps)


def noise_move(config: dict, steps: int) -> float:
    """2 N gain lr_peak: how far apart one element whose gradient is below the rounding error
    can end in two correct runs of ``steps`` steps (0 for optimizers without a bound here)."""
    return 2.0 * steps * largest_step(config, steps)


def noise_share(config: dict, steps: int) -> float:
    """The share of a tensor's elements the optimizer's gain lr can move beyond compare.py's
    ``param`` on noise: 0.1% x gain lr_peak / 1e-3 (the module docstring; 0 without a bound)."""
    return ADAM_SHARE * largest_step(config, steps) / ADAM_LR
