"""The threaded world: N ranks as threads of this process, real data movement, dstest's own c10d backend.

The package, one module per job (each imports only those before it in this list):

- :mod:`~dstest.worlds.threaded.hazards`: async hazards, outputs poisoned until the wait (opt-in);
- :mod:`~dstest.worlds.threaded.failures`: every rank's outcome and the run's report, the timeout's report;
- :mod:`~dstest.worlds.threaded.waits`: what a rank waits on (one side of a collective or transfer);
- :mod:`~dstest.worlds.threaded.work`: the ``Work`` handle a collective returns;
- :mod:`~dstest.worlds.threaded.group`: dstest's c10d backend, the ``Group`` torch sees, a rank thread's
  default group;
- :mod:`~dstest.worlds.threaded.departures`: the state of one run, and what ranks that leave it, deadlocks
  and aborts do to the others (the checking core's state machine, :mod:`dstest.worlds.core.rank_states`);
- :mod:`~dstest.worlds.threaded.turns`: in a large world, one rank thread runs Python at a time;
- :mod:`~dstest.worlds.threaded.rendezvous`: matching every rank's calls (the checking core's rules) and
  delivering their results;
- :mod:`~dstest.worlds.threaded.thread_shared`: the rendezvous of rank threads, with the watch on what they
  share that processes would not (module globals, module attributes, torch's generator);
- :mod:`~dstest.worlds.threaded.ranks`: one rank thread's body, waiting for the ranks, a run's end;
- :mod:`~dstest.worlds.threaded.crews`: warm crews of rank threads kept between runs;
- :mod:`~dstest.worlds.threaded.parked`: bare threads kept between large cold runs;
- :mod:`~dstest.worlds.threaded.world`: :class:`ThreadedWorld` and cold runs (this module).

Shared with other worlds: the collectives (:mod:`dstest.worlds.collectives`), the checking core
(:mod:`dstest.worlds.core`), stopping threads (:mod:`dstest.worlds.stopping`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

import dstest.trace as _trace
from dstest.context import RankContext
from dstest.worlds import torch_internals
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest
from dstest.worlds.stopping import reap
from dstest.worlds.threaded import cpus, parked
from dstest.worlds.threaded.crews import CREWS, shutdown_all
from dstest.worlds.threaded.failures import Outcome
from dstest.worlds.threaded.group import rank_process_group, register_backend
from dstest.worlds.threaded.ranks import (
    CollectorPaused,
    Countdown,
    await_ranks,
    batch_scheduling,
    c10d_per_thread,
    call_rank,
    finish_run,
    forget_last_run,
    is_consequence,
    thread_shared_in_last_run,
)
from dstest.worlds.threaded.thread_shared import ThreadedRendezvous, watch_module_writes
from dstest.worlds.threaded.turns import TURNS_FROM, Turns

__all__ = ["ThreadedWorld", "c10d_state"]

_THREAD_PREFIX = "dstest-rank"


def c10d_state() -> Any:
    """This rank thread's own c10d state (the thread-local world)."""
    return torch_internals.c10d_state()


