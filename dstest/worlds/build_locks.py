"""Build locks of torch's JIT-built extensions: who holds one, removing one no live process holds, and what a
rank that waits on one is told.

``torch.utils.cpp_extension.load`` builds under a ``FileBaton`` (``torch/utils/file_baton.py``):
``try_acquire`` creates ``<build dir>/lock`` with ``O_CREAT | O_EXCL`` and keeps the descriptor open until
``release`` closes it and removes the file; every other process that loads the extension meanwhile waits in
``FileBaton.wait``, polling for the file to go, with no time limit. A builder killed mid-build (the process
world kills its pool at a timeout; Ctrl-C; the OOM killer) leaves the file, and every later load of that
extension waits on it for ever: on a fresh machine the first spec's rank that JIT-builds DeepSpeed's
shm_comm op is killed at the spec's timeout, and every later spec waits out its own.

The file holds nothing (no pid), and its age tells nothing (a build takes minutes). What tells is the open
descriptor: a live builder holds one from the lock's creation to its removal, so a lock file that no process
holds open is stale. On Linux every process's descriptors are listed under ``/proc/<pid>/fd``; a descriptor
of the lock is one whose target has the lock's device and inode. :func:`clear_if_stale` removes a lock only
when it saw no holder twice, :data:`SETTLE_S` apart, with the same inode both times (``release`` closes the
descriptor a moment before it removes the file: that moment is not a stale lock), and only under an OS lock
on the build directory, so that two processes clearing at once cannot remove the lock a third has just made.
Where holders cannot be seen (no ``/proc``; a process of the lock's owner whose descriptors cannot be read)
nothing is removed, and the report names the path to remove by hand. A builder in another PID namespace (a
container sharing the cache directory) is not seen: its lock would be taken for a stale one.

The worlds call :func:`survey` at a timeout, with the stacks they report: a rank waiting in ``FileBaton.wait``
or building in ``cpp_extension._jit_compile`` gets a paragraph in the report naming the lock, its holder,
and what was done (see docs/worlds.md, "Build locks").
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

__all__ = [
    "LOCK_FILE",
    "SETTLE_S",
    "HoldersUnknown",
    "LockState",
    "Survey",
    "clear_if_stale",
    "holders",
    "stack_kind",
    "survey",
    "torch_build_dir",
    "torch_extensions_root",
    "waited_locks",
]

#: The name of torch's build lock in an extension's build directory (``_jit_compile``).
LOCK_FILE = "lock"
#: How long a lock must stay unheld, with the same inode, before it is taken for stale.
SETTLE_S = 0.5

# A frame of torch's wait for the build lock, in traceback's format (', in wait') and faulthandler's (' in wait').
_WAITING = re.compile(r'file_baton\.py", line \d+,? in wait\b')
_BUILDING = re.compile(r'cpp_extension\.py", line \d+,? in _jit_compile\b')


class HoldersUnknown(Exception):
    """Whether a live process holds the lock cannot be seen here (the message says why)."""


def torch_extensions_root() -> Path:
    """Where ``torch.utils.cpp_extension.load`` puts an extension's build directory when it is given none:
    ``$TORCH_EXTENSIONS_DIR``, else torch's cache root with the Python and accelerator folder (as torch's
    ``_get_build_directory`` computes it, without creating anything)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def torch_build_dir(name: str) -> Path:
    """The build directory of extension ``name`` built with no ``build_directory`` (DeepSpeed's op builders)."""
    return torch_extensions_root() / name


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """(device, inode, owner) of the file, or None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_uid


def holders(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The pids of the processes that hold ``path`` open (a live builder holds its lock open); ``()`` when
    none does or the file is gone. Raises :class:`HoldersUnknown` when that cannot be seen here."""
    ident = _identity(path)
    if ident is None:
        return ()
    dev, ino, owner = ident
    if not os.path.isdir("/proc/self/fd"):
        raise HoldersUnknown(f"this system ({sys.platform}) lists no process's open files in /proc")
    found: list[int] = []
    unreadable: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # ended meanwhile
        except PermissionError:
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == owner:  # only the lock's owner can have created it
                    unreadable.append(pid)
            continue
        for fd in fds:
            link = f"{fd_dir}/{fd}"
            try:
                if not os.readlink(link).endswith(LOCK_FILE):  # cheap: most descriptors are not a lock
                    continue
                st = os.stat(link)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (dev, ino):
                found.append(pid)
                break
    if unreadable and not found:
        raise HoldersUnknown(f"the open files of processes {unreadable[:5]} of the lock's owner cannot be read here")
    return tuple(sorted(found))


