"""The trace's per-call record in C (``records.cpp`` beside this file), built on first use, and the choice
between it and the pure-Python record of :mod:`dstest.trace.records`.

Every collective of every rank makes a record and calls three of its hooks; in Python that was about a
quarter of a small collective's time in the threaded world (measured: ``benchmarks/bench_records.py``).
The C record has the same fields and hooks, field for field; the Python one stays, and is used:

- where no C++ compiler is found (``$CXX``, else ``c++``), or the build fails (then with a warning naming
  the build directory and the compiler's output);
- when ``DSTEST_NATIVE=0`` (``1`` makes a record that cannot be built an error instead of a fallback;
  the default, ``auto``, falls back).

The source includes only ``Python.h``: it is compiled by one call of the compiler (about a second), without
torch's headers or libraries, so importing the trace never imports torch. The library is cached under
``$DSTEST_EXT_DIR`` or ``~/.cache/dstest/ext`` (where impl's ops are built), in a directory named after
the source's hash and the interpreter's ABI, so an edited source or another Python builds anew. Processes
that build at once are serialised by an OS lock on a file in that directory, which dies with its holder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from dstest.errors import InvalidArgument

__all__ = ["ENV_NATIVE", "NativeStatus", "load", "status"]

#: ``auto`` (default): the C record where it can be built, else the Python one; ``0``: the Python one;
#: ``1``: the C record or an error.
ENV_NATIVE = "DSTEST_NATIVE"
_NAME = "dstest_native_records"
_SOURCE = Path(__file__).resolve().parent / "records.cpp"
_MODES = {"auto": "auto", "": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


class NativeStatus:
    """Which record this process uses, and why (``dstest.trace.native.status()``; ``bench_records.py`` prints it)."""

    def __init__(self, native: bool, why: str) -> None:
        self.native = native
        self.why = why

    def __repr__(self) -> str:
        return f"NativeStatus(native={self.native}, why={self.why!r})"

    def describe(self) -> str:
        return ("C records" if self.native else "Python records") + f" ({self.why})"


_status = NativeStatus(False, "not loaded yet")


def status() -> NativeStatus:
    return _status


def mode() -> str:
    """``auto``, ``on`` or ``off``, from ``DSTEST_NATIVE``; raises :class:`InvalidArgument` naming what is
    allowed."""
    raw = os.environ.get(ENV_NATIVE, "auto").strip().lower()
    if raw not in _MODES:
        raise InvalidArgument(f"{ENV_NATIVE}={raw!r}: expected auto (the default), 1 (the C records) or 0 (Python's)")
    return _MODES[raw]


def build_dir() -> Path:
    """Where the library is built: ``<ext root>/records-<source hash>-<ABI>``."""
    base = os.environ.get("DSTEST_EXT_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "dstest" / "ext"
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    abi = (sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}").replace("/", "_")
    return root / f"records-{digest}-{abi}"


def _library(directory: Path) -> Path:
    return directory / (_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def compiler() -> list[str] | None:
    """The C++ compiler's command (``$CXX``, else ``c++``), or None when it is not found."""
    command = shlex.split(os.environ.get("CXX", "") or "c++")
    if not command or shutil.which(command[0]) is None:
        return None
    return command


def _compile(directory: Path, cxx: list[str], extra: tuple[str, ...] = ()) -> None:
    """Compile the library into ``directory`` (``extra``: more compiler flags; a user's build adds no
    ``-Werror``, so that a newer compiler's new warning does not cost the C records: the tests add it)."""
    include = sysconfig.get_paths()["include"]
    link = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    command = [
        *cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-fno-exceptions", "-fno-rtti",
        f"-DDSTEST_MODULE_NAME={_NAME}", f"-I{include}", *extra, str(_SOURCE), "-o", tmp, *link,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, _library(directory))  # a finished library appears at once, never half written
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: a build that races another writes the same bytes, replaced atomically
        yield
        return
    with open(directory / ".dstest-build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    # What a warm server watches for this library (dstest.pytest.warm.staleness.BUILT_FROM): its source, whose
    # digest names the library's directory; the library itself is written once, atomically.
    module.__dict__["__dstest_built_from__"] = (str(_SOURCE),)
    return module


def load() -> ModuleType | None:
    """The C records module, built first if needed; None where the Python records are to be used (see
    the module's docstring). Sets :func:`status`."""
    global _status
    how = mode()
    if how == "off":
        _status = NativeStatus(False, f"{ENV_NATIVE}=0")
        return None
    directory = build_dir()
    library = _library(directory)
    try:
        if not library.is_file():
            cxx = compiler()
            if cxx is None:
                raise FileNotFoundError(f"no C++ compiler: {os.environ.get('CXX') or 'c++'} is not on PATH (set CXX)")
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory):
                if not library.is_file():  # another process may have built it while this one waited
                    _compile(directory, cxx)
            built = f"built in {directory}"
        else:
            built = f"from {directory}"
        module = _import(library)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:
        if how == "on":
            raise RuntimeError(f"{ENV_NATIVE}=1, but the C records could not be built or loaded: {exc}") from exc
        if isinstance(exc, FileNotFoundError) and "no C++ compiler" in str(exc):
            _status = NativeStatus(False, str(exc))
        else:
            _status = NativeStatus(False, f"the C records failed to build or load in {directory}: {exc}")
            warnings.warn(
                f"dstest: {_status.why}; the trace uses its Python records (slower; {ENV_NATIVE}=0 silences this)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    _status = NativeStatus(True, built)
    return module
