"""``shardwise verify``: train a script's setup in several layouts and in one process, from
the same weights and batches, and report where each layout departs from one process
(docs/verify.md).

    layout_names.py    layout names (dp2xtp2) -> sizes and config blocks
    setup.py           the script's entry point (VerifySetup) and how a global batch is cut
    worker.py          one layout's run on every rank (started through ``shardwise run``)
    streams.py         dropout masks across tensor-parallel ranks
    results.py         the files a run leaves (JSON + safetensors)
    compare.py         the tolerance rule and the comparison
    report.py          the printed table
    cli.py             the command
    fuzz_space.py      ``--fuzz``: the space drawn from, a drawn Case, its replay JSON
    fuzz_setup.py      a Case's verify setup (reference or layout side) and Layout
    hf_setups.py       tiny Hugging Face Llama / GPT-2 setups (only with transformers)
    fuzz_run.py        running cases: refused naming a key, ok, or a finding
    fuzz_worker.py     one rank of a case (started through ``shardwise run``)
    support_matrix.py  docs/support-matrix.md from the config validation
"""

from shardwise.verify.compare import BF16, FP32, Tolerance, Verdict, compare
from shardwise.verify.layout_names import Layout, LayoutError, parse_layout, parse_layouts
from shardwise.verify.setup import VerifySetup, load_setup

__all__ = [
    "BF16",
    "FP32",
    "Layout",
    "LayoutError",
    "Tolerance",
    "Verdict",
    "VerifySetup",
    "compare",
    "load_setup",
    "parse_layout",
    "parse_layouts",
]
