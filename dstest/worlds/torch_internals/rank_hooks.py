"""torch's process-wide hook tables, per rank while rank threads are installed.

Module hooks and optimizer hooks registered with ``register_module_forward_pre_hook`` and friends run for
every module of the process; DTensor's custom op handlers are added and removed by ``loss_parallel()``.
In a world of processes each rank has its own; here each table is replaced by one that keeps what a rank
registers apart (:class:`_RankModuleHooks`) or counts who holds an entry (:class:`_CountedHandlers`).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from typing import Any

from dstest.worlds.torch_internals.installed import INSTALL

__all__ = [
    "hold_late_imports",
    "hold_module_hooks",
    "hold_op_handlers",
    "release_module_hooks",
    "release_op_handlers",
]


#: torch's process-wide module hooks (``register_module_forward_pre_hook`` and friends), by module global.
_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


class _RankModuleHooks(collections.OrderedDict):  # type: ignore[type-arg]
    """One of torch's process-wide module-hook tables while rank threads are installed.

    A hook registered on a rank thread runs for that rank's modules only, as in its own process; hooks
    registered elsewhere (before the world, on the main thread) stay in torch's own table and run for every
    thread, as before. ``CommDebugMode`` and torch's module trackers register such hooks: shared, each
    rank's mode saw every rank's modules ("The Module hierarchy tracking is wrong", KeyErrors).
    """

    def __init__(self, shared: Any) -> None:
        super().__init__()
        self.shared = shared
        self.by_rank: dict[Any, collections.OrderedDict[Any, Any]] = {}

    @staticmethod
    def _owner() -> Any:
        world = INSTALL.world
        return world.current() if world is not None else None

    def _mine(self) -> collections.OrderedDict[Any, Any] | None:
        owner = self._owner()
        return None if owner is None else self.by_rank.get(owner)

    def _holder(self, key: Any) -> Any:
        if key in self.shared:
            return self.shared
        mine = self._mine()
        if mine is not None and key in mine:
            return mine
        return next((d for d in list(self.by_rank.values()) if key in d), None)  # a copy: ranks add theirs

    def __setitem__(self, key: Any, value: Any) -> None:
        owner = self._owner()
        if owner is None:
            self.shared[key] = value
        else:
            self.by_rank.setdefault(owner, collections.OrderedDict())[key] = value

    def __getitem__(self, key: Any) -> Any:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        return holder[key]

    def __delitem__(self, key: Any) -> None:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        del holder[key]
        self._drop_empty()

    def _drop_empty(self) -> None:
        """Drop the calling rank's table once it is empty. Only its own: another rank may be adding to its
        table at this moment (iterating every rank's table raced with that: "dictionary changed size during
        iteration", and a table dropped between a rank's setdefault and its insert lost the hook)."""
        owner = self._owner()
        if owner is not None and not self.by_rank.get(owner, True):
            self.by_rank.pop(owner, None)

    def __contains__(self, key: object) -> bool:
        return self._holder(key) is not None

    def pop(self, key: Any, *default: Any) -> Any:
        holder = self._holder(key)
        if holder is None:
            if default:
                return default[0]
            raise KeyError(key)
        value = holder.pop(key)
        self._drop_empty()
        return value

    def _visible(self) -> list[tuple[Any, Any]]:
        mine = self._mine() if self.by_rank else None
        return [*self.shared.items(), *(mine.items() if mine else ())]

    def items(self) -> Any:
        return self._visible()

    def values(self) -> Any:
        return [v for _, v in self._visible()]

    def keys(self) -> Any:
        return [k for k, _ in self._visible()]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def __len__(self) -> int:  # asked on every module call: no rank hooks, no thread lookup
        if not self.by_rank:
            return len(self.shared)
        mine = self._mine()
        return len(self.shared) + (len(mine) if mine else 0)

    def __bool__(self) -> bool:
        return len(self) > 0


#: torch's process-wide optimizer hooks (``register_optimizer_step_pre_hook`` / ``_post_hook``; MemTracker).
_GLOBAL_OPTIMIZER_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _hook_modules() -> tuple[tuple[Any, tuple[str, ...]], ...]:
    """torch's modules that keep process-wide hook tables, each with the names of its tables."""
    import torch.nn.modules.module as module_module
    import torch.optim.optimizer as optimizer_module

    return ((module_module, _GLOBAL_MODULE_HOOKS), (optimizer_module, _GLOBAL_OPTIMIZER_HOOKS))


def hold_module_hooks() -> None:
    """Under the install lock: replace each of torch's module- and optimizer-hook tables with a
    :class:`_RankModuleHooks` over it, keeping torch's own in ``INSTALL.saved``."""
    for module, names in _hook_modules():
        for name in names:
            if hasattr(module, name):
                INSTALL.saved[name] = getattr(module, name)
                setattr(module, name, _RankModuleHooks(INSTALL.saved[name]))


def release_module_hooks() -> None:
    """Under the install lock: put torch's own hook tables back (hooks ranks left are dropped with them)."""
    for module, names in _hook_modules():
        for name in names:
            if name in INSTALL.saved:
                setattr(module, name, INSTALL.saved[name])


class _CountedHandlers(dict):  # type: ignore[type-arg]
    """DTensor's custom op handlers (``DTensor._op_dispatcher._custom_op_handlers``) while rank threads are
    installed: an entry added by several ranks stays until the last of them removes it.

    ``loss_parallel()`` adds its handlers on entry and pops them on exit; with ranks as threads the first
    rank to leave took them from the others still inside (a KeyError at their exit, or a backward without
    them: an all_gather the first rank never joined). The handlers are the same functions on every rank, so
    counting who holds them gives each rank what its own process would have. A real dict: torch's C++
    dispatch reads it directly.
    """

    def __init__(self, entries: Any) -> None:
        super().__init__(entries)
        self.holders: dict[Any, int] = {}

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self.holders[key] = self.holders.get(key, 0) + 1
            dict.__setitem__(self, key, value)

    def pop(self, key: Any, *default: Any) -> Any:
        count = self.holders.get(key, 0)
        if count > 1:
            self.holders[key] = count - 1
            return dict.__getitem__(self, key)
        self.holders.pop(key, None)
        return dict.pop(self, key, *default)


def hold_op_handlers() -> None:
    """Under the install lock: make DTensor's custom op handlers a :class:`_CountedHandlers`, once DTensor is
    imported (never importing it here: 0.6 s, and a module a test runner removes from ``sys.modules`` after an
    inline run must not be imported twice, which torch's operator registration refuses). Called when rank
    threads are installed and at every world start."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    dispatcher: Any = getattr(dtensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    if isinstance(handlers, dict) and not isinstance(handlers, _CountedHandlers) and "op_handlers" not in INSTALL.saved:
        INSTALL.saved["op_dispatcher"], INSTALL.saved["op_handlers"] = dispatcher, handlers
        dispatcher._custom_op_handlers = _CountedHandlers(handlers)


def hold_late_imports() -> None:
    """On a rank thread making a group: hold what a body's own imports brought in since the world started
    (DTensor's handler table, see :func:`hold_op_handlers`), before the body can use it."""
    if "torch.distributed.tensor" not in sys.modules or "op_handlers" in INSTALL.saved:
        return
    with INSTALL.lock:
        if INSTALL.users > 0:
            hold_op_handlers()


def release_op_handlers() -> None:
    """Put torch's own handler dict back, with what ranks left in it."""
    dispatcher, original = INSTALL.saved.get("op_dispatcher"), INSTALL.saved.get("op_handlers")
    if dispatcher is None or original is None:
        return
    current = getattr(dispatcher, "_custom_op_handlers", None)
    if isinstance(current, _CountedHandlers):
        original.clear()
        original.update(dict(current))
    dispatcher._custom_op_handlers = original
