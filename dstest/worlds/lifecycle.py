"""The open worlds of this process, and the one path that closes them: the end of a test session, and exit.

A world may keep something alive between runs (warm rank threads, worker pools, a launcher's store). It is
*open* from the moment :func:`dstest.worlds.get_world` hands it out (one instance per name, see
:func:`open_world`) until :func:`close_all`, which calls every open world's ``close()``, newest first. The
pytest plugin calls :func:`close_all` when its session ends; it also runs at interpreter exit, registered
once, when the first world opens. Plug-in worlds take part through the same two steps, knowing nothing of
this module.

What a world keeps may also be made outside :func:`~dstest.worlds.get_world` (``ThreadedWorld(warm=True)``
in a script, the process pools a ``ProcessWorld`` made by hand starts): the module that keeps it hands its
closer to :func:`keep` when it first keeps something, so that :func:`close_all` stops it too.

Torch-free: the plugin imports it at the end of every session.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["close_all", "keep", "open_names", "open_world"]

_LOCK = threading.Lock()
_WORLDS: dict[Hashable, Any] = {}  # key -> the open world handed out under it
_CLOSERS: dict[Hashable, Callable[[], None]] = {}  # in the order they opened
_at_exit = False


def _remember(key: Hashable, close: Callable[[], None]) -> None:
    """Under the lock: ``close`` runs at :func:`close_all`; the first one registers it for exit."""
    global _at_exit
    _CLOSERS.setdefault(key, close)
    if not _at_exit:
        atexit.register(close_all)
        _at_exit = True


def open_world(key: Hashable, make: Callable[[], Any]) -> Any:
    """The open world under ``key``, made by ``make()`` and opened if there is none (one world per key until
    :func:`close_all`)."""
    with _LOCK:
        world = _WORLDS.get(key)
    if world is not None:
        return world
    made = make()
    with _LOCK:
        world = _WORLDS.setdefault(key, made)
        close = getattr(world, "close", None)
        if callable(close):
            _remember(("world", key), close)
    return world


def keep(key: Hashable, close: Callable[[], None]) -> None:
    """Run ``close`` at :func:`close_all` (once per key): for what a module keeps warm outside any world
    :func:`open_world` handed out."""
    with _LOCK:
        _remember(("kept", key), close)


def open_names() -> list[Hashable]:
    """The keys of what is open now, oldest first (for reports and tests)."""
    with _LOCK:
        return list(_CLOSERS)


def close_all() -> None:
    """Close every open world and everything kept, newest first, each once; forget them all.

    Every closer runs even when one raises; the first error is raised afterwards.
    """
    with _LOCK:
        closers = list(_CLOSERS.values())
        _CLOSERS.clear()
        _WORLDS.clear()
    first: BaseException | None = None
    for close in reversed(closers):
        try:
            close()
        except Exception as exc:  # the others must still close
            first = first or exc
    if first is not None:
        raise first
