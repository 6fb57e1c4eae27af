"""State a run leaves behind in a warm worker: found by comparison, put back, named.

A warm worker serves one run after another; a fresh process would start each of them as importing left
things. Hand-kept resets (:mod:`dstest.resets`) undo what is known to change, and say nothing; this module
catches what nobody listed, puts it back and names it. Two watches feed one report:

- :class:`ModuleStateWatch`: the module globals of the packages a run names (``RunRequest.watch_modules``,
  e.g. ``("deepspeed",)``), kept at the first run that names them; modules first imported during a run are
  watched from the end of that run on.
- :func:`fresh_process`: for a rank function that runs another harness's test as that harness's fresh
  process would (the compat plugin for torch's test bases), the scope of one test: what a fresh
  interpreter would start the next test with is put back when the test ends: the test module's own globals
  as its import left them (and those of the modules of the user's own it imported), ``sys.path``, the
  ``sys.modules`` entries of the user's code the test imported, ``os.environ``, the working directory,
  Python's signal handlers, torch's global settings (:func:`_torch_switches`) and, when it starts, torch's and
  Python's RNGs as a new process has them. What it finds reaches the parent with the run's
  :class:`ModuleStateWatch` (which hands it on), in the same warning.

Module globals are compared by binding and by the contents of every dict, list and set reachable from
them through dicts, lists and tuples (exact types; subclasses may not copy safely), each kept as a shallow
copy. After a run:

- a name bound to another object, or a name the run added: the old binding is put back (the added name is
  removed);
- a dict, list or set changed in place, at any depth: its contents are put back;
- anything that cannot be put back (a module that refuses the assignment, a signal handler, a torch
  setting without a setter) makes the worker unusable: the pool replaces it before the next run.

The report names what differs from what was kept, by structure: containers by type and contents, other
objects by identity (a fresh container holding what the old one held is not reported, and the old one is
put back). A cache (a name containing "cache") and c10d's tables of groups (which the world manages
itself) are put back without a report; what torch.compile adds to the globals of a module it compiled a
function of (names with two leading underscores: ``__compiled_fn_*``, ``__import_*``...) is left in place,
unreported: the compiled code cached on the function looks it up there. Each other difference is reported
(``module.name`` and what was done), and the parent warns with :class:`dstest.errors.StateLeftBehind`, a
finding about the code under test: it would have reached the next test. Not seen: an object changed through
its own attributes (``obj.field = x`` on a module-level object, a class attribute).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import operator
import os
import random
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from itertools import repeat
from types import ModuleType
from typing import Any

__all__ = [
    "FreshProcess",
    "ModuleStateWatch",
    "ProcessState",
    "close_held_scope",
    "fresh_process",
    "fresh_process_rng",
    "restore_process_state",
    "take_pending",
    "take_process_state",
]

_KINDS = frozenset((dict, list, set, tuple))
_MISSING = object()


def _copy(value: Any) -> Any:
    """A shallow copy of a dict, list or set (exactly those types; subclasses may not copy safely), else None."""
    kind = type(value)
    if kind is dict:
        return dict(value)
    if kind is list:
        return list(value)
    if kind is set:
        return set(value)
    return None


def _is_module(value: Any) -> bool:
    """By the value's type, not ``isinstance``: that reads ``value.__class__``, which some module-level
    objects answer with a warning (``torch.distributed.reduce_op``'s deprecation)."""
    return issubclass(type(value), ModuleType)


def _same_contents(saved: Any, value: Any) -> bool:
    """Whether a container holds the same objects it held when saved (by identity, as a fresh run needs).
    Compared in C where it can be: keys and values in order by identity first (no key is hashed: torch's
    operator overloads hash in Python), then by lookup where a dict's order changed."""
    if type(saved) is dict:
        if len(saved) != len(value):
            return False
        if all(map(operator.is_, saved, value)) and all(map(operator.is_, saved.values(), value.values())):
            return True
        return saved.keys() == value.keys() and all(saved[k] is value[k] for k in saved)
    if type(saved) is list:
        return len(saved) == len(value) and all(map(operator.is_, saved, value))
    return bool(saved == value)  # a set: its members compare by the hashes the sets keep, and equality


def _restore_contents(value: Any, saved: Any) -> None:
    if type(value) is list:
        value[:] = saved
    else:
        value.clear()
        value.update(saved)


def _reach(value: Any, copies: dict[int, tuple[Any, Any]]) -> tuple[int, ...]:
    """The ids of the dicts, lists, sets and tuples reachable from ``value`` through dicts' values, lists and
    tuples (``value`` itself included), each recorded in ``copies`` once with a shallow copy (None for a
    tuple, which cannot change). A set's members are hashable, so none of them is a container that can."""
    found: list[int] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind not in _KINDS or id(item) in seen:
            continue
        seen.add(id(item))
        found.append(id(item))
        if id(item) not in copies:
            copies[id(item)] = (item, _copy(item))
        if kind is set:
            continue
        inner = item.values() if kind is dict else item
        if not _KINDS.isdisjoint(map(type, inner)):  # scanned in C: most containers hold no container
            stack.extend(x for x in inner if type(x) in _KINDS)
    return tuple(found)


def _same_shape(saved: Any, now: Any, copies: dict[int, tuple[Any, Any]]) -> bool:
    """Whether ``now`` holds what ``saved`` held when ``copies`` were taken: containers by type and contents,
    every other object by identity (what a fresh process would see the same)."""
    pending = [(saved, now)]
    assumed: set[tuple[int, int]] = set()  # pairs under comparison: a cycle compares equal on its way back
    while pending:
        old, new = pending.pop()
        kind = type(old)
        if kind not in _KINDS:
            if old is not new:
                return False
            continue
        if type(new) is not kind:
            return False
        if (id(old), id(new)) in assumed:
            continue
        assumed.add((id(old), id(new)))
        before = old if kind is tuple else copies[id(old)][1]
        if len(before) != len(new):
            return False
        if kind is set:
            if before != new:
                return False
        elif kind is dict:
            if before.keys() != new.keys():
                return False
            pending.extend((before[k], new[k]) for k in before)
        else:
            pending.extend(zip(before, new))
    return True


class _Saved:
    """One module's globals when watching began: name -> object, and a shallow copy of every container
    reachable from them."""

    __slots__ = ("benign", "bindings", "containers", "copies", "module", "names", "reach", "values")

    benign: set[str]

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.bindings = {
            name: value
            for name, value in vars(module).items()
            if not (name.startswith("__") and name.endswith("__")) and not _is_module(value)
        }
        self.copies: dict[int, tuple[Any, Any]] = {}
        self.reach = {name: _reach(value, self.copies) for name, value in self.bindings.items()}
        # The same, laid out for the check after every run, which finds nothing changed nearly always.
        self.names = tuple(self.bindings)
        self.values = tuple(self.bindings.values())
        self.containers = tuple((value, copy) for value, copy in self.copies.values() if copy is not None)
        self.benign = set(vars(module).keys() - self.bindings.keys())  # its dunders and submodules

    def unchanged(self) -> bool:
        """Whether the module's globals are as saved: every binding the same object, no name added but those
        left alone (:func:`_left_alone`, remembered in ``benign``), every container's contents the same.
        Most of it in C: it runs for each watched module after each run."""
        namespace = vars(self.module)
        if not all(map(operator.is_, map(namespace.get, self.names, repeat(_MISSING)), self.values)):
            return False
        for attr in namespace.keys() - self.bindings.keys() - self.benign:
            if not _left_alone(attr, namespace[attr]):
                return False
            self.benign.add(attr)
        return all(_same_contents(copy, value) for value, copy in self.containers)

    def restore(self) -> list[str]:
        """Put the globals back as saved; what differed, named (quiet names put back unnamed)."""
        name = self.module.__name__
        namespace = vars(self.module)
        found: list[str] = []
        changed = {id(value) for value, copy in self.containers if not _same_contents(copy, value)}
        rebound: list[str] = []
        for attr in [a for a in namespace if a not in self.bindings]:
            value = namespace[attr]
            if _left_alone(attr, value):
                continue
            del namespace[attr]
            if not _quiet(name, attr):
                found.append(f"{name}.{attr}: added by the run ({type(value).__name__}); removed")
        for attr, value in self.bindings.items():  # named before anything is put back: containers are shared
            now = namespace.get(attr, _MISSING)
            inner = [i for i in self.reach[attr] if i in changed] if changed else []
            if now is value and not inner:
                continue
            if now is not value:
                rebound.append(attr)
            if _quiet(name, attr) or (now is not _MISSING and _same_shape(value, now, self.copies)):
                continue  # e.g. a fresh container holding what the old one held (what a reset makes)
            if now is _MISSING:
                found.append(f"{name}.{attr}: deleted; put back")
            elif now is not value:
                found.append(f"{name}.{attr}: rebound to a {type(now).__name__}; put back")
            elif id(value) in inner:
                found.append(f"{name}.{attr}: its {type(value).__name__} changed in place; contents put back")
            else:
                kind = type(self.copies[inner[0]][0]).__name__
                found.append(f"{name}.{attr}: a {kind} inside it changed in place; contents put back")
        for attr in rebound:
            namespace[attr] = self.bindings[attr]
        for value, copy in self.containers:
            if id(value) in changed:
                _restore_contents(value, copy)
        return found


class ModuleStateWatch:
    """The watched modules of one worker, by prefix (a module ``p`` or any ``p.x``)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.saved: dict[str, _Saved] = {}
        self._seen: set[str] = set()
        self._add_new_modules()
        _WATCHES.add(self)

    def _watched(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def _add_new_modules(self) -> None:
        names = sys.modules.keys() - self._seen  # only the modules imported since the last look
        self._seen.update(names)
        for name in names:
            module = sys.modules.get(name)
            if isinstance(module, ModuleType) and self._watched(name):
                self.saved[name] = _Saved(module)

    def check_and_restore(self) -> tuple[list[str], str | None]:
        """After a run: what it left changed (each put back), and why the worker is unusable, if it is.
        What a :func:`fresh_process` scope of the run found comes first."""
        found, unusable = take_pending()
        for name, saved in self.saved.items():
            if saved.unchanged():
                continue
            try:
                found.extend(saved.restore())
            except Exception as exc:  # a module that refuses: only a fresh process is clean
                why = f"could not put back the module-level state of {name} ({type(exc).__name__}: {exc})"
                unusable = f"{unusable}; {why}" if unusable else why
                found.append(f"{name}: changed, and could not be put back; the worker is replaced")
        self._add_new_modules()
        return found, unusable


#: Every watch of this worker: a fresh-process scope has them look at the modules a test module imported as
#: soon as it is imported, so that those are kept as their import left them, not as the first test did.
_WATCHES: weakref.WeakSet[ModuleStateWatch] = weakref.WeakSet()


def _left_alone(name: str, value: Any) -> bool:
    """A name a run added that stays: a dunder, a submodule (an import sets it), or what torch.compile
    (dynamo) adds to the globals of a module whose function it compiled, also named with two leading
    underscores: the compiled graph (``__compiled_fn_*``), resume functions, the builtins and modules its
    bytecode reads (``__builtins_dict___0``, ``__import_*``, ``__nn_module_*``...). The code dynamo caches on
    the function looks them up there: removing them would fail the function's next call (``NameError:
    __compiled_fn_...``). They are a cache of compiled code, as a fresh process would make again."""
    return name.startswith("__") or _is_module(value)


#: c10d's tables of groups, which the process world manages itself (it destroys the groups of a run after it,
#: and the compat plugins' hidden world puts the worker's back): put back, not reported.
_MANAGED = {
    "torch.distributed.distributed_c10d": frozenset(
        ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_group_count", "_default_pg_init_method")
    )
}


def _quiet(module: str, name: str) -> bool:
    """A module-level cache (its name says so, e.g. ``_planner_cache``), or a table the process world
    manages: put back like the rest, but not reported (what a cache holds, a fresh process would compute
    again)."""
    return "cache" in name.lower() or name in _MANAGED.get(module, ())


# ------------------------------------------------------------------------------------------------------
# The process around a test: sys.path, sys.modules, the environment, the working directory, signal
# handlers, torch's global settings
# ------------------------------------------------------------------------------------------------------


class ProcessState:
    """What a process-wide state was at one moment; a part taken as None is not compared."""

    __slots__ = ("cwd", "environ", "modules", "path", "path_list", "signals", "torch")

    def __init__(
        self,
        modules: dict[str, Any],
        path: list[str] | None = None,
        environ: dict[str, str] | None = None,
        cwd: str | None = None,
        signals: dict[int, Any] | None = None,
        torch: dict[str, Any] | None = None,
    ) -> None:
        self.modules = modules
        self.path_list = sys.path
        self.path = path
        self.environ = environ
        self.cwd = cwd
        self.signals = signals
        self.torch = torch


def take_process_state(*, environ: bool = True) -> ProcessState:
    """The process-wide state now (``environ=False``: the environment and working directory not taken)."""
    return ProcessState(
        _modules_now(),
        list(sys.path),
        dict(os.environ) if environ else None,
        os.getcwd() if environ else None,
        _signal_handlers(),
        {label: get() for label, get, _ in _torch_switches()},
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
    if saved.torch is not None:
        _restore_torch(saved.torch, found, unusable)
    return found, "; ".join(unusable) or None


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
        added = _imported_since(next(reversed(known)))
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
    added = _imported_since(next(reversed(saved))) if saved else []
    if _holds(now, saved, len(added)):
        return _drop_users_modules(added)
    found: list[str] = []
    for name, module in saved.items():
        there = now.get(name, _MISSING)
        if there is not module:
            now[name] = module
            found.append(
                f"sys.modules[{name!r}]: {'removed' if there is _MISSING else 'replaced'} by the run; put back"
            )
    return found + _drop_users_modules(sorted(now.keys() - saved.keys()))


def _imported_since(newest: str) -> list[str]:
    """The names ``sys.modules`` gained since ``newest`` was its newest entry, oldest first (it keeps the
    order of insertion); none known when ``newest`` has gone since."""
    found: list[str] = []
    for name in reversed(sys.modules):
        if name == newest:
            return found[::-1]
        found.append(name)
    return []


def _users(name: str, module: Any, imported: set[str]) -> bool:
    """Whether a module among those just ``imported`` is the user's own: not of a package imported before (as
    torch's submodules, imported lazily), nor from the standard library or site-packages."""
    return name.partition(".")[0] in imported and not _from_a_library(module)


