"""torch's private API is touched only behind one fence: ``dstest/worlds/torch_internals/`` (issue 41).

Every use of a private name of torch (a name starting with "_" reached through ``torch``, ``torch.distributed``,
``distributed_c10d`` or any alias of them, or anything imported from a torch module path with a private part,
such as ``torch.testing._internal``) lives in a module of the fence, which names the torch behaviour it relies
on and the torch versions it was seen on. A new torch version then breaks dstest in one package, which the tox
matrix exercises per version, not in whichever module happened to reach in. This test reads every other
module of ``dstest/`` with :mod:`ast` and lists each such use as ``file:line: name``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dstest"
FENCE = PACKAGE / "worlds" / "torch_internals"

#: Uses outside the fence that are known and about to move, by (file, name): each with its reason.
ALLOWED: dict[tuple[str, str], str] = {}

#: Calls whose second argument names an attribute of their first.
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")
#: Calls that return a module by its dotted name (``sys.modules.get`` is matched by its last part).
_MODULE_CALLS = ("import_module", "__import__", "get")


def _private(part: str) -> bool:
    """A private name: a leading underscore, not a dunder (``__init__``, ``__class__`` are everyone's)."""
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_path(path: str) -> bool:
    return any(_private(part) for part in path.split(".")[1:])


def _is_torch(path: str) -> bool:
    return path == "torch" or path.startswith("torch.")


def _literal(node: ast.AST | None) -> str | None:
    """The text of a string constant, or the constant start of an f-string (``f"_get_{name}"``: ``_get_``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


class _Scan:
    """The private torch names one module's source touches."""

    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        #: name -> the torch path it is bound to anywhere in the module (scopes are not told apart: a name
        #: bound to torch in one function is taken as torch in every function, which can only find more).
        self.bound: dict[str, str] = {"torch": "torch"}
        self.found: list[tuple[int, str]] = []
        self._parent_of: dict[int, ast.AST] = {}

    def run(self) -> list[tuple[int, str]]:
        for node in ast.walk(self.tree):
            self._bind_import(node)
        for _ in range(3):  # aliases of aliases (``c10d = dist.distributed_c10d; w = c10d._world``)
            for node in ast.walk(self.tree):
                self._bind_assignment(node)
        for node in ast.walk(self.tree):
            self._check(node)
        return sorted(set(self.found))

    # -- what each name is bound to --------------------------------------------------------------------------
    def _bind_import(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_torch(alias.name):
                    continue
                if _private_path(alias.name):
                    self.found.append((node.lineno, f"import {alias.name}"))
                if alias.asname is not None:
                    self.bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_torch(node.module):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if _private_path(path):
                    self.found.append((node.lineno, f"from {node.module} import {alias.name}"))
                self.bound[alias.asname or alias.name] = path

    def _bind_assignment(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            return
        path = self._path(value)
        if path is None:
            return
        if self._module_lookup(value) is None and any(isinstance(n, (ast.Call, ast.Subscript)) for n in _chain(value)):
            path = "torch.<value>"  # what a torch function returned: its own private attributes are still found
        for target in targets:
            if isinstance(target, ast.Name):
                self.bound.setdefault(target.id, path)

    def _module_lookup(self, node: ast.AST) -> str | None:
        """A torch module looked up by name: ``sys.modules.get("torch")``, ``importlib.import_module("torch._C")``,
        ``sys.modules["torch"]``."""
        if isinstance(node, ast.Call):
            func = node.func
            last = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            name = _literal(node.args[0]) if node.args else None
            if last in _MODULE_CALLS and name is not None and _is_torch(name):
                return name
        if isinstance(node, ast.Subscript):
            key = _literal(node.slice)
            if key is not None and _is_torch(key) and ast.unparse(node.value).endswith("modules"):
                return key
        return None

    def _path(self, node: ast.AST) -> str | None:
        """The torch path an expression stands for: a chain of attributes, calls and subscripts on a bound
        name (``torch._C._nn``, ``dist.new_group()``), or a torch module looked up by name."""
        module = self._module_lookup(node)
        if module is not None:
            return module
        if isinstance(node, ast.Call):
            return self._path(node.func)
        if isinstance(node, ast.Subscript):
            return self._path(node.value)
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        return None

    # -- what is touched -----------------------------------------------------------------------------------------
    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Attribute) and not self._inner(node):
            path = self._path(node)
            if path is not None and _private_path(path):
                text = ast.unparse(node)
                self.found.append((node.lineno, text if len(text) < 80 else path))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_CALLS:
            name = _literal(node.args[1]) if len(node.args) > 1 else None
            owner = self._path(node.args[0]) if node.args else None
            if name is not None and owner is not None and _private(name):
                self.found.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {name!r})"))
        elif isinstance(node, ast.Call) and not self._inner(node):
            module = self._module_lookup(node)
            if module is not None and _private_path(module):
                self.found.append((node.lineno, f"{ast.unparse(node.func)}({module!r})"))

    def _inner(self, node: ast.AST) -> bool:
        """Whether the node is the head of a longer chain (``torch._C`` in ``torch._C._nn.linear``, or
        ``torch._neg_view`` in ``torch._neg_view(t).cpu()``): only the whole chain is reported."""
        parent = self._parents().get(id(node))
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return True
        if (isinstance(parent, ast.Call) and parent.func is node) or (
            isinstance(parent, ast.Subscript) and parent.value is node
        ):
            return self._inner(parent)
        return False

    def _parents(self) -> dict[int, ast.AST]:
        if not self._parent_of:
            self._parent_of.update(
                {id(child): node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}
            )
        return self._parent_of


def _chain(node: ast.AST) -> list[ast.AST]:
    """The nodes of an attribute chain from its end to its root (through calls and subscripts)."""
    nodes = [node]
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if isinstance(node, (ast.Attribute, ast.Subscript)) else node.func
        nodes.append(node)
    return nodes


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for each private torch name the module's source touches."""
    return _Scan(source).run()


def _outside_fence() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if FENCE not in p.parents)


