"""Every DeepSpeed name docs/deepspeed-compat.md lists as working resolves under shardwise, and a
DeepSpeed-style script using them trains, saves and resumes on two processes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(deepspeed(?:\.\w+)+)` \| (works|alias|refused) \|")


def listed() -> list[tuple[str, str]]:
    lines = (REPO / "docs" / "deepspeed-compat.md").read_text().splitlines()
    return [m.groups() for m in map(ROW.match, lines) if m]


def resolve(dotted: str) -> object:
    """``deepspeed.a.b.c`` as ``import shardwise as deepspeed`` sees it: attribute access from
    the package, then the deepest importable module (``from deepspeed.a.b import c``)."""
    parts = ["shardwise", *dotted.split(".")[1:]]
    obj: object = importlib.import_module("shardwise")
    for name in parts[1:]:
        obj = getattr(obj, name)
    return obj


def test_the_table_lists_the_names_scripts_reach_for():
    names = {n for n, _ in listed()}
    assert len(names) >= 30, "the compatibility table lost its rows"
    for must in (
        "deepspeed.accelerator.get_accelerator",
        "deepspeed.runtime.utils.set_random_seed",
    ):
        assert must in names, must


@pytest.mark.parametrize("name, status", listed())
def test_every_listed_name_resolves(name, status):
    if status == "refused":
        with pytest.raises(AttributeError):
            resolve(name)
        return
    assert resolve(name) is not None, name
    module, _, attr = name.rpartition(".")
    if module != "deepspeed":  # `from deepspeed.x import y` works too
        mod = importlib.import_module("shardwise." + module.split(".", 1)[1])
        assert getattr(mod, attr) is resolve(name), name


def test_cpu_accelerator_answers_as_deepspeeds():
    from shardwise.accelerator.devices import CpuAccelerator

    acc = CpuAccelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu",) * 3
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.device_count() == 1 and acc.current_device() == 0
    assert 0 < acc.memory_allocated() <= acc.total_memory()


def test_a_deepspeed_style_script_using_the_deep_names_trains_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2"]
    cmd += [str(REPO / "tests" / "scripts" / "ds_deep_names.py"), "--save_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(240), env=env, cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "resumed epoch=7 steps=4 device=cpu" in out.stdout, out.stdout[-2000:]
    assert "after training | MA " in out.stderr + out.stdout
