"""The process around a test: ``sys.path``, ``sys.modules``, the environment, the working directory, Python's
signal handlers, the CPUs the test's thread may run on and torch's global settings, taken at one moment
(:func:`take_process_state`) and put back (:func:`restore_process_state`), each difference named.
``sys.modules`` keeps the libraries a run imported and drops the user's own modules, which a fresh process
would import anew.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import operator
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

_MISSING = object()


class ProcessState:
    """What a process-wide state was at one moment; a part taken as None is not compared."""

    __slots__ = ("affinity", "cwd", "environ", "modules", "path", "path_list", "signals", "torch")

    def __init__(
        self,
        modules: dict[str, Any],
        path: list[str] | None = None,
        environ: dict[str, str] | None = None,
        cwd: str | None = None,
        signals: dict[int, Any] | None = None,
        torch: dict[str, Any] | None = None,
        affinity: set[int] | None = None,
    ) -> None:
        self.modules = modules
        self.path_list = sys.path
        self.path = path
        self.environ = environ
        self.cwd = cwd
        self.signals = signals
        self.torch = torch
        self.affinity = affinity


def take_process_state(*, environ: bool = True) -> ProcessState:
    """The process-wide state now (``environ=False``: the environment and working directory not taken)."""
    return ProcessState(
        _modules_now(),
        list(sys.path),
        dict(os.environ) if environ else None,
        os.getcwd() if environ else None,
        _signal_handlers(),
        {label: get() for label, get, _ in _torch_switches()},
        _affinity(),
    )


def restore_process_state(
    saved: ProcessState, *, quiet_env: Callable[[str], bool] = lambda name: False
) -> tuple[list[str], str | None]:
    """Put the process-wide state back as ``saved`` has it: what differed, named (the environment
    variables ``quiet_env`` answers True for put back unnamed), and why the worker is unusable, if it is."""
    found: list[str] = []
    unusable: list[str] = []
    found.extend(_restore_modules(saved.modules))
    if saved.path is not None:
        found.extend(_restore_path(saved))
    if saved.environ is not None:
        found.extend(_restore_environ(saved.environ, quiet_env))
    if saved.cwd is not None:
        found.extend(_restore_cwd(saved.cwd))
    if saved.signals is not None:
        _restore_signals(saved.signals, found, unusable)
    if saved.affinity is not None:  # before torch's settings: torch 2.15 reads a default from the CPUs it may use
        found.extend(_restore_affinity(saved.affinity))
    if saved.torch is not None:
        _restore_torch(saved.torch, found, unusable)
    return found, "; ".join(unusable) or None


def _affinity() -> set[int] | None:
    """The CPUs the calling thread may run on (where that can be asked)."""
    get = getattr(os, "sched_getaffinity", None)
    if get is None:
        return None
    try:
        return set(get(0))
    except OSError:
        return None


def _restore_affinity(saved: set[int]) -> list[str]:
    """The calling thread's CPUs as saved: code that binds its rank to cores (``os.sched_setaffinity``) would
    otherwise leave the next test of the worker on them, where a fresh process has every CPU."""
    now = _affinity()
    if now is None or now == saved:
        return []
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, saved)
    return [f"CPU affinity: {sorted(saved)} -> {sorted(now)} by the run; put back"]


def _restore_path(saved: ProcessState) -> list[str]:
    """``sys.path`` as saved, the same list object holding the same entries; a list put in its place that
    holds what the old one held is put back unnamed."""
    assert saved.path is not None
    now = sys.path
    if now == saved.path:
        found = []
    else:
        before, after = set(saved.path), set(now)
        found = [f"sys.path: {p!r} added by the run; removed" for p in dict.fromkeys(now) if p not in before]
        found += [f"sys.path: {p!r} removed by the run; put back" for p in dict.fromkeys(saved.path) if p not in after]
        found = found or ["sys.path: its entries reordered or repeated by the run; put back"]
    sys.path = saved.path_list
    if sys.path != saved.path:
        sys.path[:] = saved.path
    return found


def _restore_environ(saved: dict[str, str], quiet: Callable[[str], bool]) -> list[str]:
    if os.environ == saved:
        return []
    found: list[str] = []
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
        if not quiet(name):
            found.append(f"os.environ[{name!r}]: set by the run; removed")
    for name, value in saved.items():
        now = os.environ.get(name)
        if now != value:
            os.environ[name] = value
            if not quiet(name):
                what = "unset" if now is None else "changed"
                found.append(f"os.environ[{name!r}]: {what} by the run; put back")
    return found


def _restore_cwd(saved: str) -> list[str]:
    try:
        now = os.getcwd()
    except OSError:  # the run removed the directory it was in
        now = "(a directory since removed)"
    if now == saved:
        return []
    os.chdir(saved)
    return [f"working directory: changed by the run to {now!r}; put back"]


def _signal_handlers() -> dict[int, Any] | None:
    """Python's handler of every signal; None off the main thread, where handlers cannot be set back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return dict(zip(_SIGNALS, map(_getsignal, _SIGNALS), strict=True))


