"""Whether a warm server's imports still fit the run: what the server takes stock of once it has imported
(the files and top-level modules that :mod:`dstest.pytest.warm.sources` then watches, which copy of each
package it loaded, which packages pytest rewrites), and what a forked session compares once its conftests
have run (``sys.path``, the environment, the copies of the packages, the warning filters).

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from dstest.pytest.warm.channel import VOLATILE_ENV


def loaded_origins() -> dict[str, str]:
    """The file of every top-level module imported now: which copy of a package this process uses (a
    plugin may have imported the installed one before a conftest put a checkout on ``sys.path``)."""
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." not in name and not name.startswith("__") and isinstance(path, str):
            found[name] = os.path.abspath(path)
    return found


def origins_differ(recorded: dict[str, str]) -> str | None:
    """The first top-level module whose file here is not the one the cold run ``recorded``, named; or None."""
    now = loaded_origins()
    for name, path in sorted(now.items()):
        if name in recorded and recorded[name] != path:
            return f"module {name!r} is {path} here, {recorded[name]} in the cold run"
    return None


def rewritten_by_pytest() -> set[str]:
    """Top-level names pytest rewrites on import in every session: those of distributions that install a
    pytest plugin by entry point. The server leaves them to the session."""
    import importlib.metadata

    names: set[str] = set()
    for dist in importlib.metadata.distributions():
        if not any(ep.group == "pytest11" for ep in dist.entry_points):
            continue
        for file in dist.files or []:
            parts = file.parts
            if len(parts) == 1 and parts[0].endswith(".py"):
                names.add(parts[0][:-3])
            elif len(parts) == 2 and parts[1] == "__init__.py" and ".dist-info" not in parts[0]:
                names.add(parts[0])
    return names


#: The attribute by which a library dstest builds (the C call records) names the sources it was built from.
BUILT_FROM = "__dstest_built_from__"


def imported_files() -> list[str]:
    """The file of every module imported now: those a loader read (their spec has a location), and any other
    module's ``__file__`` that is a file (``torch.ops`` names a ``_ops.py`` that is not one). A library dstest
    built names its sources in :data:`BUILT_FROM`: those are watched instead of the library, which is
    written once per source digest, atomically, and may be only moments old when a server starts (the cold
    run before it built it), so that its own stamp could never be trusted; its sources' can, and an edit of
    them is what makes the server's copy stale."""
    files: list[str] = []
    for module in list(sys.modules.values()):
        built_from = getattr(module, BUILT_FROM, None)
        if isinstance(built_from, tuple):
            files.extend(str(source) for source in built_from)
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        if getattr(getattr(module, "__spec__", None), "has_location", False) or os.path.isfile(path):
            files.append(path)
    return files


def top_level_names() -> list[str]:
    """The top-level modules imported now that a file provides, whose lookup on ``sys.path`` must not change."""
    names = []
    for name in sorted({n.partition(".")[0] for n in sys.modules}):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is not None and name != "__main__":
            names.append(name)
    return names


def session_differs(spec: dict[str, Any], config: Any) -> str | None:
    """In a forked session, once conftests and plugins are configured: None when ``sys.path`` and the
    environment are those the server (started from ``spec``) imported with; else the difference."""
    differ = origins_differ(spec["origins"])
    if differ is not None:
        return differ
    if spec.get("import_warnings") and _warnings_are_errors(config):
        return (
            f"warnings are errors in this run and the warm server's imports gave {len(spec['import_warnings'])} "
            f"warnings that it would not see (first: {spec['import_warnings'][0]})"
        )
    if list(sys.path) != list(spec["sys_path"]):
        return f"sys.path after configuration differs from the warm server's: {sys.path} != {spec['sys_path']}"
    env = dict(os.environ)
    names = sorted(k for k in set(env) | set(spec["env"]) if k not in VOLATILE_ENV and env.get(k) != spec["env"].get(k))
    if names:
        return f"the environment after configuration differs from the warm server's in {', '.join(names)}"
    return None


def _warnings_are_errors(config: Any) -> bool:
    """Whether a warning filter of this run (``-W``, the ini's ``filterwarnings``, ``PYTHONWARNINGS``) makes
    some warning an error: an import-time warning the server saw would then fail a cold run's collection."""
    filters = [*sys.warnoptions, *(config.known_args_namespace.pythonwarnings or []), *config.getini("filterwarnings")]
    return any(str(f).strip().startswith("error") for f in filters)
