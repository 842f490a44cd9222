"""The architecture's rules, checked on the source (issue 12): what a newcomer may rely on.

* Every process group is made in ``topology.py`` (``ProcessMesh`` and ``new_subgroup``): group
  creation is a collective every rank must call in the same order, so it lives in one place,
  with the world's timeout and a name for errors.
* No import cycle between shardwise modules (module-level imports): a cycle makes import order
  matter and pushes imports into functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "shardwise"


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = (path, ast.parse(path.read_text()))
    return out


def _imported(mod: str, path: Path, node: ast.AST, known: set[str]) -> list[str]:
    """The shardwise modules a top-level import statement depends on."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    # `from pkg import submodule` depends on the submodule, not on the rest of pkg/__init__.
    deps = subs if len(subs) == len(node.names) else [base, *subs]
    return [d for d in deps if d in known and d != mod]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_between_shardwise_modules():
    mods = _modules()
    known = set(mods)
    edges = {
        mod: {d for node in tree.body for d in _imported(mod, path, node, known)}
        for mod, (path, tree) in mods.items()
    }
    cycles = _cycles(edges)
    assert not cycles, f"import cycles (module-level imports): {cycles}"


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module loop is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_every_process_group_is_made_in_topology():
    makers = sorted(
        mod
        for mod, (_, tree) in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "new_group"
    )
    assert set(makers) == {"shardwise.topology"}, (
        f"process groups made outside topology.py: {sorted(set(makers) - {'shardwise.topology'})}"
        " (ask the ProcessMesh: group_of, stage_group, tied_group)"
    )
