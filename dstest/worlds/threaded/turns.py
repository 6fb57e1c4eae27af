"""Turns: in a large threaded world, one rank thread runs Python at a time, handing the turn on where it sleeps.

A collective's completion makes every rank that waited on it runnable at once, and a world's start makes
every rank runnable as soon as its thread starts. With the GIL, a thousand runnable threads spend their
time handing the GIL to one another: every torch call releases it, a waiting thread takes it, the caller
waits for it back (the 1024-rank list all_gather body took 6-112 s for about 1.5 s of work, measured in
``benchmarks/bench_scale.py``). With turns, a rank runs only while it holds the turn: it takes one at its
start and, woken from a wait, is handed one; it hands it on when it sleeps in a wait of the rendezvous or
leaves the run. A completion thus queues the ranks it wakes, and one of them runs at a time.

Nothing waits on a turn for ever: a rank holding the turn may block elsewhere (a future's ``wait``, the
user's own lock), where it hands nothing on. The run's watcher (:meth:`Turns.unstick`, from the caller's
polling loop) looks at the holders' CPU clocks: when no holder ran for :data:`STALL_S` while ranks queue,
every queued rank goes on without a turn, as without turns at all. An abort or a timeout ends the turns
(:meth:`Turns.stop`). Only ranks take turns; another thread that acts as a rank (:func:`~.ranks.
capture_rank_for_thread`) and is handed one hands it straight back.
"""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from collections import deque
from typing import Any

__all__ = ["STALL_S", "TURNS_FROM", "Turns"]

#: Worlds of this many ranks and more take turns (below it a completion wakes few threads; a small
#: collective's hot path stays as it is).
TURNS_FROM = 128

#: Seconds without CPU time on any holder, while ranks queue, after which the queued ranks go on: well
#: above the time a runnable thread may wait for a CPU on a loaded machine (at 50 ms, a first run in a
#: process let its ranks go during the start, and they ran all at once).
STALL_S = 0.5


class _Local(threading.local):
    member = False  # a rank thread of the run (took a turn at its start)
    holding = False  # holds a turn now


class Turns:
    """At most ``slots`` rank threads hold a turn; the others queue on a lock of their own, first come first
    served. Every method is safe from any thread; ``admit`` is called under the rendezvous lock."""

    def __init__(self, slots: int = 1) -> None:
        self._lock = allocate_lock()
        self._free = slots
        self._queue: deque[Any] = deque()  # the held locks of queued threads, oldest first
        self._handed: set[Any] = set()  # locks released with a turn (the rest were let go without one)
        self._holders: set[int] = set()  # thread idents holding a turn
        self._local = _Local()
        self._stopped = False
        self._clock: tuple[float, float] = (-1.0, time.monotonic())  # holders' CPU seconds, when it last moved

    # -- a rank's side --------------------------------------------------------------------------------
    def begin(self) -> None:
        """At a rank's start: wait for a turn."""
        self._local.member = True
        waiter = allocate_lock()
        waiter.acquire()
        self.admit(waiter)
        waiter.acquire()
        self.woke(waiter)

    def admit(self, waiter: Any) -> None:
        """Let the thread sleeping on ``waiter`` (a held lock) go: with a turn when one is free, else later."""
        with self._lock:
            if self._stopped:
                pass
            elif self._free > 0:
                self._free -= 1
                self._handed.add(waiter)
            else:
                self._queue.append(waiter)
                return
        waiter.release()

    def woke(self, waiter: Any) -> None:
        """On the thread ``waiter`` let go: note whether it holds a turn (a non-rank thread hands it back)."""
        with self._lock:
            if waiter not in self._handed:
                return
            self._handed.discard(waiter)
            if self._local.member:
                self._local.holding = True
                self._holders.add(threading.get_ident())
                return
        self._free_one()

    def give(self) -> None:
        """The calling rank sleeps in a wait or leaves the run: hand its turn to the oldest queued thread."""
        if not self._local.holding:
            return
        self._local.holding = False
        with self._lock:
            self._holders.discard(threading.get_ident())
        self._free_one()

    def open(self) -> None:
        """Made with no slot (``slots=0``): hand out the first turn, once every rank thread is started.

        Started while the first ranks already ran their start, threads are made by a caller that competes
        with them for the interpreter: each ``Thread.start`` waits for its thread to take the GIL from the
        rank holding the turn (measured at 4096 ranks: threads started over 5-7 s instead of 1-2 s)."""
        self._free_one()

    def _free_one(self) -> None:
        with self._lock:
            self._clock = (-1.0, time.monotonic())
            if self._stopped or not self._queue:
                self._free += 1
                return
            waiter = self._queue.popleft()
            self._handed.add(waiter)
        waiter.release()

    # -- the run's watcher ------------------------------------------------------------------------------
    def unstick(self) -> None:
        """From the caller's polling loop: when ranks queue and no holder used CPU time for :data:`STALL_S`
        (it blocks outside the rendezvous), let every queued thread go on without a turn."""
        with self._lock:
            if not self._queue:
                return
            holders = list(self._holders)
        cpu = 0.0
        for ident in holders:
            try:
                cpu += time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, AttributeError, ProcessLookupError):  # the thread is gone, or no such clock here
                pass
        now = time.monotonic()
        with self._lock:
            last, since = self._clock
            if cpu != last:
                self._clock = (cpu, now)
                return
            if now - since < STALL_S:
                return
            released, self._queue = list(self._queue), deque()
        for waiter in released:
            waiter.release()

    def stop(self) -> None:
        """An abort or a timeout: no more turns; every queued thread goes on."""
        with self._lock:
            self._stopped = True
            released, self._queue = list(self._queue), deque()
        for waiter in released:
            waiter.release()
