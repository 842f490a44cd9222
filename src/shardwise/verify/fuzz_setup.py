"""A fuzz case made runnable: its verify setup, on the reference side or the layout side, and
its ``Layout``.

The example GPT (and its MoE variant) come from the script's entry point, called with the
model options as keyword arguments; the Hugging Face models from ``hf_setups`` (imported only
then). The script's config is replaced by the case's (its ``seed`` kept), and its batches are
cut or joined into global batches of the case's rows, the same values on both sides. The layout
side adds the layout's config blocks and builds MoE layers with the case's expert-parallel size;
the reference keeps ``ep`` 1, every expert in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise.verify.fuzz_space import Case, layout_blocks, train_config
from shardwise.verify.hf_setups import hf_setup
from shardwise.verify.layout_names import Layout
from shardwise.verify.setup import DEFAULT_ENTRY, VerifySetup, batch_rows, load_setup, take_rows

COLLECTIVE_TIMEOUT_S = 90  # well under --fuzz's 240 s per case, far above a tiny step
EXAMPLE_SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"


def default_script() -> Path:
    """The example GPT of a source checkout (``--fuzz`` without a SCRIPT)."""
    if not EXAMPLE_SCRIPT.is_file():
        raise ValueError(
            f"--fuzz without a SCRIPT uses the example GPT ({EXAMPLE_SCRIPT}), not found in this "
            "installation: give the path of examples/gpt/train.py"
        )
    return EXAMPLE_SCRIPT


def case_layout(case: Case) -> Layout:
    """The case's sizes as a verify Layout (named for the result directory)."""
    name = f"dp{case.dp}xtp{case.tp}xpp{case.pp}xcp{case.cp}xzero{case.zero}"
    name += f"xmics{case.mics}" if case.mics else ""
    name += f"xhpz{case.hpz}" if case.hpz else ""
    ulysses = case.cp > 1 and case.cp_method == "ulysses"
    sizes = (case.dp, case.tp, case.pp, case.zero, case.sp, case.cp, ulysses)
    return Layout(name, *sizes, mics=case.mics, hpz=case.hpz)


def _model_options(case: Case, layout_side: bool) -> dict:
    """Keyword arguments of the script's entry point (the example GPT's GPTConfig fields)."""
    if case.model != "gpt-moe":
        return {}
    moe = dict(case.moe)
    experts, k = moe.pop("num_experts", 4), moe.pop("k", 1)
    ep = case.ep if layout_side else 1
    return {"moe_experts": experts, "moe_k": k, "ep": ep, "moe_args": moe}


def _join(parts: list[Any]) -> Any:
    """Batches of the same structure joined along their rows."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        return type(first)(_join([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts]) for k in first}
    return first


def rebatch(batches: Callable[[], Iterable[Any]], rows: int) -> Callable[[], Iterator[Any]]:
    """``batches`` re-cut into global batches of ``rows`` rows (the same at every call)."""

    def cut() -> Iterator[Any]:
        pending: list[Any] = []
        have = 0
        for batch in batches():
            n = batch_rows(batch)
            start = 0
            while start < n:
                take = min(rows - have, n - start)
                pending.append(take_rows(batch, slice(start, start + take)))
                have, start = have + take, start + take
                if have == rows:
                    yield _join(pending)
                    pending, have = [], 0

    return cut


def case_setup(
    case: Case, script: str | Path | None, entry: str = DEFAULT_ENTRY, *, layout_side: bool
) -> VerifySetup:
    """The verify setup of ``case`` for one side: the reference, or the layout's workers."""
    if case.model in ("llama", "gpt2"):
        setup = hf_setup(case.model, case.pp if layout_side else 1)
    elif case.model in ("gpt", "gpt-moe"):
        setup = load_setup(script or default_script(), entry, _model_options(case, layout_side))
    else:
        raise ValueError(
            f"--fuzz-case: unknown model {case.model!r}; one of gpt, gpt-moe, llama, gpt2"
        )
    config = train_config(case, seed=int(setup.config.get("seed", 0)))
    if layout_side:
        config.update(layout_blocks(case))
        # A hung collective fails within the case's timeout, naming the call (comms watchdog).
        config["comms"] = {"timeout_s": COLLECTIVE_TIMEOUT_S}
    return dataclasses.replace(setup, config=config, batches=rebatch(setup.batches, case.rows))
