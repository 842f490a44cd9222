"""A script for ``shardwise verify`` with ZeRO++'s quantized layouts (tests/verify_cases.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for verify_cases

from verify_cases import quantized_setup  # noqa: E402


def shardwise_verify():
    return quantized_setup()
