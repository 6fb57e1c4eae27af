"""Warm crews: rank threads of the threaded world kept with their default group formed, one run after another.

A crew per (device, world size), least recently used first, at most :func:`warm_thread_cap` threads in all;
:func:`shutdown_all` stops them: ``ThreadedWorld.close()``, and :func:`dstest.worlds.lifecycle.close_all`
(the test session's end, interpreter exit), to which the first crew hands it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dstest.trace as _trace
from dstest.context import RankContext
from dstest.errors import InvalidArgument
from dstest.worlds import lifecycle, torch_internals
from dstest.worlds.request import RunRequest
from dstest.worlds.stopping import reap
from dstest.worlds.threaded import cpus, ranks
from dstest.worlds.threaded.failures import Outcome
from dstest.worlds.threaded.group import rank_process_group
from dstest.worlds.threaded.thread_shared import ThreadedRendezvous, watch_module_writes

__all__ = [
    "CREWS",
    "Crews",
    "WarmCrew",
    "kept_warm_threads",
    "shutdown_all",
    "thread_count_setting",
    "warm_thread_cap",
]

_WARM_PREFIX = "dstest-warm"
_crew_ids = itertools.count(1)


def warm_thread_cap() -> int:
    """How many warm rank threads this process keeps at most (``DSTEST_WARM_THREADS``, default 256).

    Crews are evicted least recently used first; a world larger than the cap runs cold.
    """
    return thread_count_setting("DSTEST_WARM_THREADS", 256, "no warm crews")


def thread_count_setting(name: str, default: int, zero: str) -> int:
    """The environment setting ``name``, an int >= 0 (``zero`` says what 0 means), refused clearly otherwise."""
    raw = os.environ.get(name, str(default))
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 0:
        raise InvalidArgument(f"{name}={raw!r} must be an int >= 0 (0: {zero})")
    return cap


class WarmCrew:
    """Rank threads with their default process group already formed, serving one run after another.

    A run that succeeds leaves the crew ready (groups it created destroyed, grad mode restored, a rank thread
    its code bound to cores put back on the crew's CPUs); a run that fails, times out or leaves a transfer
    unmatched retires the crew, so nothing of it survives.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.rendezvous = ThreadedRendezvous(world_size)
        self.busy = threading.Lock()
        self.broken = False  # a run left a rank without its default group: the crew cannot serve again
        self.retired = False
        self.cpu_mode = cpus.mode()
        self.cpu = cpus.choose()  # the one CPU its ranks and its runs' caller share (DSTEST_RANK_CPUS=one), or None
        self._callers_cpus = cpus.own()  # where its ranks' intra-op threads may run
        self._install = ranks.c10d_per_thread()
        self._c10d = self._install.__enter__()
        self._tasks: list[queue.SimpleQueue[Callable[[int], None] | None]] = [
            queue.SimpleQueue() for _ in range(world_size)
        ]
        self._defaults: list[Any] = [None] * world_size
        self._phase = ranks.Countdown(world_size)  # the start, then each run
        self._run_id = 0  # the run the ranks serve now: its store prefix (FreshRunState)
        crew = next(_crew_ids)
        self.threads = [
            threading.Thread(target=self._main, args=(r,), name=f"{_WARM_PREFIX}{crew}-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        paused = ranks.CollectorPaused(world_size, settle=True)
        try:
            for t in self.threads:
                t.start()
            self._phase.all_done.wait()
        finally:
            paused.release()
        if self._phase.errors:
            self.close()
            raise next(iter(self._phase.errors.values()))

    def _main(self, rank: int) -> None:
        ranks.batch_scheduling()
        cpus.start_intra_op_threads(self.cpu, self._callers_cpus, self.world_size)
        cpus.pin(self.cpu, children=self._callers_cpus)  # the processes a rank starts get the caller's CPUs
        home = cpus.own()
        try:
            with rank_process_group(self._c10d, self.rendezvous, rank, self.device, timedelta(days=1)):
                self._defaults[rank] = dist.group.WORLD
                fresh = torch_internals.FreshRunState()
                self._phase.done(rank)
                while (task := self._tasks[rank].get()) is not None:
                    fresh.begin(self._run_id)
                    # the world group's calls count from 1 in each run, as in a fresh world
                    self._defaults[rank]._seq = 0
                    task(rank)
                    if not dist.is_initialized():  # the run destroyed the default group itself
                        self.broken = True
                        self._phase.done(rank)
                        return
                    self._reset_rank(fresh, home)
                    self._phase.done(rank)
        except BaseException as exc:
            self._phase.done(rank, exc)

    def _reset_rank(self, fresh: torch_internals.FreshRunState, home: set[int] | None) -> None:
        """Undo what a run leaves on its rank thread: subgroups, their names and store keys, grad mode, the
        CPUs it may run on."""
        torch_internals.drop_subgroups()
        fresh.end()
        if not torch.is_grad_enabled():
            torch.set_grad_enabled(True)
        cpus.back_on(home)

    def run(self, request: RunRequest, recorder: _trace.Recorder, make_ctx: Callable[[int], RankContext]) -> list[Any]:
        rendezvous = self.rendezvous
        rendezvous.reset()
        watch_module_writes()
        rendezvous.configure(recorder, request)
        timeout = request.timeout
        torch_internals.thread_local_c10d_world_ensure()
        outcome = Outcome(self.world_size)

        def task(rank: int) -> None:
            ranks.call_rank(rendezvous, rank, request, make_ctx(rank), outcome)

        phase = self._phase = ranks.Countdown(self.world_size)
        self._run_id += 1
        try:
            with cpus.held_on(self.cpu):
                for q in self._tasks:
                    q.put(task)
                notes = ranks.await_ranks(phase, rendezvous, self.threads, timeout, outcome)
        except BaseException:
            self.close(grace=0.5)
            raise
        for rank, exc in phase.errors.items():  # a rank's loop itself broke: retire the crew
            outcome.fail(rank, exc)
        rendezvous.forget_groups(set(self._defaults))
        if outcome.failures or notes or rendezvous.leftovers() or self.broken:
            self.close(grace=0.5)
        return ranks.finish_run(rendezvous, outcome, notes)

    def usable(self) -> bool:
        """Whether it can serve a run: not retired, every thread alive, made under the CPU mode in force."""
        return not self.retired and self.cpu_mode == cpus.mode() and all(t.is_alive() for t in self.threads)

    def close(self, grace: float = 2.0) -> None:
        if self.retired:
            return
        self.retired = True
        for q in self._tasks:
            q.put(None)
        reap(self.threads, grace)
        self._install.__exit__(None, None, None)


class Crews:
    """The warm crews of this process, least recently used first; stopped by :func:`shutdown_all`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.crews: OrderedDict[tuple[str, int], WarmCrew] = OrderedDict()

    def checkout(self, device: torch.device, world_size: int) -> WarmCrew | None:
        """A crew that is free for one run (its ``busy`` lock held), or None (in use, or over the cap)."""
        cap = warm_thread_cap()
        if world_size > cap:
            return None
        key = (str(device), world_size)
        evicted: list[WarmCrew] = []
        with self.lock:
            crew = self.crews.get(key)
            if crew is not None and not crew.usable():  # a thread of it ended: its others end too
                del self.crews[key]
                evicted.append(crew)
                crew = None
            if crew is None:
                kept = sum(c.world_size for c in self.crews.values())
                for k in list(self.crews):
                    if kept + world_size <= cap:
                        break
                    if self.crews[k].busy.locked():
                        continue
                    old = self.crews.pop(k)
                    kept -= old.world_size
                    evicted.append(old)
            else:
                self.crews.move_to_end(key)
        for old in evicted:
            old.close(grace=0.5)
        if crew is None:
            lifecycle.keep("threaded crews", shutdown_all)  # stopped at the session's end, whoever made it
            crew = WarmCrew(world_size, device)
            with self.lock:
                self.crews[key] = crew
        return crew if crew.busy.acquire(blocking=False) else None

    def retire(self, crew: WarmCrew) -> None:
        with self.lock:
            for key, known in list(self.crews.items()):
                if known is crew:
                    del self.crews[key]

    def kept_threads(self) -> int:
        with self.lock:
            return sum(c.world_size for c in self.crews.values())

    def shutdown(self) -> None:
        with self.lock:
            crews, self.crews = list(self.crews.values()), OrderedDict()
        for crew in crews:  # ask every crew to stop first, then wait for all of them together
            for q in crew._tasks:
                q.put(None)
        for crew in crews:
            crew.close(grace=0.5)


CREWS = Crews()


def shutdown_all() -> None:
    """Stop every warm crew of this process (``ThreadedWorld.close()``; the session's end, interpreter exit)."""
    CREWS.shutdown()


def kept_warm_threads() -> int:
    """How many warm rank threads this process keeps now (at most :func:`warm_thread_cap`)."""
    return CREWS.kept_threads()
