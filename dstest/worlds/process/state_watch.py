"""Module-level state a run leaves behind in a warm worker: found by comparison, put back, named.

A warm worker serves one run after another; a fresh process would start each of them with the libraries'
module globals as importing them left them. Hand-kept resets (:mod:`dstest.resets`) undo what is known to
change; this watch catches what nobody listed, generically. For the module prefixes a run names
(``RunRequest.watch_modules``, e.g. ``("deepspeed",)``), the worker keeps, at the first run that names them,
each watched module's globals: the object bound to every name, and a shallow copy of every dict, list and
set. After each run it compares:

- a name bound to another object, or a name the run added: the old binding is put back (the added name is
  removed);
- a dict, list or set changed in place: its contents are put back;
- anything that cannot be put back (a module that refuses the assignment) makes the worker unusable: the
  pool replaces it before the next run.

A cache (a name containing "cache") and c10d's tables of groups (which the world manages itself) are put
back without a report; what torch.compile adds to the globals of a module it compiled a function of
(names with two leading underscores: ``__compiled_fn_*``, ``__import_*``...) is left in place, unreported:
the compiled code cached on the function looks it up there. Each other difference is reported as
``module.name`` with what was done, and the parent warns with :class:`dstest.errors.StateLeftBehind`, a
finding about the code under test: it would have reached the next test. What is compared is bindings and
the shallow contents of containers; an object changed through its own attributes (``obj.field = x`` on a
module-level object) is not seen. Modules first imported during a run are watched from the end of that run
on.
"""

from __future__ import annotations

import operator
import sys
from itertools import repeat
from types import ModuleType
from typing import Any

__all__ = ["ModuleStateWatch"]

_CONTAINERS = (dict, list, set)


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


class _Saved:
    """One module's globals when watching began: name -> (object, shallow copy of a container or None)."""

    __slots__ = ("benign", "bindings", "containers", "module", "names", "values")

    benign: set[str]

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.bindings = {
            name: (value, _copy(value))
            for name, value in vars(module).items()
            if not (name.startswith("__") and name.endswith("__")) and not _is_module(value)
        }
        # The same, laid out for the check after every run, which finds nothing changed nearly always.
        self.names = tuple(self.bindings)
        self.values = tuple(value for value, _ in self.bindings.values())
        self.containers = tuple((value, copy) for value, copy in self.bindings.values() if copy is not None)
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


class ModuleStateWatch:
    """The watched modules of one worker, by prefix (a module ``p`` or any ``p.x``)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.saved: dict[str, _Saved] = {}
        self._seen: set[str] = set()
        self._add_new_modules()

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
        """After a run: what it left changed (each put back), and why the worker is unusable, if it is."""
        found: list[str] = []
        unusable = None
        for name, saved in self.saved.items():
            if saved.unchanged():
                continue
            try:
                found.extend(self._restore_module(name, saved))
            except Exception as exc:  # a module that refuses: only a fresh process is clean
                unusable = f"could not put back the module-level state of {name} ({type(exc).__name__}: {exc})"
                found.append(f"{name}: changed, and could not be put back; the worker is replaced")
        self._add_new_modules()
        return found, unusable

    @staticmethod
    def _restore_module(name: str, saved: _Saved) -> list[str]:
        found: list[str] = []
        namespace = vars(saved.module)
        for attr in [a for a in namespace if a not in saved.bindings]:
            value = namespace[attr]
            if _left_alone(attr, value):
                continue
            del namespace[attr]
            if not _quiet(name, attr):
                found.append(f"{name}.{attr}: added by the run ({type(value).__name__}); removed")
        for attr, (value, copy) in saved.bindings.items():
            now = namespace.get(attr, _MISSING)
            if now is not value and copy is not None and type(now) is type(value) and _same_contents(copy, now):
                continue  # a fresh container equal to the saved one (what a reset makes): nothing to report
            if now is not value:
                namespace[attr] = value
                was = "deleted" if now is _MISSING else f"rebound to a {type(now).__name__}"
                if not _quiet(name, attr):
                    found.append(f"{name}.{attr}: {was}; put back")
            elif copy is not None and not _same_contents(copy, value):
                _restore_contents(value, copy)
                if not _quiet(name, attr):
                    found.append(f"{name}.{attr}: its {type(value).__name__} changed in place; contents put back")
        return found


_MISSING = object()


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