def _drop_users_modules(imported: list[str]) -> list[str]:
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
        if module is None or not _users(name, module, names):
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


# ------------------------------------------------------------------------------------------------------
# The scope of one test, as a fresh process would run it
# ------------------------------------------------------------------------------------------------------


def fresh_process_rng() -> None:
    """torch's global RNG as a new process has it (the seed of a fresh ``torch.Generator``, on the CPU and
    on the CUDA devices once CUDA is up), Python's and numpy's from fresh entropy, as a new process seeds
    them. The CPU generator is seeded by itself: ``torch.manual_seed`` asks every device (0.15 ms a call).
    torch's bases then seed all three as upstream (``common_utils.set_rng_seed``)."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        seed = torch.Generator().initial_seed()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
    random.seed()
    np: Any = sys.modules.get("numpy")
    if np is not None:  # a seed drawn from the fresh entropy: 40 times cheaper than numpy drawing all its state
        np.random.seed(random.getrandbits(32))


class FreshProcess:
    """One test's stay in a warm worker (see :func:`fresh_process`)."""

    def __init__(self, key: str | None, quiet_env: Callable[[str], bool]) -> None:
        self.key = key
        self.quiet_env = quiet_env
        self.newest = next(reversed(sys.modules))  # what the test imports comes after it
        self.state: ProcessState | None = None

    def started(self, *own: ModuleType) -> None:
        """The rank now looks like the process the harness would have started (its ``sys.path``,
        environment and working directory set, the test's module ``own`` imported): what a fresh process
        has now, the test must leave. The modules of the user's own that came with the import are kept as
        their import left them; so are ``own``, unless kept already. A later test of a held scope starts
        from where the first one did."""
        if self.state is not None:
            return
        modules = list(own)
        new = _imported_since(self.newest)
        imported = set(new)
        modules += [sys.modules[n] for n in new if _users(n, sys.modules[n], imported)]
        for module in modules:
            kept = _AS_IMPORTED.get(module.__name__)
            if kept is None or kept.module is not module:
                _AS_IMPORTED[module.__name__] = _Saved(module)
        if new:
            for watch in _WATCHES:
                watch._add_new_modules()  # a watched library the test module imported: as its import left it
        fresh_process_rng()
        self.state = take_process_state(environ=self.key is None)

    def close(self) -> tuple[list[str], str | None]:
        """Put back what the test changed; what it was, and why the worker is unusable, if it is."""
        found: list[str] = []
        unusable: list[str] = []
        try:
            if self.state is None:  # a test that never started (its module failed to import): its imports
                found.extend(_drop_users_modules(_imported_since(self.newest)))
            else:
                more, why = restore_process_state(self.state, quiet_env=self.quiet_env)
                found.extend(more)
                if why:
                    unusable.append(why)
        except Exception as exc:
            unusable.append(f"could not put back the process's state ({type(exc).__name__}: {exc})")
        for name, kept in _AS_IMPORTED.items():
            if kept.unchanged():
                continue
            try:
                found.extend(kept.restore())
            except Exception as exc:
                unusable.append(f"could not put back the globals of {name} ({type(exc).__name__}: {exc})")
        return found, "; ".join(unusable) or None