@dataclass(frozen=True)
class LockState:
    """What :func:`clear_if_stale` found: ``holders`` (None: cannot be seen, ``why`` says why), ``removed``."""

    path: Path
    holders: tuple[int, ...] | None
    removed: bool
    why: str = ""

    def describe(self, ranks: Mapping[int, int] | None = None) -> str:
        """One sentence on the lock for a report; ``ranks`` maps pids to the ranks of the run (their holders)."""
        if self.removed:
            return (
                "no live process holds it, so a build that was killed (at an earlier timeout, by Ctrl-C, by the "
                "OOM killer) left it, and torch waits on it for ever: dstest removed it, so the next run builds "
                "the extension"
            )
        if self.holders is None:
            return (
                f"whether a live process holds it cannot be seen here ({self.why}); if no build is running, "
                f"remove it: rm {self.path}"
            )
        if not self.holders:
            return "it is gone now"
        named = ", ".join(_holder_name(pid, ranks or {}) for pid in self.holders)
        return f"held by {named}: a build in progress (a first build takes minutes on a busy machine)"


def _holder_name(pid: int, ranks: Mapping[int, int]) -> str:
    if pid in ranks:
        return f"rank {ranks[pid]} (pid {pid})"
    if pid == os.getpid():
        return f"this process (pid {pid})"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:80]})" if cmd else "")


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An OS lock on the build directory itself (no file is added to it); it ends with its holder."""
    try:
        import fcntl
    except ImportError:  # not POSIX: /proc is absent too, so nothing is ever removed
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def clear_if_stale(path: str | os.PathLike[str], settle: float = SETTLE_S) -> LockState:
    """Remove build lock ``path`` if no live process holds it (see the module docstring); say what was found."""
    lock = Path(path)
    try:
        with _directory_lock(lock.parent):
            first = _identity(lock)
            if first is None:
                return LockState(lock, (), False)
            held = holders(lock)
            if held:
                return LockState(lock, held, False)
            time.sleep(settle)
            if _identity(lock) != first:  # released (or released and taken again) meanwhile
                return LockState(lock, holders(lock), False)
            held = holders(lock)
            if held:
                return LockState(lock, held, False)
            lock.unlink(missing_ok=True)
            return LockState(lock, (), True)
    except HoldersUnknown as exc:
        return LockState(lock, None, False, str(exc))
    except FileNotFoundError:  # the directory went too
        return LockState(lock, (), False)


def stack_kind(stack: str) -> str | None:
    """``"waiting"`` when the stack waits for a build lock (``FileBaton.wait``), ``"building"`` when it is in
    torch's JIT build otherwise, None when neither (faulthandler's and traceback's formats alike)."""
    if _WAITING.search(stack):
        return "waiting"
    if _BUILDING.search(stack):
        return "building"
    return None


def waited_locks(threads: list[threading.Thread], frames: Mapping[int, FrameType]) -> dict[int, str]:
    """The lock each thread (by its index, the rank) waits on in ``FileBaton.wait``, read from its frame."""
    from torch.utils.file_baton import FileBaton

    wait_code = FileBaton.wait.__code__
    out: dict[int, str] = {}
    for rank, t in enumerate(threads):
        frame = frames.get(t.ident) if t.ident is not None else None
        while frame is not None:
            if frame.f_code is wait_code:
                baton = frame.f_locals.get("self")
                path = getattr(baton, "lock_file_path", None)
                if isinstance(path, str):
                    out[rank] = path
                break
            frame = frame.f_back
    return out


