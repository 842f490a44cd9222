"""``flops_profiler``: DeepSpeed's profile of one forward, counted by torch's own FLOP counter.

At step ``profile_step`` (the forward that runs when ``engine.global_steps == profile_step``:
the default 1 skips the warm-up step, as DeepSpeed) rank 0 runs its forward under
``torch.utils.flop_counter.FlopCounterMode``, which counts the FLOPs of matrix products,
convolutions and attention from their shapes (2 per multiply-add), per module, children
included. Elementwise work (activations, norms, softmax, adds) is not counted: it is a few
percent of a transformer's FLOPs, and the counts then add up to DeepSpeed's MAC-based formula
exactly (MACs = FLOPs / 2). CPU attention (``_scaled_dot_product_flash_attention_for_cpu``),
which torch's table lacks, is counted with torch's own SDPA formula: 4 B H T S D, the full
T x S score matrix even when causal, as torch counts the GPU kernels.

With gradient accumulation the last micro-batch's forward is kept (DeepSpeed restarts the
profile at every forward of that step). Latency is each module's own forward, measured by
hooks. After the step rank 0 prints DeepSpeed's summary (to ``output_file`` when given): totals,
the top ``top_modules`` modules per depth (up to ``module_depth``), and the module tree with
params, MACs, latency and FLOPS per module when ``detailed``. Training FLOPs are taken as
(2 + recompute_fwd_factor + 1) x forward, DeepSpeed's rule (backward = 2 x forward).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from shardwise.config.monitor import FlopsProfilerConfig


def _cpu_sdpa_flops(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
    out_val: torch.Tensor = None,
    **kw: Any,
) -> int:
    return sdpa_flop_count(q, k, v)  # shapes: FlopCounterMode passes shapes, not tensors


def _custom_mapping() -> dict:
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {op: _cpu_sdpa_flops} if op is not None else {}  # keyed by the overload packet


def number(num: float, unit: str = "") -> str:
    """DeepSpeed's ``number_to_string``: ``13107200`` -> ``"13.11 M"``."""
    for magnitude, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if num >= magnitude:
            return f"{round(num / magnitude, 2):g} {prefix}{unit}"
    if num >= 1 or num == 0:
        return f"{round(num, 2):g} {unit}"
    if num >= 1e-3:
        return f"{round(num * 1e3, 2):g} m{unit}"
    return f"{round(num * 1e6, 2):g} u{unit}"


def _params(module: nn.Module) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def _top(rows: dict[str, list[float]], i: int, k: int, fmt: Any) -> dict[str, str]:
    """The k class names with the largest column i, formatted."""
    return {n: fmt(v[i]) for n, v in sorted(rows.items(), key=lambda x: -x[1][i])[:k]}


class FlopsProfiler:
    """Profiles ``model``'s forward between ``start()`` and ``stop()``; the results stay until
    the next ``start()`` (``get_total_flops()`` and friends, DeepSpeed's names)."""

    def __init__(self, model: nn.Module, cfg: FlopsProfilerConfig) -> None:
        self.model, self.cfg = model, cfg
        self.flops: dict[nn.Module, int] = {}
        self.duration: dict[nn.Module, float] = {}
        self._counter: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._starts: dict[nn.Module, list[float]] = {}

    def start(self) -> None:
        self.stop()
        self.flops, self.duration, self._starts = {}, {}, {}
        for m in self.model.modules():
            self._hooks.append(m.register_forward_pre_hook(self._enter))
            self._hooks.append(m.register_forward_hook(self._leave, always_call=True))
        self._counter = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
        self._counter.__enter__()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._starts.setdefault(module, []).append(time.perf_counter())

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        took = time.perf_counter() - self._starts[module].pop()
        self.duration[module] = self.duration.get(module, 0.0) + took

    def stop(self) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        counts = self._counter.get_flop_counts()
        root = type(self.model).__name__
        for name, m in self.model.named_modules():
            key = f"{root}.{name}" if name else root
            self.flops[m] = int(sum(counts.get(key, {}).values()))
        self.flops[self.model] = int(self._counter.get_total_flops())
        self._counter = None

    # DeepSpeed's accessors
    def get_total_flops(self) -> int:
        return self.flops.get(self.model, 0)

    def get_total_macs(self) -> int:
        return self.get_total_flops() // 2

    def get_total_params(self) -> int:
        return _params(self.model)

    def get_total_duration(self) -> float:
        return self.duration.get(self.model, 0.0)

    def module_repr(self, m: nn.Module) -> str:
        """One module's figures, in DeepSpeed's order."""
        total_p, total_f = self.get_total_params(), self.get_total_flops()
        total_t = self.get_total_duration()
        p, f, t = _params(m), self.flops.get(m, 0), self.duration.get(m, 0.0)
        return ", ".join(
            [
                f"{number(p).strip()} = {round(100 * p / total_p, 2) if total_p else 0:g}% Params",
                f"{number(f / 2, 'MACs')} = {round(100 * f / total_f, 2) if total_f else 0:g}% MACs",
                f"{number(t, 's')} = {round(100 * t / total_t, 2) if total_t else 0:g}% latency",
                number(f / t if t else 0, "FLOPS"),
            ]
        )

    def aggregated(self) -> list[str]:
        """Top modules (by class name) per depth: params, MACs, latency."""
        depths: list[dict[str, list[float]]] = []

        def walk(m: nn.Module, d: int) -> None:
            if len(depths) <= d:
                depths.append({})
            row = depths[d].setdefault(type(m).__name__, [0, 0, 0.0])
            row[0] += self.flops.get(m, 0) / 2
            row[1] += _params(m)
            row[2] += self.duration.get(m, 0.0)
            for child in m.children():
                walk(child, d + 1)

        walk(self.model, 0)
        depth = len(depths) - 1 if self.cfg.module_depth == -1 else self.cfg.module_depth
        k = self.cfg.top_modules
        lines = [
            f"Top {k} modules in terms of params, MACs or fwd latency at different model depths:"
        ]
        for d in range(min(depth, len(depths))):
            lines += [
                f"depth {d}:",
                f"    params      - {_top(depths[d], 1, k, number)}",
                f"    MACs        - {_top(depths[d], 0, k, lambda x: number(x, 'MACs'))}",
                f"    fwd latency - {_top(depths[d], 2, k, lambda x: number(x, 's'))}",
            ]
        return lines

    def detailed(self) -> str:
        """The module tree (torch's repr) with each module's figures in front of its own."""
        patched = []
        for m in self.model.modules():
            original = m.extra_repr
            m.extra_repr = lambda m=m, o=original: ", ".join(
                s for s in (self.module_repr(m), o()) if s
            )
            patched.append(m)
        try:
            return repr(self.model)
        finally:
            for m in patched:
                del m.extra_repr
