"""Parked threads: the bare threads of large cold runs, kept between runs instead of started and ended each
time (opt-in: ``DSTEST_PARKED_THREADS``, default 0).

A cold world of thousands of ranks starts a thread per rank and ends it after the run (0.3 ms a start
alone, measured in ``benchmarks/bench_scale.py``). Parked, such threads hold no rank state (no c10d state,
default group, generator, context), wait for their next rank, and serve a later cold run of 128 ranks or
more. Off by default: measured at 4096 ranks on a loaded 2-core machine, handing 4096 parked threads their
ranks took 2 ms a thread (7.5-10 s until every rank had started, one thread after another as
``Thread.start`` does), against 0.4 ms a new thread: a parked thread's wake-up waits for a CPU, where a new
thread's start did not (the cause is not known yet).

A thread serves each rank as a new thread would: the rank's function runs in a fresh ``contextvars``
context, and afterwards the thread's ``threading.local`` values and per-thread caches are dropped
(:func:`~dstest.worlds.torch_internals.clear_thread_locals`), grad mode and autograd's multithreading switch
are put back, and what else torch keeps per thread in C++ (:func:`~dstest.worlds.torch_internals.
thread_state`: dispatch keys, mode stacks, inference mode, autocast) is compared with the thread's state at
its start. A thread whose state differs ends instead of parking; so do the threads of a run that was
aborted, timed out or interrupted (an exception raised into a thread may still be on its way).

At most :func:`parked_thread_cap` threads are kept; :func:`shutdown_parked` ends them (the session's end,
interpreter exit, ``ThreadedWorld.close()``).
"""

from __future__ import annotations

import contextvars
import itertools
import queue
import threading
import time
from collections.abc import Callable

import torch

from dstest.worlds import lifecycle, torch_internals
from dstest.worlds.stopping import reap
from dstest.worlds.threaded.crews import thread_count_setting

__all__ = [
    "PARK_FROM",
    "ParkedThread",
    "give_back",
    "parked_thread_cap",
    "parked_threads",
    "retire",
    "shutdown_parked",
    "take",
]

#: Cold worlds of this many ranks and more run on parked threads when the cap allows any (smaller worlds
#: start and end their own: a start costs little there, and their threads are gone when the run returns).
PARK_FROM = 128

_PARKED_PREFIX = "dstest-parked"

#: Seconds :meth:`ParkedThread.serve` waits for its thread to take a task before it goes on.
_TAKE_S = 5.0
_ids = itertools.count(1)


def parked_thread_cap() -> int:
    """How many parked threads this process keeps at most (``DSTEST_PARKED_THREADS``, default 0: none, every
    cold run starts and ends its own threads)."""
    return thread_count_setting("DSTEST_PARKED_THREADS", 0, "no parked threads")


def _as_new_thread(task: Callable[[], None]) -> None:
    """Run ``task`` in a ``contextvars`` context of its own, empty as a new thread's: what it sets is gone after."""
    contextvars.Context().run(task)


class ParkedThread:
    """One thread that runs one task after another, each as a new thread would, until told to end."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.idle = threading.Event()  # its task (if any) is over and the thread is clean again
        self._taken = threading.Lock()  # held by ``serve`` until the thread has its task
        self.clean = True  # False once a task left state behind: the thread ends
        self.name = f"{_PARKED_PREFIX}{next(_ids)}"
        self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        start = torch_internals.thread_state()
        grad, threads = torch.is_grad_enabled(), torch.autograd.is_multithreading_enabled()
        try:
            while (task := self.tasks.get()) is not None:
                self._taken.release()
                try:
                    _as_new_thread(task)
                finally:
                    torch_internals.clear_thread_locals()
                    torch.set_grad_enabled(grad)
                    torch.autograd.set_multithreading_enabled(threads)
                    self.clean = torch_internals.thread_state() == start
                    self.idle.set()
                if not self.clean:
                    return
        except BaseException:  # an exception raised into the thread between tasks: it ends, never reused
            self.clean = False
            self.idle.set()

    def serve(self, task: Callable[[], None], name: str) -> None:
        """Run ``task`` next, the thread named ``name`` meanwhile (rank threads are named after their rank);
        returns once the thread has it.

        As ``Thread.start`` waits for its thread: handed out all at once, thousands of tasks woke thousands of
        threads together, each waiting for the interpreter to reach its first lock (measured at 4096 ranks:
        12-34 s until every rank had started, against 1.6 s for new threads)."""
        self.idle.clear()
        self.thread.name = name
        self._taken.acquire()
        self.tasks.put(task)
        self._taken.acquire(timeout=_TAKE_S)  # a thread slower than that (a loaded machine) is not waited for
        self._taken.release()

    def end(self) -> None:
        self.tasks.put(None)


class _Parked:
    """The parked threads of this process (idle, clean), most recently parked last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[ParkedThread] = []


_PARKED = _Parked()


def take(count: int) -> list[ParkedThread]:
    """``count`` threads for a run: parked ones first, new ones for the rest (started, waiting for a task)."""
    parked_thread_cap()  # a bad setting is refused before any rank starts
    with _PARKED.lock:
        taken = _PARKED.idle[-count:] if count else []
        del _PARKED.idle[len(_PARKED.idle) - len(taken) :]
    taken = [p for p in taken if p.thread.is_alive()]
    if taken or count:
        lifecycle.keep("threaded parked threads", shutdown_parked)
    taken.extend(ParkedThread() for _ in range(count - len(taken)))
    return taken


def give_back(members: list[ParkedThread], grace: float, reuse: bool) -> list[str]:
    """After a run: wait for each thread's task to end, then park the clean ones up to the cap; the others end.

    ``reuse``: the run ended without an abort, a timeout or an interrupt; every rank has left, so the wait
    is for the threads' own clean-up (up to ``grace`` seconds). Otherwise a thread may still run its rank:
    after 0.2 s, those are interrupted (``reap``). Returns the names of threads that could not be stopped
    (stuck in C code: counted, never reused)."""
    end = time.monotonic() + (grace if reuse else min(grace, 0.2))
    for p in members:
        p.idle.wait(max(0.0, end - time.monotonic()))
    done = [p for p in members if p.idle.is_set()]
    busy = [p for p in members if not p.idle.is_set()]
    for p in done:
        p.thread.name = p.name  # no longer a rank's thread
    with _PARKED.lock:
        room = max(0, parked_thread_cap() - len(_PARKED.idle))
        parked = [p for p in done if reuse and p.clean and p.thread.is_alive()][:room]
        _PARKED.idle.extend(parked)
    kept = {id(p) for p in parked}
    for p in members:
        if id(p) not in kept:
            p.end()  # it ends once its task is over
    return reap([p.thread for p in busy], max(0.0, grace - 0.2)) if busy else []


def retire(members: list[ParkedThread]) -> None:
    """A run that raised (its timeout, Ctrl-C): each of its threads ends once its rank has left."""
    for p in members:
        p.end()


def parked_threads() -> int:
    """How many threads are parked now (at most :func:`parked_thread_cap`)."""
    with _PARKED.lock:
        return len(_PARKED.idle)


def shutdown_parked() -> None:
    """End every parked thread of this process (the session's end, interpreter exit, ``ThreadedWorld.close()``)."""
    with _PARKED.lock:
        idle, _PARKED.idle = _PARKED.idle, []
    for p in idle:
        p.end()
    for p in idle:
        p.thread.join(0.5)
