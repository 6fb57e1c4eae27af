"""Each rank thread's own c10d state: a subclass of torch's ``distributed_c10d._World`` with no field shared.

torch keeps c10d's state (default group, group tables, counters) process-wide: in module globals behind
properties of the single ``_world`` object, and on that object itself. Ranks as threads of one process
each need their own, as each process of a real world has. :class:`ThreadLocalWorld` stands in for
``distributed_c10d._world`` and hands each rank thread the state :func:`new_rank_state` made for it; the
rest of the module reads and resets that state between runs of a warm world.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

from dstest.worlds.torch_internals.installed import HOOKS, INSTALL

__all__ = [
    "FreshRunState",
    "RankState",
    "ThreadLocalWorld",
    "abort_process_group",
    "adopt_rank_state",
    "c10d_state",
    "current_rank_state",
    "default_group",
    "drop_subgroups",
    "global_backed_fields",
    "new_rank_state",
    "unisolated_world_fields",
]


class _GroupTable(dict):  # type: ignore[type-arg]
    """One of c10d's per-group tables, keyed by process group, that also answers for a *foreign* group.

    A group object that crossed to another rank's thread (a module-level cache, a default argument
    evaluated once) is looked up as the calling rank's own group with the same name and ranks, as each
    process would find its own group in a world of processes (``HOOKS.translate``).
    """

    def _local(self, key: Any) -> Any:
        translate = HOOKS.translate
        if translate is None:
            return None
        local = translate(key)
        return local if local is not None and local is not key and dict.__contains__(self, local) else None

    def __missing__(self, key: Any) -> Any:
        local = self._local(key)
        if local is None:
            raise KeyError(key)
        return dict.__getitem__(self, local)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._local(key) is not None

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


#: The types of module globals of ``distributed_c10d`` that hold c10d state (tables, lists, counters).
_STATE_TYPES = (dict, list, set, int)


def _reads_module_state(getter: Callable[..., Any]) -> list[str]:
    """The module globals of ``distributed_c10d`` holding state that a property getter of ``_World`` reads."""
    code = getattr(getter, "__code__", None)
    if code is None:
        return []
    module = vars(c10d)
    return [
        name for name in code.co_names if name in module and type(module[name]) in _STATE_TYPES and not name.isupper()
    ]


@functools.cache
def global_backed_fields() -> dict[str, list[str]]:
    """``{field: [module global, ...]}``: the properties of torch's ``_World`` backed by module globals.

    torch 2.11-2.15 keep most of c10d's state (``_pg_map``, ``_pg_names``, ``_group_count``, ...) in module
    globals behind properties of the single ``_world`` object, and the rest (``_default_pg``,
    ``_pg_coalesce_state``, 2.15's ``_pg_flight_recorder_hooks``, ...) on the object itself. Found by reading
    the getters' code, so that a field torch adds later in the same way is found too.
    """
    found: dict[str, list[str]] = {}
    for klass in reversed(c10d._World.__mro__):
        for name, attr in vars(klass).items():
            if isinstance(attr, property) and attr.fget is not None and name != "pg_config_info":
                names = _reads_module_state(attr.fget)
                if names:
                    found[name] = names
    return found


def _stored(field: str) -> property:
    """A property of the per-thread world that keeps ``field`` on the instance instead of in a module global."""
    slot = f"_dstest_{field}"

    def get(self: Any) -> Any:
        return self.__dict__[slot]

    def put(self: Any, value: Any) -> None:
        self.__dict__[slot] = value

    return property(get, put, doc=f"``_World.{field}``, kept per rank thread by dstest.")


def _empty_like_global(field: str, names: list[str]) -> Any:
    """A fresh, empty value of the type of the module global behind ``field`` (tables keyed by group
    answer for a foreign rank's group, see :class:`_GroupTable`)."""
    value = vars(c10d)[names[0]]
    if isinstance(value, dict):
        return _GroupTable() if field.startswith("pg_") else {}
    return type(value)()


@functools.cache
def _per_thread_world_class() -> type:
    """A subclass of the running torch's own ``distributed_c10d._World`` whose every field is per instance.

    ``_World.__init__`` gives each instance its own copy of what torch keeps on the object (a field torch
    adds there later comes for free, as 2.15's ``pg_flight_recorder_hooks`` did); the properties backed by
    module globals (:func:`global_backed_fields`) are overridden to keep their value on the instance.
    """
    fields = global_backed_fields()
    namespace: dict[str, Any] = {name: _stored(name) for name in fields}

    def __init__(self: Any) -> None:
        c10d._World.__init__(self)
        for name, names in fields.items():
            self.__dict__[f"_dstest_{name}"] = _empty_like_global(name, names)

    namespace["__init__"] = __init__
    namespace["__doc__"] = "The c10d state of one rank thread: torch's ``_World`` with no field shared."
    namespace["__module__"] = __name__
    return type("PerThreadWorld", (c10d._World,), namespace)


#: One rank thread's c10d state: an instance of :func:`_per_thread_world_class` (a subclass of torch's
#: ``_World``, made at run time).
RankState = Any


def new_rank_state() -> RankState:
    """The c10d state (``distributed_c10d._World``) of one rank thread, sharing nothing with another's."""
    return _per_thread_world_class()()


def unisolated_world_fields() -> list[str]:
    """What two rank threads' c10d states would still share under the running torch, one line per field.

    Every public field of torch's ``_World`` is read on two fresh per-thread states: a container that is the
    same object on both, or a value set on one that the other then reads, is shared. Empty when nothing is.
    """
    a, b = new_rank_state(), new_rank_state()
    problems: list[str] = []
    for name in dir(c10d._World):
        attr = getattr(c10d._World, name, None)
        if name.startswith("_") or not isinstance(attr, property) or name == "pg_config_info":
            continue
        first, second = getattr(a, name), getattr(b, name)
        if first is second and isinstance(first, (dict, list, set)):
            problems.append(f"_World.{name} is one {type(first).__name__} shared by every rank thread")
        elif attr.fset is not None and isinstance(first, int) and not isinstance(first, bool):
            setattr(a, name, first + 12345)
            if getattr(b, name) == first + 12345:
                problems.append(f"_World.{name}: a value set on one rank thread is read on another")
            setattr(a, name, first)
    return [
        f"{p} (torch {torch.__version__}: the per-thread world in dstest/worlds/torch_internals/c10d_world.py must keep it per rank)"
        for p in problems
    ]


class _Slot(threading.local):
    state: Any = None  # the rank thread's RankState; None on other threads


class ThreadLocalWorld:
    """Stands in for ``distributed_c10d._world``: rank threads see their own state, others the original."""

    def __init__(self, original: Any) -> None:
        self._original = original
        self._local = _Slot()

    def bind(self) -> RankState:
        """Give the calling (rank) thread its own c10d state and keep its backward on this thread.

        Autograd runs backward of CUDA tensors on its own device threads, where the rank's thread-local
        state is invisible, so gradient hooks that issue collectives would find no process group. The
        switch is per thread (autograd state is thread-local), hence set here, on the rank thread.
        """
        torch.autograd.set_multithreading_enabled(False)
        state = new_rank_state()
        self._local.state = state
        return state

    def adopt(self, state: RankState | None) -> None:
        """Make the calling (helper) thread share a rank's state, or drop it (None)."""
        if state is None:
            self._local.state = None
        else:
            torch.autograd.set_multithreading_enabled(False)
            self._local.state = state

    def current(self) -> RankState | None:
        return self._local.state

    def unbind(self) -> None:
        self._local.state = None

    def _target(self) -> Any:
        return self._local.state or self._original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local.state or self._original, name)

    # torch reads the default group on every collective (``GroupMember.WORLD``, ``is_initialized``): a
    # property here skips the failed lookup that precedes ``__getattr__``; setting goes through ``__setattr__``.
    @property
    def default_pg(self) -> Any:
        return (self._local.state or self._original).default_pg

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_original", "_local"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    # ``pg_config_info`` is a computed property on torch's _World; keep the original's behaviour.
    @property
    def pg_config_info(self) -> list[dict[str, Any]]:
        return [{"pg_name": self.pg_names[pg], "ranks": list(self.pg_group_ranks[pg])} for pg in self.pg_map]


def current_rank_state() -> RankState | None:
    """The calling rank thread's c10d state (to hand to a thread it starts)."""
    world = INSTALL.world
    return world.current() if world is not None else None


def adopt_rank_state(state: RankState | None) -> None:
    """Make the calling thread use a rank's c10d state (None: drop it)."""
    world = INSTALL.world
    if world is not None:
        world.adopt(state)


def drop_subgroups() -> None:
    """On a rank thread between runs: forget every group but the default one, in c10d and its registry.

    dstest's groups are Python ProcessGroups; the state is this thread's own, so it is dropped directly
    rather than through ``destroy_process_group`` (which would also tear down what a run never built).
    """
    state = _own_state()
    pg_map, default_pg = state.pg_map, state.default_pg
    if len(pg_map) == 1 and default_pg in pg_map:  # most runs make no subgroup: nothing to drop
        return
    dropped = [pg for pg in list(pg_map) if pg is not default_pg]
    if not dropped:
        return
    tables = _group_tables(state)
    for pg in dropped:
        name = dict.get(state.pg_names, pg)
        for table in tables:
            dict.pop(table, pg, None)
        for pgs in state.tags_to_pg.values():
            while pg in pgs:
                pgs.remove(pg)
        if name is not None:
            with contextlib.suppress(RuntimeError, KeyError):
                torch._C._distributed_c10d._unregister_process_group(name)


def _own_state() -> Any:
    """The calling thread's c10d state object itself: a rank thread's own (not the stand-in that looks it up
    on every attribute), or the process's."""
    state = c10d._world
    return state._target() if isinstance(state, ThreadLocalWorld) else state


_TABLE_NAMES: dict[type, tuple[str, ...]] = {}  # per c10d state class: its attributes named pg_*


def _group_tables(state: Any) -> list[dict[Any, Any]]:
    """Every table of a c10d state keyed by process group (torch names them ``pg_*``)."""
    names = _TABLE_NAMES.get(type(state))
    if names is None:
        names = _TABLE_NAMES[type(state)] = tuple(
            n for n in dir(type(state)) if n.startswith("pg_") and n != "pg_config_info"
        )
    tables = []
    for name in names:
        value = getattr(state, name, None)
        if isinstance(value, dict):
            tables.append(value)
    return tables


class FreshRunState:
    """On a rank of a warm world: give each run the group names and store keys a fresh world would have.

    torch names groups "1", "2", ... from ``_world.group_count`` and keeps their rendezvous keys in the
    default store under that name, so a second run on the same ranks would otherwise name its first
    group after the groups of earlier runs (what a user sees in ``pg_names`` and traces), and a run
    reusing a name would read the keys of a dead group. Made right after the default group is formed;
    ``begin`` gives a run the default store under its own prefix (every rank gets the same run id) and
    restarts the count where a fresh world starts it, ``end`` puts both back.
    """

    def __init__(self) -> None:
        state = c10d._world
        self.group_count = state.group_count
        default_pg = state.default_pg
        assert default_pg is not None, "made once the rank's default group is formed"
        self.default_pg = default_pg
        self.backend, self.store = state.pg_map[default_pg]

    def begin(self, run_id: int) -> None:
        state = _own_state()
        prefixed = torch._C._distributed_c10d.PrefixStore(f"dstest-run{run_id}/", self.store)
        state.pg_map[self.default_pg] = (self.backend, prefixed)
        state.group_count = self.group_count

    def end(self) -> None:
        state = _own_state()
        state.pg_map[self.default_pg] = (self.backend, self.store)
        state.group_count = self.group_count


def c10d_state() -> Any:
    """The calling rank thread's c10d state (``distributed_c10d._world``, thread-local in a world)."""
    return c10d._world


def default_group() -> Any:
    """The calling rank's default process group: ``distributed_c10d._get_default_group()`` (torch 2.11-2.15;
    raises when none is formed)."""
    return c10d._get_default_group()


def abort_process_group() -> None:
    """Abort the default group's communicators: ``distributed_c10d._abort_process_group()`` (torch 2.11-2.15),
    which makes a hung NCCL call return (a blocked gloo call fails once a peer's group closes, NCCL's waits)."""
    c10d._abort_process_group()
