"""Function references: how the parent names a rank function (:func:`function_ref`) and how a worker finds
it again (:func:`import_ref`: by name, or loaded from its file, with pytest's assertion rewriting
when the parent had it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from dstest.errors import (
    InvalidArgument,
)
from dstest.worlds.process.messages import FnRef
from dstest.worlds.protocol import rank_function_of


def function_ref(fn: Callable[..., Any]) -> FnRef:
    """How workers will find ``fn``; raises InvalidArgument when they could not."""
    body: Any = rank_function_of(fn)
    module_name = getattr(body, "__module__", None)
    qualname = getattr(body, "__qualname__", None)
    how = (
        "the process world sends functions to its worker processes by reference (module and name); "
        "define the function at module level"
    )
    if not module_name or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise InvalidArgument(f"fn={fn!r} cannot be found by name in another process: {how}")
    module = sys.modules.get(module_name)
    if module_name == "__main__" and not getattr(module, "__file__", None):
        raise InvalidArgument(f"fn={fn!r} lives in a __main__ without a file (python -c, a REPL): {how}")
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = None
    found = rank_function_of(obj)
    if module is not None and found is not body:
        # One body under several specs (``x = dstest.spec(...)(body)``): its name is the undecorated body,
        # the rank adapter lives in a spec wrapper under another module-level name.
        for name, value in vars(module).items():
            if value is not body and rank_function_of(value) is body:
                qualname, found = name, body
                break
    if module is None or found is not body:
        raise InvalidArgument(f"fn={fn!r} is not reachable as {module_name}.{qualname}: {how}")
    path = getattr(module, "__file__", None)
    return FnRef(module_name, qualname, os.path.abspath(path) if path else None, "@py_builtins" in vars(module))


def import_ref(ref: FnRef) -> Any:
    """The module ``ref`` names: already imported, importable by name, or loaded from its file."""
    module = sys.modules.get(ref.module)
    if module is not None and (ref.path is None or _same_file(getattr(module, "__file__", None), ref.path)):
        return module
    if ref.path is None:
        return importlib.import_module(ref.module)
    # Make the module's own imports work as they do under pytest's default import mode: the first
    # directory above it that is not a package goes on sys.path.
    base = os.path.dirname(os.path.abspath(ref.path))
    while os.path.isfile(os.path.join(base, "__init__.py")):
        base = os.path.dirname(base)
    if base not in sys.path:
        sys.path.insert(0, base)
    if not ref.rewrite_asserts:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(ref.module)
            if _same_file(getattr(module, "__file__", None), ref.path):
                return module
    return _load_from_path(ref.module, ref.path, ref.rewrite_asserts)


def _load_from_path(name: str, path: str, rewrite_asserts: bool) -> Any:
    """Load ``path`` as module ``name``, with pytest's assertion rewriting when the parent had it."""
    parent = name.rpartition(".")[0]
    if parent:
        with contextlib.suppress(ImportError):
            importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load module {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as f:
        source = f.read()
    code = None
    if rewrite_asserts:
        try:
            import ast

            from _pytest.assertion.rewrite import rewrite_asserts as rewrite

            tree = ast.parse(source, filename=path)
            rewrite(tree, source, path)
            code = compile(tree, path, "exec", dont_inherit=True)
        except Exception:
            code = None  # plain asserts still work, with less detail
    if code is None:
        code = compile(source, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
