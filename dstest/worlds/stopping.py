"""Stopping the threads of a world run and reading their stacks: shared by every world that runs threads
(the threaded and the fake world's ranks, the launched world's readers) and by the reports of the process
world (its workers' stacks).

Rank threads never format anything: they record the exception, and the caller's thread formats every
report after the ranks have stopped, under one lock (CPython 3.11 computes traceback carets with
``ast.parse``, which is not safe to run from several threads at once; :func:`format_exception`,
:func:`stacks_of`). Threads that cannot be stopped (stuck in C code) are named in the report, never reused,
and counted (:func:`stuck_threads`). Torch-free: the process world's parent imports it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import re
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from dstest.errors import WorldAborted

__all__ = [
    "current_frames",
    "format_exception",
    "format_stacks",
    "interrupt",
    "reap",
    "repair_logging_locks",
    "stacks_of",
    "stuck_threads",
]

_FORMAT_LOCK = threading.Lock()
_STUCK: list[threading.Thread] = []
_STUCK_LOCK = threading.Lock()


def stuck_threads() -> list[str]:
    """Names of rank threads this process could not stop (still alive); each is reported once, when it stuck."""
    with _STUCK_LOCK:
        _STUCK[:] = [t for t in _STUCK if t.is_alive()]
        return [t.name for t in _STUCK]


def format_exception(exc: BaseException) -> str:
    """``exc`` with its traceback, formatted under the one lock every report takes."""
    with _FORMAT_LOCK:
        return "".join(traceback.format_exception(exc))


def current_frames() -> dict[int, FrameType]:
    """Every thread's current frame (``sys._current_frames``), taken safely."""
    # CPython 3.11 (gh-106883): a garbage collection triggered inside sys._current_frames() while it holds
    # the runtime's thread-list lock can finalize a threading.local, which takes that lock again: the
    # process hangs. Keep the collector off for the call.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def stacks_of(threads: list[threading.Thread], frames: dict[int, FrameType] | None = None) -> dict[int, str]:
    if frames is None:
        frames = current_frames()
    out = {}
    with _FORMAT_LOCK:
        for rank, t in enumerate(threads):
            frame = frames.get(t.ident) if t.ident is not None else None
            if frame is not None:
                out[rank] = "".join(traceback.format_stack(frame))
    return out


def format_stacks(stacks: dict[int, str]) -> str:
    return "\n".join(f"---- rank {r} stack ----\n{s}" for r, s in sorted(stacks.items()))


def _async_raise(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise ``exc`` inside a rank thread stuck in Python code (the only way to stop a hung thread)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


INTERRUPT_AFTER_S = 0.05
INTERRUPT_EVERY_S = 0.4
_LOGGING_DIR = os.path.dirname(logging.__file__) + os.sep


def _in_logging(frame: FrameType | None) -> bool:
    """Whether a stack has a frame of the logging package (a handler's lock may be held there)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LOGGING_DIR):
            return True
        frame = frame.f_back
    return False


def interrupt(threads: list[threading.Thread], running: Any, grace: float) -> None:
    """Give ``threads`` ``grace`` seconds to leave their function, raising WorldAborted into those that
    still run it (``running()`` returns the threads still inside it).

    A rank blocked in a collective leaves on its own at the abort, so the first WorldAborted is raised
    ``INTERRUPT_AFTER_S`` in, and again only every ``INTERRUPT_EVERY_S`` for a rank that swallowed it. An
    asynchronous exception can land anywhere, including inside the ``finally`` clauses it is unwinding
    through: raised every few milliseconds, a second one skipped ``logging.Handler.release()`` in torch's
    per-collective logging and left the handler's lock held, hanging every later log call. It can also land
    between a handler's ``acquire()`` and the ``try`` that releases it (``logging.Handler.handle``): pytest
    attaches its handlers to torch's c10d logger, which logs every failing collective, so a rank unwinding a
    mismatch is often there. A rank found inside the logging package is therefore let through for up to
    ``INTERRUPT_EVERY_S`` more, looked at every 10 ms, and interrupted when it is out (a rank that logs in a
    loop is interrupted at the end of that time wherever it is); a lock an interrupt left held is replaced
    when this returns (:func:`repair_logging_locks`).
    """
    start = time.monotonic()
    end = start + grace
    due: dict[threading.Thread, float] = {}
    waited: dict[threading.Thread, float] = {}
    interrupted: set[int] = set()
    try:
        while True:
            now = time.monotonic()
            alive = [t for t in running() if t.is_alive()]
            if not alive or now >= end:
                return
            ready = [t for t in alive if now >= due.get(t, start + INTERRUPT_AFTER_S)]
            if ready:
                frames = current_frames()
                for t in ready:
                    if t.ident is None:
                        continue
                    if _in_logging(frames.get(t.ident)) and now < waited.setdefault(t, now + INTERRUPT_EVERY_S):
                        continue  # looked at again in 10 ms
                    waited.pop(t, None)
                    _async_raise(t, WorldAborted)
                    interrupted.add(t.ident)
                    due[t] = now + INTERRUPT_EVERY_S
            time.sleep(0.01)
    finally:
        if interrupted:
            repair_logging_locks(interrupted)


_OWNER = re.compile(r"owner=(\d+)")


def _logging_locks() -> list[tuple[Any, str]]:
    """The logging package's own lock and every live handler's: (holder, attribute)."""
    out: list[tuple[Any, str]] = [(logging, "_lock")]
    seen: set[int] = set()
    handlers: list[logging.Handler] = []
    for ref in list(getattr(logging, "_handlerList", [])):
        h = ref()
        if h is not None:
            handlers.append(h)
    for lg in [logging.getLogger(), *list(logging.Logger.manager.loggerDict.values())]:
        handlers.extend(getattr(lg, "handlers", []))
    for h in handlers:
        if id(h) not in seen:
            seen.add(id(h))
            out.append((h, "lock"))
    return out


def repair_logging_locks(owners: set[int]) -> int:
    """Give a new lock to every logging lock held by one of the threads ``owners`` that is no longer inside
    the logging package (dead, or out of the call an interrupt cut short): no one else can ever release it.

    Returns how many locks were replaced.
    """
    frames = current_frames()
    replaced = 0
    for holder, attr in _logging_locks():
        lock = getattr(holder, attr, None)
        if lock is None:
            continue
        m = _OWNER.search(repr(lock))
        owner = int(m.group(1)) if m else 0
        if owner not in owners or _in_logging(frames.get(owner)):
            continue
        if isinstance(holder, logging.Handler):
            holder.createLock()
        else:
            setattr(holder, attr, threading.RLock())
        replaced += 1
    return replaced


def reap(threads: list[threading.Thread], grace: float) -> list[str]:
    """Stop ``threads``: join them for up to ``grace`` seconds, interrupting those stuck in Python code.

    Returns the names of threads that could not be stopped (stuck in C code); they are kept in the
    stuck-thread count.
    """
    end = time.monotonic() + min(grace, 0.2)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    interrupt(threads, lambda: threads, max(0.0, grace - 0.2))
    for t in threads:
        t.join(0.05)
    left = [t for t in threads if t.is_alive()]
    with _STUCK_LOCK:
        _STUCK.extend(left)
    return [t.name for t in left]
