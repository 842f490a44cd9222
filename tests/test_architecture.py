"""The architecture's rules, checked on the source (issue 12): what a newcomer may rely on.

* Every process group is made in ``topology.py`` (``ProcessMesh`` and ``new_subgroup``): group
  creation is a collective every rank must call in the same order, so it lives in one place,
  with the world's timeout and a name for errors.
* No import cycle between shardwise modules (module-level imports): a cycle makes import order
  matter and pushes imports into functions.
* The mechanism lives in ``parallel/`` (one folder per capability); the DeepSpeed-named modules at
  the root (``zero``, ``checkpointing``, ``pipe``, ``utils``, ``runtime``) only give it DeepSpeed's
  names, so ``parallel/`` never imports them (else the surface and the mechanism would tangle).
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


DEEPSPEED_SURFACE = (
    "shardwise.zero",
    "shardwise.checkpointing",
    "shardwise.pipe",
    "shardwise.utils",
    "shardwise.runtime",
    "shardwise.moe",
)
CAPABILITIES = ("data", "zero", "tensor", "pipeline", "activation", "moe", "context")


def _deps_of(prefix: str) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {
        mod: {d for node in ast.walk(tree) for d in _imported(mod, path, node, known)}
        for mod, (path, tree) in mods.items()
        if mod.startswith(prefix)
    }


def test_parallel_never_imports_the_deepspeed_named_surface():
    bad = {
        mod: sorted(d for d in deps if d.startswith(DEEPSPEED_SURFACE))
        for mod, deps in _deps_of("shardwise.parallel").items()
    }
    bad = {mod: deps for mod, deps in bad.items() if deps}
    assert not bad, f"parallel/ imports the DeepSpeed-named surface (import the mechanism): {bad}"


def test_surface_modules_only_re_export():
    """The DeepSpeed-named root modules define no function or class of their own."""
    files = [PACKAGE / "zero.py", PACKAGE / "checkpointing.py", *(PACKAGE / "utils").glob("*.py")]
    for path in files:
        name = path.relative_to(PACKAGE)
        tree = ast.parse(path.read_text())
        defined = [
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        ]
        assert not defined, f"shardwise/{name} defines {defined}: move them into the mechanism"


def test_parallel_is_one_folder_per_capability():
    folders = sorted(p.name for p in (PACKAGE / "parallel").iterdir() if p.is_dir())
    folders = [f for f in folders if f != "__pycache__"]
    assert folders == sorted(CAPABILITIES), f"parallel/ holds {folders}"
    loose = sorted(p.name for p in (PACKAGE / "parallel").glob("*.py"))
    shared = ["__init__.py", "exchange.py", "flat.py", "remap.py", "strategies.py", "strategy.py"]
    assert loose == shared, (
        f"parallel/ files outside a capability folder: {loose} (only what several capabilities share stays)"
    )
