"""Build and load the native ops in ``csrc/`` on first use (contract D5).

The C++/CUDA sources live in the repository's top-level ``csrc/``; a wheel installs them as package data
at ``impl/ops/csrc/`` (the ``impl.ops.csrc`` mapping in ``pyproject.toml``). :func:`source_dir` looks
there first, beside this module, and falls back to ``csrc/`` at the root of the checkout this module
sits in (a checkout on ``sys.path`` or an editable install).

The sources are compiled with ``torch.utils.cpp_extension.load`` (ninja) into a directory keyed by
the torch version, the CUDA version (or ``cpu``) and the Python version, under
``~/.cache/dstest/ext/<key>`` or ``$DSTEST_EXT_DIR/<key>``. A build takes about 30 s on a two-core
machine and is reused afterwards; ninja rebuilds only what changed. Several processes building at once
are serialised by an OS lock on ``.dstest-build.flock`` in that directory, which dies with its holder;
torch's own ``lock`` file, which a killed build leaves behind and which then blocks every later build,
is removed when found under that OS lock (no live dstest build can own it then).

CUDA sources are compiled only when torch has CUDA, ``CUDA_HOME`` is found, and an architecture list
is known (``TORCH_CUDA_ARCH_LIST`` set, or a visible GPU to detect it from: without either, torch's
arch detection fails with ``IndexError``); otherwise the CPU ops are built alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from impl.ops._fakes import register_fakes

__all__ = [
    "ENV_EXT_DIR",
    "ExtensionBuildError",
    "ExtensionInfo",
    "build_key",
    "extension_dir",
    "is_built",
    "load_extension",
    "source_dir",
]

#: Environment variable naming the base directory of the build cache.
ENV_EXT_DIR = "DSTEST_EXT_DIR"

_NAME = "dstest_impl_ops"
_CPU_SOURCES = ("binding.cpp", "allgather_compact_cpu.cpp")
_CUDA_SOURCES = ("allgather_compact_cuda.cpp", "allgather_compact.cu")
#: Where the sources are looked for, in order: the package data of an installed wheel, then the checkout.
_SOURCE_DIRS = (
    Path(__file__).resolve().parent / "csrc",
    Path(__file__).resolve().parents[2] / "csrc",
)

# Loading registers the ops process-wide and a second load of the same library fails, so the loaded
# extension is cached once per process; the lock makes concurrent first calls (threaded worlds) build
# and load it once.
_LOAD_LOCK = threading.Lock()


class ExtensionBuildError(RuntimeError):
    """The native ops could not be built or loaded; the message names the build directory."""


@dataclass(frozen=True)
class ExtensionInfo:
    """What :func:`load_extension` loaded."""

    library: Path
    build_dir: Path
    with_cuda: bool
    load_seconds: float


def _cuda_wanted() -> bool:
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        return False
    return bool(os.environ.get("TORCH_CUDA_ARCH_LIST")) or torch.cuda.is_available()


def source_dir() -> Path:
    """The directory holding the C++/CUDA sources: ``impl/ops/csrc/`` of a wheel install, else the checkout's
    ``csrc/``. Raises :class:`ExtensionBuildError` naming both places when neither holds the sources."""
    for candidate in _SOURCE_DIRS:
        if all((candidate / name).is_file() for name in _CPU_SOURCES):
            return candidate
    raise ExtensionBuildError(
        "the dstest_impl C++ sources were not found: looked for "
        f"{', '.join(_CPU_SOURCES)} in {' and '.join(str(d) for d in _SOURCE_DIRS)} "
        "(a wheel installs them at impl/ops/csrc/; a checkout has them in csrc/)"
    )


def build_key(with_cuda: bool | None = None) -> str:
    """The cache directory name for this torch, CUDA and Python, e.g. ``torch-2.13.0+cpu-cpu-py311``."""
    if with_cuda is None:
        with_cuda = _cuda_wanted()
    cuda = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    key = f"torch-{torch.__version__}-{cuda}-py{sys.version_info.major}{sys.version_info.minor}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", key)


def extension_dir(with_cuda: bool | None = None) -> Path:
    """Where the extension is built: ``$DSTEST_EXT_DIR/<key>`` or ``~/.cache/dstest/ext/<key>``."""
    base = os.environ.get(ENV_EXT_DIR)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "dstest" / "ext"
    return root / build_key(with_cuda)


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[bool]:
    """Hold the directory's build lock across processes; yields whether a stale torch lock was removed.

    torch's ``FileBaton`` is a plain ``lock`` file: a process killed while building leaves it, and every
    later build waits on it forever. Under this lock no other dstest build is running, so such a file is
    stale.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield False
        return
    with open(build_dir / ".dstest-build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            stale = baton.exists()
            if stale:
                baton.unlink(missing_ok=True)
            yield stale
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=1)
def _load_once() -> ExtensionInfo:
    with_cuda = _cuda_wanted()
    build_dir = extension_dir(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    csrc = source_dir()
    sources = [str(csrc / s) for s in _CPU_SOURCES]
    if with_cuda:
        sources += [str(csrc / s) for s in _CUDA_SOURCES]
    start = time.perf_counter()
    try:
        with build_lock(build_dir):
            library = _build(build_dir, csrc, sources, with_cuda)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        raise ExtensionBuildError(
            f"building the dstest_impl ops in {build_dir} (cuda={with_cuda}) failed: {exc}. "
            f"A C++ compiler and ninja are needed (and nvcc for CUDA); {ENV_EXT_DIR} chooses the cache "
            'directory; impl="reference" runs the pure-torch compaction without the build.'
        ) from exc
    register_fakes()  # only now: a fake needs the op the library defines
    return ExtensionInfo(
        library=Path(str(library)) if library else build_dir / f"{_NAME}.so",
        build_dir=build_dir,
        with_cuda=with_cuda,
        load_seconds=time.perf_counter() - start,
    )


def _build(build_dir: Path, csrc: Path, sources: list[str], with_cuda: bool) -> object:
    return cpp_extension.load(
        name=_NAME,
        sources=sources,
        extra_cflags=["-O2"],
        extra_cuda_cflags=["-O3"],
        extra_include_paths=[str(csrc)],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=False,
    )


def is_built(with_cuda: bool | None = None) -> bool:
    """Whether a library of the ops is in the build directory already (a load then only checks it is up to
    date, in about a second, instead of compiling for about 30 s): for saying, before a load, that a build
    is due."""
    build_dir = extension_dir(with_cuda)
    return build_dir.is_dir() and any(build_dir.glob(f"{_NAME}*.so"))


def load_extension() -> ExtensionInfo:
    """Build (first time only) and load the ``dstest_impl`` ops; later calls return the same info."""
    with _LOAD_LOCK:
        return _load_once()
