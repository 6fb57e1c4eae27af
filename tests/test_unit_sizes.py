"""Issue 41's sizes: no module of dstest over 500 lines, no function over 60, no class over 250.

A unit that grows past its limit is split by job; an exception is listed here with why, and the test fails
when a listed exception is no longer needed, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent / "dstest"
MODULE_LINES, FUNCTION_LINES, CLASS_LINES = 500, 60, 250

#: "path" or "path:qualified name" -> why it may be larger. None today.
EXCEPTIONS: dict[str, str] = {}


def _oversized() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        name = str(path.relative_to(ROOT.parent))
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            found[name] = lines
        found.update(_oversized_units(ast.parse(source), name, ""))
    return found


def _oversized_units(tree: ast.AST, name: str, prefix: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            qualified = f"{prefix}{node.name}"
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
            if size > limit:
                found[f"{name}:{qualified}"] = size
            found.update(_oversized_units(node, name, f"{qualified}."))
        else:
            found.update(_oversized_units(node, name, prefix))
    return found


def test_no_unit_of_dstest_is_over_its_size():
    oversized = _oversized()
    unexplained = {unit: size for unit, size in oversized.items() if unit not in EXCEPTIONS}
    assert not unexplained, (
        f"over the limits (modules {MODULE_LINES}, functions {FUNCTION_LINES}, classes {CLASS_LINES} lines): "
        f"{unexplained}; split by job, or list the unit in EXCEPTIONS with why"
    )
    stale = sorted(set(EXCEPTIONS) - set(oversized))
    assert not stale, f"listed as exceptions but within the limits now: {stale}"


def test_the_size_check_sees_a_long_function_and_a_nested_one(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    tree = ast.parse(f"def long():\n{body}\n\nclass C:\n    def method(self):\n{body.replace('    ', '        ')}\n")
    assert _oversized_units(tree, "m.py", "") == {"m.py:long": FUNCTION_LINES + 1, "m.py:C.method": FUNCTION_LINES + 1}


def _private_imports() -> list[str]:
    """``from dstest.x import _name`` where ``_name`` is not a module: a name private to its module, used
    by another (issue 41: the underscore must say "this module only")."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dstest"):
                base = ROOT.parent.joinpath(*(node.module or "").split("."))
                for alias in node.names:
                    name = alias.name
                    private = name.startswith("_") and not name.startswith("__")
                    is_module = (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()
                    if private and not is_module:
                        found.append(f"{path.relative_to(ROOT.parent)}: {node.module}.{name}")
    return found


def test_no_underscore_name_is_imported_across_modules():
    assert _private_imports() == []