def test_no_private_torch_name_outside_the_fence() -> None:
    """Every private torch name is touched in ``dstest/worlds/torch_internals/``, nowhere else."""
    found, allowed_seen = [], set()
    for path in _outside_fence():
        rel = path.relative_to(ROOT).as_posix()
        for line, name in private_torch_uses(path.read_text(encoding="utf-8")):
            if (rel, name) in ALLOWED:
                allowed_seen.add((rel, name))
            else:
                found.append(f"{rel}:{line}: {name}")
    assert not found, (
        f"{len(found)} uses of torch's private names outside dstest/worlds/torch_internals/ (move each into a "
        "function of the fence that names the torch behaviour and versions it relies on):\n" + "\n".join(found)
    )
    assert allowed_seen == set(ALLOWED), f"allowed but no longer found (drop them): {set(ALLOWED) - allowed_seen}"


_EVERY_FORM = """
import sys, importlib
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d_a
from torch.distributed import distributed_c10d as c10d_b
from torch.distributed import distributed_c10d
from torch._C import _distributed_c10d as c10d_c
from torch.testing._internal import common_distributed as cd
from torch.distributed import _Work
import torch._C._nn as nn_c

def f(x, y):
    torch._C._autograd._unsafe_set_version_counter(x, y)
    dist._Work
    c10d_a._world
    c10d_b._get_default_group()
    distributed_c10d._world.pg_map
    c10d_c.PrefixStore
    cd.get_timeout("t")
    c = torch._C
    c.foo
    getattr(c10d_b, "_abort_process_group", None)
    getattr(torch, f"_get_{y}", None)
    t = sys.modules.get("torch")
    t._tensor_str.PRINT_OPTS
    importlib.import_module("torch.testing._internal.common_utils")
    dist.new_group()._get_backend_name()
    torch.distributed.group.WORLD
    x.__class__
    dist.all_reduce(x)
"""


def test_the_scan_finds_every_form_of_reaching_in() -> None:
    """Each way a module can reach a private torch name is found, and public names are not."""
    found = [name for _, name in private_torch_uses(_EVERY_FORM)]
    assert found == [
        "from torch._C import _distributed_c10d",
        "from torch.testing._internal import common_distributed",
        "from torch.distributed import _Work",
        "import torch._C._nn",
        "torch._C._autograd._unsafe_set_version_counter",
        "dist._Work",
        "c10d_a._world",
        "c10d_b._get_default_group",
        "distributed_c10d._world.pg_map",
        "c10d_c.PrefixStore",
        "cd.get_timeout",
        "torch._C",
        "c.foo",
        "getattr(c10d_b, '_abort_process_group')",
        "getattr(torch, '_get_')",
        "t._tensor_str.PRINT_OPTS",
        "importlib.import_module('torch.testing._internal.common_utils')",
        "dist.new_group()._get_backend_name",
    ], found


def test_the_fence_exports_its_api_in_order() -> None:
    """The fence's API to the rest of dstest: ``__all__`` sorted, every name in it defined."""
    import dstest.worlds.torch_internals as fence

    assert fence.__all__ == sorted(fence.__all__)
    assert [name for name in fence.__all__ if not hasattr(fence, name)] == []