@contextlib.contextmanager
def fresh_process(
    key: str | None = None, quiet_env: Callable[[str], bool] = lambda name: False
) -> Iterator[FreshProcess]:
    """The scope of one test of another harness, in a warm worker, as that harness's fresh process would
    run it: call :meth:`FreshProcess.started` once the rank looks like that process; at the end, what the
    test changed is put back, and named in the run's ``StateLeftBehind`` warning; what cannot be put back
    has the worker replaced after the run. Both reach the parent through the run's
    :class:`ModuleStateWatch`: a run using this names ``watch_modules``.

    ``key``: the tests of one harness process that serves several (torch's continuous bases: a process
    per class) share a scope: it is held from one test to the next of the same key and put back when a
    test of another key (or none) begins in this worker, or by :func:`close_held_scope`. The environment and
    working directory, which dstest's reset gives every run anew, are not compared in a held scope.
    ``quiet_env``: environment variables put back unnamed (what the harness itself sets in every rank).
    """
    global _held
    if _held is not None and _held.key != key:
        close_held_scope()
    scope = _held if _held is not None else FreshProcess(key, quiet_env)
    _held = None
    try:
        yield scope
    finally:
        if key is None:
            _finish(scope)
        else:
            _held = scope


def close_held_scope() -> None:
    """Put back what the tests of the held scope changed (nothing when none is held)."""
    global _held
    scope, _held = _held, None
    if scope is not None:
        _finish(scope)


def _finish(scope: FreshProcess) -> None:
    found, unusable = scope.close()
    _PENDING.extend(found)
    if unusable is not None:
        _UNUSABLE.append(unusable)


def take_pending() -> tuple[list[str], str | None]:
    """What the fresh-process scopes of this run found, and why the worker is unusable after them (once)."""
    found, why = list(_PENDING), "; ".join(_UNUSABLE) or None
    _PENDING.clear()
    _UNUSABLE.clear()
    return found, why


#: The modules a scope kept as their import left them (test modules and the user's modules they import).
_AS_IMPORTED: dict[str, _Saved] = {}
_PENDING: list[str] = []
_UNUSABLE: list[str] = []
_held: FreshProcess | None = None
