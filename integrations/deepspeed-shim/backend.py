"""setuptools' build backend, refusing to build where a real DeepSpeed is installed.

pip builds a local directory before it installs it, every time, and would then uninstall the
installed ``deepspeed`` distribution to put this one in its place. The check reads the
environment of the interpreter pip runs (its ``purelib``/``platlib``, which pip's isolated
build environment leaves as they are): a ``deepspeed-*.dist-info`` there whose metadata does not
carry this shim's local version label is a real DeepSpeed, and the build stops naming it. The
user's site directory is read too.
"""

from __future__ import annotations

import site
import sysconfig
from pathlib import Path

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F403 - the hooks this module does not wrap

LABEL = "+shardwise"


def installed_deepspeed() -> list[str]:
    """``name version (path)`` of every installed DeepSpeed that is not this shim."""
    found = []
    dirs = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    dirs.add(site.getusersitepackages())  # pip would uninstall one found there too
    for where in sorted(dirs):
        for info in sorted(Path(where).glob("deepspeed-*.dist-info")):
            meta = info / "METADATA"
            text = meta.read_text(errors="replace") if meta.is_file() else ""
            version = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                            if ln.startswith("Version:")), "?")  # fmt: skip
            if LABEL not in version:
                found.append(f"deepspeed {version} ({info})")
    return found


def _refuse_over_deepspeed() -> None:
    real = installed_deepspeed()
    if real:
        raise SystemExit(
            "deepspeed-shim: refusing to install over a real DeepSpeed: "
            + "; ".join(real)
            + ". Installing would uninstall it. Use an environment without DeepSpeed, or keep "
            "DeepSpeed and write `import shardwise as deepspeed` in your own scripts."
        )


def prepare_metadata_for_build_wheel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    _refuse_over_deepspeed()
    return _meta.prepare_metadata_for_build_wheel(*args, **kwargs)


def build_wheel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    _refuse_over_deepspeed()
    return _meta.build_wheel(*args, **kwargs)


def prepare_metadata_for_build_editable(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    _refuse_over_deepspeed()
    return _meta.prepare_metadata_for_build_editable(*args, **kwargs)


def build_editable(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    _refuse_over_deepspeed()
    return _meta.build_editable(*args, **kwargs)