@dataclass
class Survey:
    """The ranks of a timed-out run that wait on a build lock or build, and the locks involved.

    Taken while the ranks still run (:func:`survey`), so that a lock's holder can be named by rank; read after
    they were stopped (:meth:`report`), when a lock only a stopped rank held is stale and is removed."""

    kinds: dict[int, str]
    locks: list[Path]
    waited: dict[int, str]
    held_by: dict[Path, tuple[int, ...] | None] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank

    def headline(self) -> str:
        """A clause for the report's first line (what the ``dstest`` table shows of a failure)."""
        waiting = sorted(r for r, k in self.kinds.items() if k == "waiting")
        building = sorted(r for r, k in self.kinds.items() if k == "building")
        parts = []
        if waiting:
            parts.append(f"{_ranks(waiting)} {_was(waiting)} waiting on a torch extension build lock")
        if building:
            parts.append(f"{_ranks(building)} {_was(building)} JIT-building a torch extension")
        return "; ".join(parts)

    def report(self, stopped: bool) -> str:
        """The paragraph for the report; removes each lock that no live process holds any more. ``stopped``:
        the ranks were killed (the process world), so the locks they held are released."""
        lines = []
        states = {lock: clear_if_stale(lock) for lock in self.locks}
        for rank, kind in sorted(self.kinds.items()):
            if kind == "building":
                lines.append(
                    f"rank {rank} was JIT-building a torch extension (torch.utils.cpp_extension.load) when the "
                    "timeout fired: a first run on a machine builds native ops, minutes on a busy machine; "
                    "build them before the timed part (a target's prepare) or give the run a longer timeout"
                    + ("; it was killed with the pool" if stopped else "; it goes on building in this process")
                )
                continue
            path = self.waited.get(rank)
            if path is not None:
                lines.append(f"rank {rank} was waiting in torch's FileBaton.wait on the build lock {path}")
            elif len(self.locks) == 1:  # the process world: the one lock under torch's root
                lines.append(
                    f"rank {rank} was waiting in torch's FileBaton.wait on the build lock {self.locks[0]} (the "
                    f"only one under {self.locks[0].parent.parent})"
                )
            elif self.locks:
                lines.append(
                    f"rank {rank} was waiting in torch's FileBaton.wait on one of the build locks under "
                    f"{self.locks[0].parent.parent}"
                )
            else:
                lines.append(
                    f"rank {rank} was waiting in torch's FileBaton.wait on a build lock that is not under "
                    f"{torch_extensions_root()}: it is in the build_directory the extension was loaded with; "
                    "remove its 'lock' file there if no build is running"
                )
        for lock in self.locks:
            state = states[lock]
            before = self.held_by.get(lock)
            if state.removed and before and all(pid in self.pids for pid in before) and stopped:
                holders_ = ", ".join(f"rank {self.pids[p]} (pid {p})" for p in before)
                lines.append(
                    f"{lock}: held by {holders_}, which was still building when the timeout fired and was killed "
                    "with the pool (a killed builder cannot remove its lock): dstest removed it, so the next run "
                    "builds afresh"
                )
            else:
                lines.append(f"{lock}: {state.describe(self.pids)}")
        return "build locks (docs/worlds.md#build-locks):\n" + "\n".join(f"  {line}" for line in lines)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _was(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


def survey(
    stacks: Mapping[int, str], *, waited: Mapping[int, str] | None = None, pids: Mapping[int, int] | None = None
) -> Survey | None:
    """Which ranks of a timed-out run wait on a build lock or build (from their ``stacks``), and the locks
    involved: those read from the waiting frames (``waited``, rank -> path: the threaded world), else every
    lock under torch's extensions root (the process world's stacks have no locals). ``pids`` (rank -> pid)
    lets the report name a holder by rank. None when no rank's stack is in a build."""
    kinds = {rank: kind for rank, stack in stacks.items() if (kind := stack_kind(stack)) is not None}
    if not kinds:
        return None
    waited = {r: p for r, p in (waited or {}).items() if r in kinds}
    if waited:
        locks = sorted({Path(p) for p in waited.values()})
    else:
        try:
            locks = sorted(torch_extensions_root().glob(f"*/{LOCK_FILE}"))
        except OSError:
            locks = []
    by_pid = {pid: rank for rank, pid in (pids or {}).items()}
    held: dict[Path, tuple[int, ...] | None] = {}
    for lock in locks:
        try:
            held[lock] = holders(lock)
        except HoldersUnknown:
            held[lock] = None
    return Survey(kinds, locks, dict(waited), held, by_pid)
