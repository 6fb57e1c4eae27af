"""Checking the checkers: the warm server's staleness check (contract F3), as properties.

:mod:`dstest.pytest.warm.sources` decides whether a warm server may fork a run: every file it imported must
hold the bytes it imported, and a fresh import of each of its top-level modules must find the same file. Here
it is driven on files alone, as the server drives it: random modules (plain files and packages, on two
``sys.path`` entries, some names on both), the stamps taken after a time taken before the "import", then one
random change. The check must say stale exactly when a fresh run would import something else:

- stale: a byte changed in place with the size and ``mtime`` put back (``os.utime``), a size changed, a file
  removed, a file replaced by another's bytes, a new file that a fresh import finds first (a module or a
  package earlier on the path, a package beside a module of its name), and any change of a file the import read
  between the time taken before the import and the stamps (the server cannot know which version it read,
  so even a touch there counts);
- not stale: nothing done, a touch (new times, the same bytes), the same bytes written again or moved over
  the file, a new module no one imports, a new file a fresh import does not find first (later on the path, a
  module beside a package of its name, a directory without ``__init__.py``).

Decided and documented (docs/deepspeed.md, Warm sessions): a touch without a change of bytes after the
server's stamps is not stale. A touch followed, within the same tick of the file system's clock, by a
change that puts the touched times back must still be seen (the stamp of a touched file is not trusted
until its change is older than the margin).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import types
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstest.pytest.warm.sources import Sources, resolve
from dstest.pytest.warm.staleness import BUILT_FROM, imported_files

pytestmark = pytest.mark.cpu


def _clock_tick_ns() -> int:
    """The step of this file system's ``ctime`` clock (the largest of a few), in a temporary directory."""
    steps = []
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "f")
        for _ in range(3):
            with open(path, "wb") as f:
                f.write(b"x")
            first = os.stat(path).st_ctime_ns
            deadline = time.monotonic() + 3
            while (now := os.stat(path).st_ctime_ns) == first and time.monotonic() < deadline:
                os.utime(path)
            steps.append(now - first)
    return max(steps)


_TICK_NS = _clock_tick_ns()
if _TICK_NS > 100_000_000:
    pytest.skip(
        f"this file system's clock ticks every {_TICK_NS / 1e9:.2f} s: a quick property run needs a finer one",
        allow_module_level=True,
    )
#: The margin the check runs with here: a few ticks (the server's is 2 s, for any file system).
MARGIN_NS = max(20_000_000, 4 * _TICK_NS)

NAMES = ["m0", "m1", "m2", "m3"]
#: Where a module lives: a file in entry a, in b, in both (a's is found), a package in a, or in b.
PLACEMENTS = ["a", "b", "ab", "pkg_a", "pkg_b"]


@dataclass
class Tree:
    """The two ``sys.path`` entries of one example and the modules on them."""

    a: str
    b: str

    @property
    def entries(self) -> list[str]:
        return [self.a, self.b]

    def origin(self, name: str) -> str | None:
        """Where a fresh import finds ``name``, by the rules this test relies on: the first entry that has it;
        in one entry a package (a directory with ``__init__.py``) before a module file; a directory without
        ``__init__.py`` only when no entry has a module or package of that name (a namespace: no file)."""
        for entry in self.entries:
            init = os.path.join(entry, name, "__init__.py")
            if os.path.isfile(init):
                return init
            if os.path.isfile(os.path.join(entry, name + ".py")):
                return os.path.join(entry, name + ".py")
        return None


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _build(root: str, layout: dict[str, tuple[str, bytes, bytes]]) -> tuple[Tree, list[str]]:
    """The modules of ``layout`` (name: placement, its bytes, its submodule's bytes) on disk; returns the tree
    and the files an import of every name (and of each package's submodule ``sub``) reads."""
    tree = Tree(os.path.join(root, "a"), os.path.join(root, "b"))
    os.makedirs(tree.a)
    os.makedirs(tree.b)
    for name, (placement, data, sub) in layout.items():
        for entry, where in ((tree.a, "a"), (tree.b, "b")):
            if placement in (where, "ab"):
                _write(os.path.join(entry, name + ".py"), data)
            elif placement == f"pkg_{where}":
                _write(os.path.join(entry, name, "__init__.py"), data)
                _write(os.path.join(entry, name, "sub.py"), sub)
    read = []
    for name in layout:
        origin = tree.origin(name)
        assert origin is not None
        read.append(origin)
        if origin.endswith("__init__.py"):
            read.append(os.path.join(os.path.dirname(origin), "sub.py"))
    return tree, read


