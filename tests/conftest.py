"""Test-wide setup: one thread per rank (bit-for-bit repeatable runs) and worlds torn down."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from harness import shutdown_worlds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"


@pytest.fixture(scope="session", autouse=True)
def _worlds():
    yield
    shutdown_worlds()
