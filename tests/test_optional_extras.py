"""The integrations are optional extras (issue 27): ``import shardwise`` imports none of the
frameworks they adapt, and only their own modules under ``shardwise.integrations`` import them.

Checked twice: on the source (every import statement, module-level or in a function), and in a
fresh interpreter (what ``import shardwise`` actually loads, the DeepSpeed-named surface
included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from waits import scaled

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardwise"
# framework -> the shardwise package allowed to import it
EXTRAS = {
    "lightning": "integrations/lightning",
    "pytorch_lightning": "integrations/lightning",
    "ray": "integrations/ray",
}
ADAPTERS = sorted({"shardwise." + home.replace("/", ".") for home in EXTRAS.values()})


def _imports(tree: ast.Module) -> set[str]:
    """Every module an import statement names (``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _under(names: set[str], package: str) -> bool:
    return any(n == package or n.startswith(f"{package}.") for n in names)


def test_only_each_integration_imports_its_framework():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        used = _imports(ast.parse(path.read_text()))
        for framework, home in EXTRAS.items():
            adapter = "shardwise." + home.replace("/", ".")
            if rel.startswith(home):
                continue
            wrong += [f"{rel} imports {m}" for m in (framework, adapter) if _under(used, m)]
    assert not wrong, wrong


def test_import_shardwise_imports_no_optional_extra():
    code = (
        "import sys, shardwise, shardwise.launch.cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{sorted(EXTRAS)!r} or m.startswith({tuple(ADAPTERS)!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", f"import shardwise loaded: {proc.stdout}"