def _flip(path: str, at: int) -> None:
    """Change one byte in place and put the size and both times back: only ``ctime`` and the bytes differ."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[at % len(data)] ^= 0x01
        f.seek(0)
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _touch(path: str) -> None:
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))


def _replace(path: str, data: bytes) -> None:
    """Write ``data`` to a new file and move it over ``path`` (as editors save): another inode."""
    temp = path + ".new"
    _write(temp, data)
    os.replace(temp, path)


def _bytes_of(paths: list[str]) -> dict[str, bytes | None]:
    found: dict[str, bytes | None] = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                found[path] = f.read()
        except OSError:
            found[path] = None
    return found


layouts = st.dictionaries(
    st.sampled_from(NAMES),
    st.tuples(st.sampled_from(PLACEMENTS), st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=64)),
    min_size=1,
)

#: Changes made after the stamps, to one file the import read (``path``), or beside the modules (``name``).
AFTER = [
    "nothing",
    "flip",  # a byte, size and mtime put back
    "grow",
    "remove",
    "replace_other",  # another file's bytes moved over it
    "replace_same",  # the same bytes moved over it
    "rewrite_same",
    "touch",
    "touch_then_flip",  # a check between the two: the touched stamp must not be trusted yet
    "new_module_a",  # a/<name>.py
    "new_package_a",  # a/<name>/__init__.py
    "new_module_b",  # b/<name>.py
    "new_namespace_a",  # a/<name>/ without __init__.py
    "new_unimported",  # a/other.py
]
#: Changes between the time taken before the import and the stamps: whatever the server read, it cannot tell.
DURING = ["flip_during", "touch_during", "new_module_a_during"]


@given(layout=layouts, change=st.sampled_from(AFTER + DURING), pick=st.integers(0, 1000), extra=st.binary(max_size=8))
def test_stale_exactly_when_a_fresh_import_would_read_other_bytes(
    layout: dict[str, tuple[str, bytes, bytes]], change: str, pick: int, extra: bytes
) -> None:
    with tempfile.TemporaryDirectory() as root:
        tree, read = _build(root, layout)
        names = sorted(layout)
        name = names[pick % len(names)]
        path = read[pick % len(read)]
        origins = {n: tree.origin(n) for n in names}
        imported = _bytes_of(read)
        time.sleep((MARGIN_NS + _TICK_NS) / 1e9)  # the files are older than the server's start by the margin
        since = time.time_ns()
        resolved_before = resolve(names, tree.entries)  # by the process that starts the server
        during = change in ("flip_during", "touch_during")  # a file read by the import changed: unknowable
        if change == "flip_during":
            _flip(path, pick)
        elif change == "touch_during":
            _touch(path)
        elif change == "new_module_a_during":
            _write(os.path.join(tree.a, name + ".py"), b"shadow")
        sources = Sources.take(read, names, tree.entries, since, resolved_before, margin_ns=MARGIN_NS)

        if change == "flip" or change == "touch_then_flip":
            if change == "touch_then_flip":
                _touch(path)
                assert sources.changed() is None, "a touch alone is not a change"
            _flip(path, pick)
        elif change == "grow":
            with open(path, "ab") as f:
                f.write(b"+" + extra)
        elif change == "remove":
            os.remove(path)
        elif change == "replace_other":
            _replace(path, imported[path] + b"+" + extra)  # type: ignore[operator]
        elif change == "replace_same":
            _replace(path, imported[path])  # type: ignore[arg-type]
        elif change == "rewrite_same":
            _write(path, imported[path])  # type: ignore[arg-type]
        elif change == "touch":
            _touch(path)
        elif change == "new_module_a":
            _write(os.path.join(tree.a, name + ".py"), extra)
        elif change == "new_package_a":
            _write(os.path.join(tree.a, name, "__init__.py"), extra)
        elif change == "new_module_b":
            _write(os.path.join(tree.b, name + ".py"), extra)
        elif change == "new_namespace_a":
            os.makedirs(os.path.join(tree.a, name), exist_ok=True)
        elif change == "new_unimported":
            _write(os.path.join(tree.a, "other.py"), extra)

        other_bytes = _bytes_of(read) != imported
        other_file = {n: tree.origin(n) for n in names} != origins
        stale = during or other_bytes or other_file
        why = sources.changed()
        assert (why is not None) == stale, (change, layout, name, path, why)
        assert (sources.changed() is not None) == stale, "a second check says the same"
        for entry in tree.entries:  # the finders of this example's directories are not needed again
            sys.path_importer_cache.pop(entry, None)


def test_the_digest_not_the_times_decides() -> None:
    """One case spelled out: the same size and ``mtime`` after a change of bytes is stale; a file touched
    without a change is not, and the check names the file."""
    with tempfile.TemporaryDirectory() as root:
        tree, read = _build(root, {"m0": ("a", b"VALUE = 1\n", b"")})
        time.sleep((MARGIN_NS + _TICK_NS) / 1e9)
        since = time.time_ns()
        sources = Sources.take(read, ["m0"], tree.entries, since, resolve(["m0"], tree.entries), MARGIN_NS)
        _touch(read[0])
        assert sources.changed() is None
        _flip(read[0], 8)
        assert sources.changed() == f"{read[0]} changed after the warm server imported it"


def test_an_entry_the_imports_appended_is_not_a_change() -> None:
    """The look-up made before the server started is compared on the ``sys.path`` it was made on. An import
    may append an entry (setuptools appends its ``_vendor`` directory, and torch 2.15 imports setuptools):
    a module found only there was not found before the server started, and a fresh run finds it the same
    way, through the same import. A copy that appears on the first entry later is still a change."""
    with tempfile.TemporaryDirectory() as root:
        tree, read = _build(root, {"m0": ("b", b"VALUE = 1\n", b"")})
        time.sleep((MARGIN_NS + _TICK_NS) / 1e9)
        since = time.time_ns()
        before = resolve(["m0"], [tree.a])  # the cold run's sys.path at its start: b is not on it yet
        assert before == {"m0": None}
        sources = Sources.take(read, ["m0"], tree.entries, since, before, MARGIN_NS, entries_before=[tree.a])
        assert sources.changed() is None
        _write(os.path.join(tree.a, "m0.py"), b"VALUE = 2\n")
        assert sources.changed() == f"module 'm0' would now be imported from {tree.a}/m0.py (the server has None)"
        sys.path_importer_cache.pop(tree.a, None)
        sys.path_importer_cache.pop(tree.b, None)


def test_a_library_dstest_built_is_watched_through_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library dstest builds (the C call records) names the source it was built from (``BUILT_FROM``): the
    server watches that source instead of the library. The library may have been written by the cold run
    moments before the server started, when its stamp cannot be trusted: watched itself, it would make every
    first warm run after a build cold (and name a file the user never touched). An edit of the source is a
    change: the library built from it is no longer the one the next run would load."""
    with tempfile.TemporaryDirectory() as root:
        source = os.path.join(root, "lib.cpp")
        _write(source, b"int answer() { return 42; }\n")
        time.sleep((MARGIN_NS + _TICK_NS) / 1e9)
        library = os.path.join(root, "built", "lib.so")
        _write(library, b"\x7fELF built just now")  # by the cold run, just before the server started
        since = time.time_ns()

        def watched(files: list[str]) -> list[str]:
            return [f for f in files if f.startswith(root)]

        plain = types.ModuleType("dstest_test_built_lib")
        plain.__file__ = library
        monkeypatch.setitem(sys.modules, plain.__name__, plain)
        assert watched(imported_files()) == [library]
        unknown = Sources.take([library], [], [root], since, {}, MARGIN_NS)
        assert (
            unknown.changed()
            == f"{library} changed while the warm server was starting (which version it imported is unknown)"
        )

        setattr(plain, BUILT_FROM, (source,))
        assert watched(imported_files()) == [source]
        sources = Sources.take(watched(imported_files()), [], [root], since, {}, MARGIN_NS)
        assert sources.changed() is None
        _write(library, b"\x7fELF built again")  # the same source built again: not a change
        assert sources.changed() is None
        _flip(source, 5)
        assert sources.changed() == f"{source} changed after the warm server imported it"


