"""Names a package exports without importing them with it (PEP 562): each is imported from its module when
first asked for, then kept in the package's namespace."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name of ``where`` is imported from the module it maps to and
    stored in ``namespace`` (the package's ``globals()``); any other name raises AttributeError."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
