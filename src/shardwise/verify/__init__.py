"""``shardwise verify``: train a script's setup in several layouts and in one process, from
the same weights and batches, and report where each layout departs from one process
(docs/verify.md).

    layouts.py  layout names -> sizes and config blocks
    setup.py    the script's entry point (VerifySetup) and how a global batch is cut
    worker.py   one layout's run on every rank (started through ``shardwise run``)
    streams.py  dropout masks across tensor-parallel ranks
    results.py  the files a run leaves (JSON + safetensors)
    compare.py  the tolerance rule and the comparison
    report.py   the printed table
    cli.py      the command
"""

from shardwise.verify.compare import BF16, FP32, Tolerance, Verdict, compare
from shardwise.verify.layouts import Layout, LayoutError, parse_layout, parse_layouts
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
