"""The threaded world's rendezvous with what only rank threads need: :class:`~.rendezvous.Rendezvous` plus the
watch on what rank threads share because they share one process: the watch on module globals that hold a rank's process group (a
library keeping its groups there sees one rank's on every rank thread), and on torch's process-wide generator
(each rank draws from its own; code that calls ``torch.default_generator``'s methods reaches the shared one),
both named in failure reports.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from typing import Any

import torch

from dstest.worlds.threaded.group import Group, binding
from dstest.worlds.threaded.rendezvous import Rendezvous
from dstest.worlds.torch_internals import hold_late_imports

__all__ = ["ThreadedRendezvous", "watch_module_writes"]


#: Packages whose module globals are not the code under test's (dstest's own, torch's, the test runner's).
_NOT_LIBRARY_STATE = frozenset({"dstest", "torch", "_pytest", "pytest", "pluggy", "hypothesis", "threading"})


def _listed(items: list[str], most: int = 4) -> str:
    """The first ``most`` items of a note, and how many more."""
    return "; ".join(items[:most]) + (f"; and {len(items) - most} more" if len(items) > most else "")


#: How many items of a list, tuple or dict in a watched module's globals are looked at: a library's lists of
#: groups are short, and a module's large tables (data, caches) would otherwise be walked on every rank's
#: every new group (W x groups x their length).
LOOK_AT = 64


def _group_in(value: Any, rendezvous: Any) -> Any:
    """A group of ``rendezvous`` that ``value`` is or holds directly among its first :data:`LOOK_AT` items (a
    list, tuple or dict of groups), or None."""
    if isinstance(value, Group):
        return value if value.session is rendezvous else None
    if isinstance(value, (list, tuple)):
        items: Any = value[:LOOK_AT]
    elif isinstance(value, dict):
        items = itertools.islice(value.values(), LOOK_AT)
    else:
        return None
    return next((v for v in items if isinstance(v, Group) and v.session is rendezvous), None)


class _SharedGlobals:
    """Module globals that hold a rank's process group, seen from the modules that create groups.

    Each time a rank makes a group, the modules on its stack outside torch and dstest (the library calling
    ``new_group``: Megatron's ``parallel_state``) are watched, and their globals are looked through for this
    world's groups: a library that keeps its groups there (``_TENSOR_MODEL_PARALLEL_GROUP = group``) holds
    one rank's group for every rank thread, where each process has its own. Looked at when groups are made
    (a library makes many in a row), never per collective; named in a failure report.
    """

    def __init__(self) -> None:
        self.watched: dict[str, dict[str, Any]] = {}
        self.found: dict[str, str] = {}
        self.failed_in: str | None = None

    def group_made(self, rendezvous: Any) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            top = name.split(".", 1)[0] if isinstance(name, str) else None
            # the standard library keeps no process groups (contextlib, on every rank's start, cost 0.26 ms a
            # rank to scan: a second at 4096 ranks)
            if top is not None and top not in _NOT_LIBRARY_STATE and top not in sys.stdlib_module_names:
                self.watched.setdefault(name, frame.f_globals)
            frame = frame.f_back  # type: ignore[assignment]
        self.look(rendezvous)

    def look(self, rendezvous: Any) -> None:
        for name, module_globals in list(self.watched.items()):
            for attr, value in list(module_globals.items()):
                group = _group_in(value, rendezvous)
                if group is not None and f"{name}.{attr}" not in self.found:
                    self.found[f"{name}.{attr}"] = f"rank {group.owner}'s group {group.label}"

    def failed(self, rendezvous: Any, exc: BaseException) -> None:
        """A rank failed: look again, and remember where, if it failed in a module that makes groups."""
        self.look(rendezvous)
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            name = frame.f_globals.get("__name__", "")
            if name in self.watched and frame.f_globals is self.watched[name]:
                self.failed_in = f"{name}.{frame.f_code.co_name}"
            tb = tb.tb_next

    def note(self) -> str:
        if not self.found and self.failed_in is not None:
            return (
                f"\nnote: the rank failed in {self.failed_in}, code of a module that makes this world's process "
                "groups. Rank threads share a module's globals, where each process of a world has its own: if it "
                "keeps its groups or state there (as Megatron's parallel_state does), every rank sees one rank's. "
                'Run such code with world="process" (@dstest.spec(worlds=["process"])).'
            )
        if not self.found:
            return ""
        shown = _listed([f"{where} ({what})" for where, what in self.found.items()])
        return (
            f"\nnote: module globals held this world's process groups: {shown}. Rank threads share a module's "
            "globals, where each process of a world has its own, so a library that keeps its groups there (as "
            "Megatron's parallel_state does) sees one rank's state on every rank. Run such code with "
            'world="process" (@dstest.spec(worlds=["process"])).'
        )


class ThreadedRendezvous(Rendezvous):
    """The rendezvous of rank threads: adds the watch on what rank threads share that processes would not."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._shared_rng_state = torch.default_generator.get_state()
        self.shared_globals = _SharedGlobals()
        self.module_writes: dict[str, list[int]] = {}  # "module.attribute" -> the ranks that rebound it

    def note_module_write(self, module: str, attribute: str, rank: int) -> None:
        ranks = self.module_writes.setdefault(f"{module}.{attribute}", [])
        if rank not in ranks:
            ranks.append(rank)

    def module_write_note(self) -> str:
        """For a report: the attributes of shared modules that a rank rebound during the run, and which rank."""
        if not self.module_writes:
            return ""
        shown = _listed([f"{where} (by rank {', '.join(map(str, r))})" for where, r in self.module_writes.items()])
        return (
            f"\nnote: a rank rebound an attribute of a module during the run: {shown}. Rank threads share one "
            "module object, where each process of a world has its own: every rank saw the rank's replacement "
            "(unittest.mock.patch, torch's patch_* helpers, mod.name = ...), and a rank's restore undid it for "
            'all. Run such a test with worlds=["process"].'
        )

    def thread_shared(self) -> list[str]:
        """What this run shared between rank threads that processes would not (empty: nothing seen)."""
        found = [f"{where} rebound by rank {', '.join(map(str, r))}" for where, r in self.module_writes.items()]
        found += [f"{where} held {what}" for where, what in self.shared_globals.found.items()]
        if self._generator_moved():
            found.append("torch.default_generator moved (used by name on a rank thread)")
        return found

    def _generator_moved(self) -> bool:
        """Whether torch's process-wide generator moved since the run began (rank threads draw from their own)."""
        return not torch.equal(torch.default_generator.get_state(), self._shared_rng_state)

    def register_group(self, group: Any) -> None:
        super().register_group(group)
        hold_late_imports()
        self.shared_globals.group_made(self)

    def rng_note(self) -> str:
        """For a failure report: whether torch's process-wide generator moved during the run.

        Each rank thread draws from a generator of its own (``torch_internals.rank_rng``); what still reaches
        the shared one is code that calls ``torch.default_generator``'s own methods (``manual_seed``,
        ``set_state``), which every rank thread shares where each process has its own."""
        if not self._generator_moved():
            return ""
        return (
            "\nnote: torch's process-wide generator (torch.default_generator) moved during the run. Each rank "
            "thread draws from a generator of its own, but code that calls torch.default_generator's methods "
            "(manual_seed, set_state) reaches the one object all rank threads share, where each process has its "
            "own. Use torch.manual_seed / torch.set_rng_state (per rank on threads), or run the spec with "
            'worlds=["process"].'
        )

    def reset(self) -> None:
        super().reset()
        self._shared_rng_state = torch.default_generator.get_state()
        if self.shared_globals.watched or self.shared_globals.found or self.shared_globals.failed_in is not None:
            self.shared_globals = _SharedGlobals()
        if self.module_writes:
            self.module_writes = {}


# -- module attributes a rank rebinds ---------------------------------------------------------------------------
_MISSING = object()
_WATCH_LOCK = threading.Lock()
_watched_count = 0  # len(sys.modules) at the last scan


class _WatchedModule(types.ModuleType):
    """A module whose attribute writes from a rank thread are noted in the rank's rendezvous.

    ``unittest.mock.patch("pkg.mod.fn")``, torch's ``patch_*`` test helpers and ``mod.fn = other`` rebind an
    attribute of a module object every rank thread shares, where each process of a world has its own module:
    every rank then calls one rank's replacement (with that rank's closure), and one rank's restore undoes the
    others'. A module's own ``global`` writes go to its dict and are not seen (module state, not a patch);
    writes to the standard library's modules are left out (``warnings.catch_warnings`` rebinds
    ``warnings.filters`` on entry and exit: bookkeeping of the interpreter, not the code under test)."""

    def __setattr__(self, name: str, value: Any) -> None:
        _note_write(self, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        _note_write(self, name, _MISSING)
        super().__delattr__(name)


def _note_write(module: types.ModuleType, name: str, value: Any) -> None:
    rendezvous = getattr(binding, "session", None)
    if not isinstance(rendezvous, ThreadedRendezvous):
        return  # not a rank thread of the threaded world (or no run)
    old = module.__dict__.get(name, _MISSING)
    if old is _MISSING or old is value:
        return  # a new name (an import binding a submodule, a cache filled), or the same object again
    if isinstance(value, types.ModuleType) and value.__name__ == f"{module.__name__}.{name}":
        return  # an import binding the submodule it loaded
    if module.__name__.partition(".")[0] in sys.stdlib_module_names:
        return  # the interpreter's bookkeeping (warnings.catch_warnings restores warnings.filters), not the code under test
    if sys._getframe(2).f_code.co_name == "<module>":
        return  # a module's import-time code (torch._dynamo wraps torch.manual_seed when first imported): as in a process
    rendezvous.note_module_write(module.__name__, name, binding.rank)


def watch_module_writes() -> None:
    """Before a run: watch writes to the attributes of every plain module imported since the last scan.

    A plain module's class becomes :class:`_WatchedModule` (Python allows it for ``types.ModuleType``
    instances); other module classes (lazy modules, torch's config modules) are left as they are. The watch
    stays for the process's life: outside a threaded run, a write costs one Python call and notes nothing."""
    global _watched_count
    if len(sys.modules) == _watched_count:
        return
    with _WATCH_LOCK:
        for module in list(sys.modules.values()):
            if type(module) is types.ModuleType and module.__name__ not in sys.builtin_module_names:
                try:
                    module.__class__ = _WatchedModule
                except TypeError:
                    pass
        _watched_count = len(sys.modules)