class ThreadedWorld:
    """Runs a function on every rank, as threads, with a real c10d process group per rank.

    ``fn(ctx, *args, **kwargs)`` runs on every rank with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``); ``run`` returns the per-rank results in rank order, or raises one
    :class:`RankFailure` carrying every failing rank's traceback, or :class:`WorldTimeout` with every
    rank's stack. ``device="cuda"`` runs the same ranks with CUDA tensors (``ctx.device``).

    ``warm=True`` keeps the rank threads and their default group between runs (a run costs a rendezvous,
    not a world's start-up); a failing run retires them, and :func:`shutdown_all` stops the rest. At most
    :func:`warm_thread_cap` threads are kept. With ``warm=False`` every run starts and ends its own threads
    (with ``DSTEST_PARKED_THREADS`` set, a world of :data:`~.parked.PARK_FROM` ranks or more runs on parked
    threads instead: bare threads kept between cold runs, :mod:`.parked`).
    """

    name = "threaded"
    #: Rank threads share one process's modules: there is no other process's state to compare with.
    capabilities = Capabilities(faults=True, hazards=True, strict_shapes=True)

    def __init__(self, device: str = "cpu", *, grace: float = 2.0, warm: bool = False) -> None:
        self.device = device
        self.grace = grace
        self.warm = warm

    @property
    def marker(self) -> str:
        return "gpu" if self.device.startswith("cuda") else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            return "threaded world on cuda needs a CUDA device; none is available"
        return None

    def thread_shared(self) -> list[str]:
        """What the calling thread's last run on this world shared between rank threads that processes would
        not (:func:`thread_shared_in_last_run`); empty when nothing was seen."""
        return thread_shared_in_last_run()

    def close(self) -> None:
        """Stop the warm crews and parked threads of this process (every device's: they are the process's, not
        this object's)."""
        shutdown_all()
        parked.shutdown_parked()

    def run(self, request: RunRequest) -> list[Any]:
        self.capabilities.refuse(request, self.name)
        forget_last_run()
        with _trace.world_run(self.name, request.world_size, request.recorder) as recorder:
            return self._run(request, recorder)

    def _run(self, request: RunRequest, recorder: _trace.Recorder) -> list[Any]:
        register_backend()
        device = torch.device(self.device)
        world_size = request.world_size

        def make_ctx(rank: int) -> RankContext:
            ctx = RankContext(rank=rank, world_size=world_size, world=self.name, device=device, seed=request.seed)
            ctx.attach_comm(recorder.view(rank))
            return ctx

        crew = CREWS.checkout(device, world_size) if self.warm else None
        if crew is not None:
            try:
                return crew.run(request, recorder, make_ctx)
            finally:
                crew.busy.release()
                # a crew whose thread ended is found at its next checkout (usable), once per run
                if crew.retired or crew.broken or crew.rendezvous.aborted is not None:
                    CREWS.retire(crew)
                    crew.close(grace=0.5)
        return self._run_cold(request, recorder, make_ctx, device)

    def _run_cold(
        self,
        request: RunRequest,
        recorder: _trace.Recorder,
        make_ctx: Callable[[int], RankContext],
        device: torch.device,
    ) -> list[Any]:
        world_size, timeout = request.world_size, request.timeout
        watch_module_writes()
        rendezvous = ThreadedRendezvous(world_size)
        rendezvous.configure(recorder, request)
        turns = rendezvous.turns = Turns(slots=0) if world_size >= TURNS_FROM else None
        outcome = Outcome(world_size)
        phase = Countdown(world_size)
        paused = CollectorPaused(world_size)
        cpu, callers_cpus = cpus.choose(), cpus.own()
        with c10d_per_thread() as c10d_world, cpus.held_on(cpu):

            def rank_main(rank: int) -> None:
                batch_scheduling()
                try:
                    if turns is not None:
                        turns.begin()
                    cpus.start_intra_op_threads(cpu, callers_cpus, world_size)
                    with (
                        cpus.held_on(cpu, then=callers_cpus),  # a parked thread serves later runs on them
                        rank_process_group(c10d_world, rendezvous, rank, device, timedelta(seconds=timeout)),
                    ):
                        paused.started()
                        call_rank(rendezvous, rank, request, make_ctx(rank), outcome)
                except BaseException as exc:  # init failed, or an abort landed outside the body
                    outcome.fail(rank, exc, consequence=is_consequence(rendezvous, exc))
                    rendezvous.abort(exc)
                    rendezvous.rank_done(rank, False)
                finally:
                    if turns is not None:
                        turns.give()
                    phase.done(rank)

            threads, members = _threads_for(world_size, rank_main)
            notes = ""
            try:
                try:
                    _start(threads, members, rank_main)
                finally:
                    if turns is not None:
                        turns.open()  # every thread is there: ranks start one at a time from now on
                notes = await_ranks(phase, rendezvous, threads, timeout, outcome)
            except BaseException:
                if members is not None:  # a timeout or Ctrl-C: its threads end
                    parked.retire(members)
                raise
            finally:
                paused.release()  # a rank whose start failed never reports started
            left = _end_threads(
                threads, members, self.grace if notes else 0.5, not notes and rendezvous.aborted is None
            )
            if left and not notes:
                notes = f"\nthreads that could not be stopped (stuck in C code; never reused): {left}"
        return finish_run(rendezvous, outcome, notes)


def _threads_for(
    world_size: int, rank_main: Callable[[int], None]
) -> tuple[list[threading.Thread], list[parked.ParkedThread] | None]:
    """The run's threads, not started: new ones, or parked ones for a world of ``PARK_FROM`` ranks or more."""
    if world_size >= parked.PARK_FROM and parked.parked_thread_cap() > 0:
        members = parked.take(world_size)
        return [p.thread for p in members], members
    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"{_THREAD_PREFIX}{r}", daemon=True)
        for r in range(world_size)
    ]
    return threads, None


def _end_threads(
    threads: list[threading.Thread], members: list[parked.ParkedThread] | None, grace: float, clean: bool
) -> list[str]:
    """After the run: new threads end, parked ones are parked again (``clean``: no abort, nothing stuck).
    Returns the names of threads that could not be stopped."""
    if members is None:
        return reap(threads, grace)
    return parked.give_back(members, grace, reuse=clean)


def _start(threads: list[threading.Thread], members: list[parked.ParkedThread] | None, rank_main: Any) -> None:
    """Start each rank: a new thread each, or a parked thread handed its rank (named after it meanwhile)."""
    if members is None:
        for t in threads:
            t.start()
        return
    for rank, p in enumerate(members):
        p.serve(functools.partial(rank_main, rank), f"{_THREAD_PREFIX}{rank}")
