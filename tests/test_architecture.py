"""The architecture's rules, checked on the source (issue 12): what a newcomer may rely on.

* Every process group is made in ``topology.py`` (``ProcessMesh`` and ``new_subgroup``): group
  creation is a collective every rank must call in the same order, so it lives in one place,
  with the world's timeout and a name for errors.
* No import cycle between shardwise modules, counting every import (module-level, inside a
  function, under ``TYPE_CHECKING``): a cycle makes import order matter and pushes imports into
  functions, and a cycle hidden in a function or in annotations is still two modules that
  cannot be read apart.
* The engine hands parts down (issue 24): no module outside ``shardwise.training`` imports the
  ``Engine`` class (pure re-export modules of DeepSpeed's names excepted) or assigns into an
  ``engine.`` attribute; docs/architecture.md names only modules that exist.
* The mechanism lives in the capability folders (``parallel/`` one folder per parallelism,
  ``devices/``, ``optim/``, ...); the DeepSpeed-named paths (``DEEPSPEED_SURFACE``) only give it
  DeepSpeed's names: each of their modules is imports, assignments and a docstring (or refuses a
  DeepSpeed module by raising ``NotProvidedError``), and no module outside them imports them
  (else the surface and the mechanism would tangle).
"""

from __future__ import annotations

import ast
import re
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
        mod: {d for node in ast.walk(tree) for d in _imported(mod, path, node, known)}
        for mod, (path, tree) in mods.items()
    }
    cycles = _cycles(edges)
    assert not cycles, f"import cycles (every import, function-local and TYPE_CHECKING): {cycles}"


def _reexport_only(tree: ast.Module) -> bool:
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)
    return all(
        isinstance(n, allowed) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        for n in tree.body
    )


def test_only_training_imports_the_engine_or_writes_into_it():
    importers, writes = [], []
    for mod, (_path, tree) in _modules().items():
        if mod.startswith("shardwise.training"):
            continue
        for node in ast.walk(tree):
            names = node.names if isinstance(node, ast.ImportFrom) else []
            if any(a.name == "Engine" for a in names) and not _reexport_only(tree):
                importers.append(mod)
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            for t in targets if isinstance(node, (ast.Assign, ast.AugAssign)) else []:
                root = t
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if isinstance(root, ast.Name) and root.id == "engine" and root is not t:
                    writes.append(f"{mod}:{node.lineno}")
    assert not importers, f"modules outside shardwise.training importing Engine: {importers}"
    assert not writes, f"assignments into an engine outside shardwise.training: {writes}"


def test_the_architecture_page_names_modules_that_exist():
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", doc))
    root = SRC.parent
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    files |= {str(p.relative_to(root)) for p in (root / "tests").glob("*.py")}
    files |= {p.name for p in (root / "tests").glob("*.py")} | {"src/" + f for f in files}
    files |= {f"src/shardwise/{p.relative_to(PACKAGE)}" for p in PACKAGE.rglob("*.py")}
    missing = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


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


# Every path that exists to give DeepSpeed's import paths (a package stands for its modules).
DEEPSPEED_SURFACE = (
    "shardwise.accelerator",
    "shardwise.checkpointing",
    "shardwise.launcher",
    "shardwise.moe",
    "shardwise.ops",
    "shardwise.pipe",
    "shardwise.runtime",
    "shardwise.utils",
    "shardwise.zero",
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


def _on_surface(mod: str) -> bool:
    return any(mod == s or mod.startswith(s + ".") for s in DEEPSPEED_SURFACE)


def test_the_mechanism_never_imports_the_deepspeed_named_surface():
    """Only the package's ``__init__`` (the public surface) and the surface itself import it."""
    bad = {
        mod: sorted(d for d in deps if _on_surface(d))
        for mod, deps in _deps_of("shardwise").items()
        if mod != "shardwise" and not _on_surface(mod)
    }
    bad = {mod: deps for mod, deps in bad.items() if deps}
    assert not bad, (
        f"the mechanism imports the DeepSpeed-named surface (import the mechanism): {bad}"
    )


def _refusal(node: ast.stmt) -> bool:
    """``raise NotProvidedError(...)``: a DeepSpeed module refused, naming what to use."""
    return (
        isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and ast.unparse(node.exc.func) == "NotProvidedError"
    )


def test_surface_modules_only_re_export():
    """The DeepSpeed-named paths define nothing of their own: imports, assignments (``__all__``,
    DeepSpeed's spellings, a refusing ``__getattr__``) and a docstring, or a refusal."""
    surface = {mod: path for mod, (path, _) in _modules().items() if _on_surface(mod)}
    assert len(surface) >= len(DEEPSPEED_SURFACE), f"surface modules not found: {surface}"
    for mod, path in sorted(surface.items()):
        tree = ast.parse(path.read_text())
        own = [
            f"{type(node).__name__} at line {node.lineno}"
            for node in tree.body
            if not (_reexport_only(ast.Module(body=[node], type_ignores=[])) or _refusal(node))
        ]
        assert not own, f"{mod} holds {own}: move it into the mechanism and re-export it"


def test_parallel_is_one_folder_per_capability():
    folders = sorted(p.name for p in (PACKAGE / "parallel").iterdir() if p.is_dir())
    folders = [f for f in folders if f != "__pycache__"]
    assert folders == sorted(CAPABILITIES), f"parallel/ holds {folders}"
    loose = sorted(p.name for p in (PACKAGE / "parallel").glob("*.py"))
    shared = [
        "__init__.py",
        "clip.py",
        "compile.py",  # torch.compile regions: every capability's hooks and collectives
        "exchange.py",
        "flat.py",
        "remap.py",
        "strategy_contract.py",
        "strategy_table.py",
        "weak_hooks.py",  # the gradient hooks of data parallelism and ZeRO (no cycle kept)
    ]
    assert loose == shared, (
        f"parallel/ files outside a capability folder: {loose} (only what several capabilities share stays)"
    )
