"""Whether the sources a warm server imported are still those on disk (contract F3): the check the server makes
before every fork (:mod:`dstest.pytest.warm.server`).

A warm server may only fork a run when every file it imported holds the bytes it imported, and no directory
of ``sys.path`` now holds another copy of a top-level module it imported. Two things make that hard:

- **The stamp must not be later than the import.** A file's size and times read after the import say
  nothing about a change made during it (a developer edits a file while the server is still importing,
  right after the cold run). So a stamp is trusted only when the file's ``ctime`` (which every change of its
  bytes, size, times or name sets to the current time, and which no program can set to a time of its
  choosing) is older than a time taken before the server started (``since_ns``) by more than the margin
  of the file system's clock. Such a file has not changed since before the server read it. A file changed
  later (or within the margin) cannot be told from the one imported: the first check calls it changed, and
  the run is cold.
- **A stamp can stay the same across a change.** An edit can keep the size, a tool can put the old
  ``mtime`` back (``os.utime``, ``cp -p``, ``rsync -t``), and two changes within one tick of the file
  system's clock (4 ms on the machine measured below, 1 s or 2 s on some) get the same times. The stamp
  therefore includes ``ctime`` and the inode; and a stamp that differs is not taken as a change by itself:
  the file's digest, taken with the trusted stamp, decides. A file touched without a change of its bytes
  (a ``touch``, a save of the same text, a ``chmod``) is thus not stale; a file whose bytes changed is,
  whatever its times say.

Why not a digest of every file at every fork: over the 2,157 files (71 MB) a process has imported with torch
and its distributed test bases, the stamps take 12-37 ms and the digests 140-700 ms (2 busy cores, best of
5); so the digests are taken once, when the server has imported the files, and at a fork only of files
whose stamp changed. A stamp that changed while the bytes did not is taken as the file's stamp from then on
only once its ``ctime`` is older than the margin: a second change within the same tick could otherwise
keep the new stamp.

Another copy of a module: the top-level names the server imported are looked up again at every fork with
:class:`importlib.machinery.PathFinder` (10-36 ms for those 180 names) and compared with a look-up made
before the server started; a module inside a package is not looked up again (every one of the 2,156 would
be about 50 ms), so a new ``pkg/sub/`` beside an imported ``pkg/sub.py`` is not seen.

No torch, no pytest: the property tests (``tests/test_checker_properties_warm.py``) drive it on files alone.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

#: How much older than the server's start a file's last change must be for its stamp to be trusted: more than
#: a tick of any file system's clock (4 ms here; 1 s on ext3, 2 s on FAT) and a little clock skew.
MARGIN_NS = 2_000_000_000


class Stamp(NamedTuple):
    """What ``os.stat`` says of a file that any change of it changes (a tuple: made and compared thousands of
    times a fork)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> Stamp | None:
        """The file's stamp now, or None where there is no such file."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def digest(path: str) -> bytes | None:
    """A digest of the file's bytes (BLAKE2b, 16 bytes), or None where it cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return None
    return h.digest()


def resolve(names: Iterable[str], entries: list[str]) -> dict[str, str | None]:
    """Where a fresh import of each top-level name would find it on ``entries`` (a ``sys.path``): the file
    (``__init__.py`` for a package), or None for none, a namespace package or a module no file provides."""
    importlib.invalidate_caches()  # a directory's listing cached by an earlier lookup may be out of date
    found: dict[str, str | None] = {}
    for name in names:
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, entries)
        except (ImportError, ValueError, OSError):
            spec = None
        origin = spec.origin if spec is not None else None
        found[name] = origin if spec is not None and spec.has_location else None
    return found


@dataclass
class _File:
    stamp: Stamp | None  # None: the file was gone when the stamps were taken
    digest: bytes | None  # None: its bytes at import cannot be known (changed since the server started)


class Sources:
    """The files and top-level modules a server imported, as taken by :meth:`take`; :meth:`changed` says
    which of them is no longer what was imported."""

    def __init__(
        self,
        files: dict[str, _File],
        entries: list[str],
        origins: dict[str, str | None],
        margin_ns: int,
        baseline: tuple[list[str], frozenset[str]] = ([], frozenset()),
    ) -> None:
        self.files = files
        self.entries = entries
        self.origins = origins
        self.margin_ns = margin_ns
        # The names looked up before the server started, and the sys.path they were looked up on: compared on
        # that path, as an import made then appends entries of its own (setuptools appends its _vendor).
        self.baseline_entries, self.baseline_names = baseline

    @classmethod
    def take(
        cls,
        paths: Iterable[str],
        names: Iterable[str],
        entries: list[str],
        since_ns: int,
        resolved_before: Mapping[str, str | None] | None = None,
        margin_ns: int = MARGIN_NS,
        entries_before: list[str] | None = None,
    ) -> Sources:
        """The stamps of ``paths`` (the files the server imported) and the lookups of ``names`` (its top-level
        modules) on ``entries``, once the imports are done. ``since_ns`` (``time.time_ns()``) was taken before
        the first of these files was read; ``resolved_before`` holds the lookups of names made before then
        (:func:`resolve`, by the process that started the server), the baseline for those names, made on
        ``entries_before`` (that process's ``sys.path``; ``entries`` when not given)."""
        files: dict[str, _File] = {}
        for path in paths:
            if path in files:
                continue
            before = Stamp.of(path)
            if before is None or before.ctime_ns >= since_ns - margin_ns:
                files[path] = _File(before, None)
                continue
            data = digest(path)
            # A change while it was read sets a ctime later than ``before``'s: the digest is of ``before``.
            files[path] = _File(before, data if Stamp.of(path) == before else None)
        names = list(dict.fromkeys(names))
        known = dict(resolved_before or {})
        origins = {n: known[n] for n in names if n in known}
        origins.update(resolve([n for n in names if n not in known], entries))
        on = list(entries if entries_before is None else entries_before)
        return cls(files, list(entries), origins, margin_ns, (on, frozenset(n for n in names if n in known)))

    def changed(self) -> str | None:
        """The first source that is no longer what the server imported, or None (called before every fork)."""
        for path, file in self.files.items():
            if file.stamp is None:
                return f"{path} was removed while the warm server was importing it"
            if file.digest is None:
                return f"{path} changed while the warm server was starting (which version it imported is unknown)"
            now = Stamp.of(path)
            if now is None:
                return f"{path} was removed after the warm server imported it"
            if now == file.stamp:
                continue
            if digest(path) != file.digest:
                return f"{path} changed after the warm server imported it"
            # The same bytes (touched, saved unchanged, moved back): trusted from now on only when no later
            # change could get the same times, else looked at again at the next fork.
            if Stamp.of(path) == now and now.ctime_ns < time.time_ns() - self.margin_ns:
                file.stamp = now
        now_found = resolve([n for n in self.origins if n not in self.baseline_names], self.entries)
        now_found.update(resolve([n for n in self.origins if n in self.baseline_names], self.baseline_entries))
        for name, origin in self.origins.items():
            if now_found.get(name) != origin:
                return f"module {name!r} would now be imported from {now_found.get(name)} (the server has {origin})"
        return None
