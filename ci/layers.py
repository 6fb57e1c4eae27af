"""The layers of ``dstest`` (and ``impl`` beside it), and a check that every import goes downwards.

The drawing of ``docs/architecture.md`` as data: each module of ``dstest`` belongs to one layer (the longest
prefix in :data:`LAYERS` that names it); a module may import modules of its own layer and of the layers
below it, never above. ``impl`` (the runtime under test) imports nothing of ``dstest``. Imports are read
with :mod:`ast` as ``ci/import_cycles.py`` reads them (module level and inside functions; not those under
``if TYPE_CHECKING:``).

Prints every import that goes up a layer (importer, line, imported module, both layers) and exits 1 if there
is any; exits 0 and prints "layers hold" otherwise. ``--table`` prints the layers as the docs show them.

Usage: ``python ci/layers.py [ROOT]`` (ROOT: the repository, default the parent of ``ci/``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_cycles import _imports, _resolve, module_files

#: Lowest first. Each entry: the layer's name, what it holds, and the module prefixes in it.
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "base",
        "errors, the registry of target and world names, argument checks, the torch-free matching core, lazy exports",
        (
            "dstest.errors",
            "dstest.registry",
            "dstest.resets",
            "dstest.worlds.protocol",
            "dstest.worlds.core",
            "dstest._lazy",
        ),
    ),
    (
        "trace",
        "the records of every collective of a run, and how two runs' results and traces are compared",
        ("dstest.trace", "dstest.compare"),
    ),
    (
        "rank",
        "what a rank body sees: its context, group and shard helpers, replica checks, the target adapter interface",
        ("dstest.context", "dstest.groups", "dstest.shards", "dstest.replicas", "dstest.targets.base"),
    ),
    ("worlds", "the worlds that run a function on ranks: fake, threaded, process, launched, nccl", ("dstest.worlds",)),
    (
        "spec",
        "specs and runs: @dstest.spec, dstest.run, target binding, programs, strategies, crosscheck",
        ("dstest.specification", "dstest.binding", "dstest.programs", "dstest.strategies", "dstest.crosscheck"),
    ),
    (
        "targets",
        "the systems under test and the conformance specs they are held to",
        ("dstest.targets", "dstest.conformance"),
    ),
    ("report", "conformance reports: terminal, JSON, JUnit, HTML, progress", ("dstest.report",)),
    (
        "front",
        "what users start: the pytest plugin and fixtures, the CLI, plugins that run other projects' suites",
        ("dstest.pytest", "dstest.cli", "dstest.__main__", "dstest.compat", "dstest"),
    ),
)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (longest prefix wins), or None outside ``dstest``."""
    best: tuple[int, int] | None = None
    for index, (_, _, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def violations(root: Path) -> list[str]:
    """Every import that goes up a layer, or from ``impl`` into ``dstest``, as one line each."""
    modules = module_files(root)
    found: list[str] = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [_resolve(module, is_package, node)]
            )
            if isinstance(node, ast.ImportFrom):  # ``from pkg import sub``: the submodule where there is one
                base = names[0]
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in names:
                problem = _problem(module, target)
                if problem:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {problem}")
    return sorted(set(found))


def _problem(module: str, target: str) -> str | None:
    if module.startswith("impl") and (target == "dstest" or target.startswith("dstest.")):
        return f"{module} imports {target}: impl (the runtime under test) never imports dstest"
    mine, theirs = layer_of(module), layer_of(target)
    if mine is None or theirs is None or theirs <= mine:
        return None
    if module == "dstest" or target == "dstest":  # the package's lazy exports name every layer
        return None
    return (
        f"{module} (layer {LAYERS[mine][0]!r}) imports {target} (layer {LAYERS[theirs][0]!r}): "
        "a module imports only its own layer and those below it (ci/layers.py, docs/architecture.md)"
    )


def table() -> str:
    """The layers as a Markdown table, top first (what docs/architecture.md shows)."""
    rows = ["| layer | holds | modules |", "|---|---|---|"]
    for name, what, prefixes in reversed(LAYERS):
        rows.append(f"| {name} | {what} | {', '.join(f'`{p}`' for p in prefixes)} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if "--table" in argv:
        print(table())
        return 0
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    found = violations(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} imports go up a layer")
        return 1
    print("layers hold")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
