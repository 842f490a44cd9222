"""A script for ``shardwise verify`` whose tensor-parallel plan splits fc1 although the RMS
normalization after it needs all of fc1's outputs (tests/verify_cases.py, TinyNet)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for verify_cases

from verify_cases import tiny_setup  # noqa: E402


def shardwise_verify():
    return tiny_setup(norm=True)