def _valid_signals() -> tuple[int, ...]:
    found = []
    for s in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            signal.getsignal(s)
            found.append(int(s))
    return tuple(found)


_SIGNALS = _valid_signals()
#: The C function beneath ``signal.getsignal``, which wraps each answer in an enum (a third of the cost of a
#: look at every handler).
_getsignal: Callable[[int], Any] = getattr(importlib.import_module("_signal"), "getsignal", signal.getsignal)


def _restore_signals(saved: dict[int, Any], found: list[str], unusable: list[str]) -> None:
    """A handler the run set is put back in Python, and the worker is replaced: a handler installed below
    Python (faulthandler's stack dump on SIGUSR1, which the process world uses to report a hang) is what
    Python's table does not show, and what setting the old value back would not restore."""
    now = _signal_handlers()
    if now is None or now == saved:
        return
    for sig, handler in saved.items():
        if now[sig] != handler:
            try:
                name = signal.Signals(sig).name
            except ValueError:  # a real-time signal
                name = str(sig)
            found.append(f"signal handler of {name}: set by the run; put back, and the worker is replaced")
            if handler is not None:
                signal.signal(sig, handler)
            unusable.append(f"the run set the handler of {name}")


def _torch_switches() -> tuple[tuple[str, Callable[[], Any], Callable[[Any], Any] | None], ...]:
    """torch's process-wide settings: (what the report calls it, its getter, its setter or None), for the
    torch imported here (none before it is: a rank that never imports torch pays nothing). The table is
    :func:`dstest.worlds.torch_internals.torch_switches` (it reads torch's private getters and setters)."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_default_dtype"):
        return ()
    from dstest.worlds.torch_internals import torch_switches

    return torch_switches()


def _restore_torch(saved: dict[str, Any], found: list[str], unusable: list[str]) -> None:
    switches = {label: (get, put) for label, get, put in _torch_switches()}
    differ = [label for label, value in saved.items() if switches[label][0]() != value]
    for label in differ:
        found.append(f"torch {label}: {_change(saved[label], switches[label][0]())} by the run; put back")
    for _ in range(2):  # some settings move others (float32 matmul precision and the fp32 precisions)
        for label in differ:
            get, put = switches[label]
            if put is not None and get() != saved[label]:
                with contextlib.suppress(Exception):
                    put(saved[label])
    unusable.extend(f"could not put back torch {label}" for label in differ if switches[label][0]() != saved[label])


def _change(old: Any, new: Any) -> str:
    """``old -> new``; of settings kept as (name, value) pairs (print options), the pairs that changed."""
    if type(old) is tuple and type(new) is tuple and all(type(p) is tuple and len(p) == 2 for p in old + new):
        before, after = dict(old), dict(new)
        keys = [k for k in dict.fromkeys([*before, *after]) if before.get(k, _MISSING) != after.get(k, _MISSING)]
        old, new = ({k: d[k] for k in keys if k in d} for d in (before, after))
    return f"{old!r} -> {new!r}"


def _modules_now() -> dict[str, Any]:
    """``sys.modules`` as it is now, in a dict kept from one look to the next: the modules imported since
    the last look are added to it, and only another change makes a new copy. Copying a warm worker's
    ~2,500 entries took 0.7-6 ms a test (the forked worker's pages each copy touches), against 0.13 ms in
    a process of its own. The dict is read until the next look, never changed."""
    now = sys.modules
    known = _KNOWN_MODULES
    if known:
        added = imported_since(next(reversed(known)))
        if _holds(now, known, len(added)):
            for name in added:
                known[name] = now[name]
            return known
    known.clear()
    known.update(now)
    return known


_KNOWN_MODULES: dict[str, Any] = {}


def _holds(now: dict[str, Any], saved: dict[str, Any], added: int) -> bool:
    """Whether ``now`` is ``saved`` (every name bound to the same module) with ``added`` names more. Without
    added names, by the dicts' own equality, in C, which compares the same object as equal without asking it
    (3.5 times faster than by identity through ``map``)."""
    if len(now) != len(saved) + added:
        return False
    if not added:
        return now == saved
    return all(map(operator.is_, map(now.get, saved), saved.values()))


def _restore_modules(saved: dict[str, Any]) -> list[str]:
    """``sys.modules`` as saved, but for what the run imported from the installed libraries: a fresh
    process imports the user's own modules anew; a library (the standard library, site-packages, or a
    package already imported before the run, such as torch, whose submodules import lazily) stays: a
    second import of it may fail (extension modules, torch's op registrations), and it is as its import
    left it."""
    now = sys.modules
    added = imported_since(next(reversed(saved))) if saved else []
    if _holds(now, saved, len(added)):
        return drop_users_modules(added)
    found: list[str] = []
    for name, module in saved.items():
        there = now.get(name, _MISSING)
        if there is not module:
            now[name] = module
            found.append(
                f"sys.modules[{name!r}]: {'removed' if there is _MISSING else 'replaced'} by the run; put back"
            )
    return found + drop_users_modules(sorted(now.keys() - saved.keys()))


def imported_since(newest: str) -> list[str]:
    """The names ``sys.modules`` gained since ``newest`` was its newest entry, oldest first (it keeps the
    order of insertion); none known when ``newest`` has gone since."""
    found: list[str] = []
    for name in reversed(sys.modules):
        if name == newest:
            return found[::-1]
        found.append(name)
    return []


def is_users_module(name: str, module: Any, imported: set[str]) -> bool:
    """Whether a module among those just ``imported`` is the user's own: not of a package imported before (as
    torch's submodules, imported lazily), nor from the standard library or site-packages."""
    return name.partition(".")[0] in imported and not _from_a_library(module)


def drop_users_modules(imported: list[str]) -> list[str]:
    """The user's own modules among those just ``imported``, out of ``sys.modules``, named."""
    dropped = _drop(imported)
    if dropped:
        # what the dropped modules registered through objects of theirs goes with them (a
        # torch.library.Library deregisters its namespace when collected), as it would with the process: the
        # next test's import of them defines it anew instead of failing ("Only a single TORCH_LIBRARY...").
        # Their functions hold their globals in a cycle: only a collection frees them.
        gc.collect()
    return [
        f"sys.modules[{top!r}]{f' (and {count - 1} of its submodules)' if count > 1 else ''}: imported by the run; "
        "removed (a fresh process imports it anew)"
        for top, count in dropped.items()
    ]


def _drop(imported: list[str]) -> dict[str, int]:
    """Out of ``sys.modules`` (and their parent packages), the user's own modules among those just
    ``imported``: how many of each top-level package. Here, so that no reference to them outlives the call."""
    now = sys.modules
    names = set(imported)
    dropped: dict[str, int] = {}
    for name in imported:
        module = now.get(name)
        if module is None or not is_users_module(name, module, names):
            continue
        del now[name]
        parent, _, child = name.rpartition(".")
        owner = now.get(parent) if parent else None
        if owner is not None and vars(owner).get(child) is module:
            delattr(owner, child)
        top = name.partition(".")[0]
        dropped[top] = dropped.get(top, 0) + 1
    return dropped


def _from_a_library(module: Any) -> bool:
    """Whether a module comes from the interpreter's standard library or a site-packages directory (or
    has no file: a builtin, a frozen module)."""
    path = getattr(module, "__file__", None)
    if not path:
        paths = list(getattr(module, "__path__", None) or ())
        if not paths:
            return True
        path = paths[0]
    where = os.path.realpath(path)
    return bool(where.startswith(_library_dirs()))


def _library_dirs() -> tuple[str, ...]:
    if not _LIBRARY_DIRS:
        import site
        import sysconfig

        paths = {sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        with contextlib.suppress(AttributeError):
            paths.update(site.getsitepackages())
        with contextlib.suppress(AttributeError):
            paths.add(site.getusersitepackages())
        _LIBRARY_DIRS.extend(os.path.join(os.path.realpath(p), "") for p in paths if p)
    return tuple(_LIBRARY_DIRS)


_LIBRARY_DIRS: list[str] = []
