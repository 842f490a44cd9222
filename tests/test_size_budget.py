"""Size budgets (style.md habit 11): files under 400 lines, functions under 60, in the package.

Exceptions must be listed here with the reason; none so far.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
FILES = sorted(SRC.rglob("*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_the_package_is_found():
    assert len(FILES) > 10, f"no sources under {SRC}: the budget test would check nothing"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_file_and_function_sizes(path):
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_FILE_LINES, (
        f"{path.relative_to(SRC)} has {lines} lines (> {MAX_FILE_LINES})"
    )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, (
                f"{path.relative_to(SRC)}:{node.lineno} {node.name} has {length} lines"
            )


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_public_functions_carry_type_hints(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            args = [a for a in node.args.args if a.arg not in ("self", "cls")]
            missing = [a.arg for a in args if a.annotation is None]
            assert not missing, f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {missing}"
            assert node.returns is not None or node.name == "__init__", (
                f"{path.relative_to(SRC)}:{node.lineno} {node.name} has no return annotation"
            )
