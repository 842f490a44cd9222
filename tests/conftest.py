"""Test-wide setup: one thread per rank (bit-for-bit repeatable runs) and worlds torn down."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import tiers  # noqa: E402
from harness import shutdown_worlds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "procs: starts processes; the full tier (make test-fast runs the others)"
    )


def pytest_collection_modifyitems(config, items):
    tiers.mark(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with tiers.watch() as started:
        result = yield  # a failing test raises here, and is reported as it is
    tiers.check(item, started)
    return result


@pytest.fixture(scope="session", autouse=True)
def _worlds():
    yield
    shutdown_worlds()


@pytest.fixture(autouse=True)
def _fresh_default_group():
    """A single-process engine test initializes torch.distributed in the pytest process;
    tear it down after each test so that no test depends on which ran before it. The gloo
    interface it pinned goes too: inherited by a later launch on two hosts, it made both
    listen on loopback."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    yield
    if ifname is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def shim_python(tmp_path_factory):
    """The python of a venv holding the pip-installed deepspeed shim (shim_env.py), built once
    for the Trainer's and Accelerate's tests."""
    from shim_env import make_shim_env

    return make_shim_env(tmp_path_factory.mktemp("shim"))


from netns_hosts import two_hosts  # noqa: E402, F401 - a session fixture shared by the cluster tests