@settings(max_examples=40)
@given(
    source_bytes=st.binary(min_size=1, max_size=200),
    rebuilt=st.binary(max_size=64),
    at=st.integers(0, 10_000),
    bit=st.integers(0, 7),
    sources=st.integers(1, 3),
)
def test_a_built_library_is_stale_exactly_when_a_source_byte_changed(
    source_bytes: bytes, rebuilt: bytes, at: int, bit: int, sources: int
) -> None:
    """The same as a property: a library naming 1-3 sources (``BUILT_FROM``) is never watched itself, and
    rewriting it with any bytes (a rebuild) is no change; one bit flipped anywhere in any of its sources is
    a change naming that source."""
    name = "dstest_test_built_lib_prop"
    with tempfile.TemporaryDirectory() as root:
        paths = [os.path.join(root, f"src{i}.cpp") for i in range(sources)]
        for path in paths:
            _write(path, source_bytes)
        time.sleep((MARGIN_NS + _TICK_NS) / 1e9)
        library = os.path.join(root, "built", "lib.so")
        _write(library, b"\x7fELF")
        since = time.time_ns()
        module = types.ModuleType(name)
        module.__file__ = library
        setattr(module, BUILT_FROM, tuple(paths))
        sys.modules[name] = module
        try:
            watched = [f for f in imported_files() if f.startswith(root)]
        finally:
            del sys.modules[name]
        assert watched == paths
        taken = Sources.take(watched, [], [root], since, {}, MARGIN_NS)
        _write(library, rebuilt)
        assert taken.changed() is None
        target = paths[at % sources]
        before = os.stat(target)
        with open(target, "r+b") as f:
            data = bytearray(f.read())
            data[at % len(data)] ^= 1 << bit
            f.seek(0)
            f.write(data)
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert taken.changed() == f"{target} changed after the warm server imported it"
