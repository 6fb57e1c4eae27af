"""The module globals of the packages a run names (``RunRequest.watch_modules``): kept at the first run that
names them, compared after every run, put back, and named; and the findings of the fresh-process scopes of
the run (:mod:`~dstest.worlds.process.state_watch.fresh_scope`), which reach the parent with this watch's.
See :mod:`dstest.worlds.process.state_watch` for what is compared and what is reported.
"""

from __future__ import annotations

import operator
import sys
import weakref
from itertools import repeat
from types import ModuleType
from typing import Any

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


class SavedGlobals:
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
        self.saved: dict[str, SavedGlobals] = {}
        self._seen: set[str] = set()
        self.add_new_modules()
        WATCHES.add(self)

    def _watched(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def add_new_modules(self) -> None:
        """Keep the globals of the watched modules imported since the last look, as they are now."""
        names = sys.modules.keys() - self._seen  # only the modules imported since the last look
        self._seen.update(names)
        for name in names:
            module = sys.modules.get(name)
            if isinstance(module, ModuleType) and self._watched(name):
                self.saved[name] = SavedGlobals(module)

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
        self.add_new_modules()
        return found, unusable


#: Every watch of this worker: a fresh-process scope has them look at the modules a test module imported as
#: soon as it is imported, so that those are kept as their import left them, not as the first test did.
WATCHES: weakref.WeakSet[ModuleStateWatch] = weakref.WeakSet()


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



def add_pending(found: list[str], unusable: str | None) -> None:
    """What a fresh-process scope found when it closed, and why the worker is unusable after it: handed to
    the parent with the run's watch (:meth:`ModuleStateWatch.check_and_restore`)."""
    _PENDING.extend(found)
    if unusable is not None:
        _UNUSABLE.append(unusable)


def take_pending() -> tuple[list[str], str | None]:
    """What the fresh-process scopes of this run found, and why the worker is unusable after them (once)."""
    found, why = list(_PENDING), "; ".join(_UNUSABLE) or None
    _PENDING.clear()
    _UNUSABLE.clear()
    return found, why


_PENDING: list[str] = []
_UNUSABLE: list[str] = []
