"""The rank threads of a threaded run: how each rank runs the body, how the caller waits for them, and what
a run's end reports.

- a rank that raises aborts the world; ranks still running are interrupted at once (WorldAborted raised
  into them), the report starts with the first real error, and the run returns only when every rank has
  left the function or is named as a thread that could not be stopped (such a thread is never reused);
- a rank that finishes with unmatched or unwaited work, or that caught an error dstest raised into it,
  fails the world;
- threads a rank starts act as that rank (its groups, its context: :func:`capture_rank_for_thread`);
- each rank thread draws from a CPU generator of its own, seeded per run as the process world seeds each
  rank's (``rank_seed``): ``torch.manual_seed``, ``torch.randn``, dropout and ``nn.init`` on a rank thread
  give the numbers that rank's process would (contract E5; ``torch_internals.rank_rng``);
- Ctrl-C stops every rank within about a second.

Used by both ways a run gets its threads: warm crews (:mod:`.crews`) and a cold start (:mod:`.world`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dstest.context import RankContext, current_context, rank_seed
from dstest.errors import WorkAborted, WorldAborted
from dstest.worlds import torch_internals
from dstest.worlds.core.faults import Killed
from dstest.worlds.request import RunRequest
from dstest.worlds.stopping import interrupt, stacks_of
from dstest.worlds.threaded import cpus
from dstest.worlds.threaded.failures import Outcome, RankKilled, timeout_error
from dstest.worlds.threaded.group import BACKEND_NAME, binding, translate_group
from dstest.worlds.threaded.rendezvous import Rendezvous
from dstest.worlds.threaded.thread_shared import ThreadedRendezvous

__all__ = [
    "ABORT_GRACE_S",
    "CollectorPaused",
    "Countdown",
    "await_ranks",
    "batch_scheduling",
    "c10d_per_thread",
    "call_rank",
    "capture_rank_for_thread",
    "finish_run",
    "forget_last_run",
    "is_consequence",
    "thread_shared_in_last_run",
]

#: Seconds an aborted world gives its ranks to leave their function before it names them as stuck.
ABORT_GRACE_S = 1.0


class CollectorPaused:
    """The cyclic garbage collector off while a world's rank threads start, on again when every rank
    has formed its default group (``started``) or the start failed (``release``).

    Starting N ranks allocates O(N) objects in a process that already holds torch's; the collector's
    full passes then grow with N too, so a start of thousands of ranks spent most of its time in them
    (measured in ``benchmarks/bench_threaded.py``). Nothing is leaked: collection is only deferred.

    ``settle``: the first warm crew's start in a process ends with one full collection. What the imports
    and the start allocated make the process's next full pass due (60 ms with torch loaded); without it,
    that pass lands in the crew's first run, inside the calls it times (measured: 0.28 ms instead of 0.08
    ms per 1 KiB all_reduce over a first run of 300 calls at W=4). Only the first: a crew replaced after a
    failed run paid it again each time, 70-200 ms added to reporting every failure
    (``benchmarks/bench_detection.py``: a shape mismatch at W=2 took 80 ms instead of 7).
    """

    settled = False  # the process's first settling collection is done

    def __init__(self, world_size: int, settle: bool = False) -> None:
        self._lock = threading.Lock()
        self._left = world_size
        self._settle = settle
        self._was_enabled = gc.isenabled()
        if self._was_enabled:
            gc.disable()

    def started(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.release()

    def release(self) -> None:
        if self._was_enabled:
            self._was_enabled = False
            gc.enable()
            if self._settle and not CollectorPaused.settled:
                CollectorPaused.settled = True
                gc.collect()


def batch_scheduling() -> None:
    """On a rank thread: ask Linux to schedule it as SCHED_BATCH (same priority, no wake-up preemption).

    Rank threads hand the GIL to one another at every collective: the last rank to arrive wakes the others
    and keeps running Python. Under the default policy a woken rank preempts it (or starts on an idle
    core), finds the GIL held and sleeps again: a wasted switch per woken rank per collective, most of the
    time of a small collective (measured in ``benchmarks/bench_threaded.py``). A SCHED_BATCH thread runs
    when the GIL holder blocks instead. Nothing else changes (its nice value, its share of the CPU);
    threads a rank starts inherit it. Elsewhere, or where the call is refused, a no-op.
    """
    setter, policy = getattr(os, "sched_setscheduler", None), getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return
    with contextlib.suppress(OSError):
        setter(0, policy, os.sched_param(0))  # pid 0: the calling thread


# -- one rank thread --------------------------------------------------------------------------------
def is_consequence(rendezvous: Rendezvous, exc: BaseException) -> bool:
    """Whether a rank failed because its world was already aborted (not an error of its own)."""
    if isinstance(exc, (WorldAborted, WorkAborted)):
        return True
    reason = rendezvous.aborted
    return reason is not None and bool(str(reason)) and str(reason) in str(exc)


def call_rank(
    rendezvous: ThreadedRendezvous,
    rank: int,
    request: RunRequest,
    ctx: RankContext,
    outcome: Outcome,
) -> None:
    """Run the spec body on one rank, recording its result or failure; a failure aborts the world."""
    token = ctx.bind()
    returned = False
    generator = torch.Generator()
    generator.manual_seed(rank_seed(ctx.seed, rank))  # as the process world seeds each rank's (E5)
    try:
        with torch_internals.rank_generator(generator):
            outcome.results[rank] = request.rank_call(ctx)
        returned = True
    except RankKilled as killed:  # an injected Kill (contract G5): the rank died, the run goes on
        outcome.results[rank] = Killed(rank, killed.args[0].at())
    except BaseException as exc:  # every rank's outcome is reported, so catch all
        consequence = is_consequence(rendezvous, exc)
        outcome.fail(rank, exc, consequence=consequence)
        if not consequence:
            if isinstance(rendezvous, ThreadedRendezvous):
                rendezvous.shared_globals.failed(rendezvous, exc)  # before the abort lets the other ranks clean up
            rendezvous.abort(exc)
    finally:
        RankContext.unbind(token)
        problem = rendezvous.rank_done(rank, returned)
        if problem is not None:
            outcome.fail(rank, problem)
            rendezvous.abort(problem)


def capture_rank_for_thread() -> Callable[[], Any] | None:
    """In a rank thread starting a helper thread: what makes the helper act as this rank."""
    rendezvous = getattr(binding, "session", None)
    if rendezvous is None:
        return None
    rank, device = binding.rank, getattr(binding, "device", None)
    state = torch_internals.current_rank_state()
    ctx = current_context()
    generator = torch_internals.current_generator()  # a process's threads share its generator
    hold = cpus.hold_of_this_thread()  # under DSTEST_RANK_CPUS=one: the thread starts on the rank's one CPU

    @contextlib.contextmanager
    def as_rank() -> Iterator[None]:
        torch_internals.adopt_rank_state(state)
        binding.session, binding.rank, binding.device = rendezvous, rank, device
        token = ctx.bind() if ctx is not None else None
        draws = torch_internals.rank_generator(generator) if generator is not None else contextlib.nullcontext()
        try:
            with draws, cpus.held_as(hold):
                yield
        finally:
            if ctx is not None:
                RankContext.unbind(token)
            binding.__dict__.clear()
            torch_internals.adopt_rank_state(None)

    return as_rank


def c10d_per_thread() -> Any:
    """The context in which each rank thread has its own c10d state (and helper threads act as their rank):
    a warm crew holds it for its life, a cold run for the run."""
    return torch_internals.thread_local_c10d_world(capture_rank_for_thread, translate_group, own_backend=BACKEND_NAME)


_LAST_RUN = threading.local()


def thread_shared_in_last_run() -> list[str]:
    """What the calling thread's last threaded run shared between rank threads that processes would not
    (module attributes a rank rebound, module globals holding a rank's group, torch's generator used by name):
    the plugin re-judges such a test on the process world (contract E14)."""
    return list(getattr(_LAST_RUN, "found", []))


def forget_last_run() -> None:
    """At a run's start: nothing shared yet (the run may fail before :func:`finish_run`)."""
    _LAST_RUN.found = []


def finish_run(rendezvous: ThreadedRendezvous, outcome: Outcome, notes: str) -> list[Any]:
    """The end of a run on the caller's thread: the failure with what rank threads shared, or the results."""
    _LAST_RUN.found = found = rendezvous.thread_shared()
    if outcome.failures:
        notes += rendezvous.rng_note() + rendezvous.shared_globals.note() + rendezvous.module_write_note()
        notes += rendezvous.fault_note()
        err = outcome.error(notes)
        if err is not None:
            err.thread_shared = found  # type: ignore[attr-defined]
            raise err
    rendezvous.raise_not_fired()
    return outcome.results


class Countdown:
    """Ranks report once each; the last report wakes the one waiter (the caller of ``run``) once."""

    def __init__(self, world_size: int) -> None:
        self.lock = threading.Lock()
        self.left = set(range(world_size))
        self.errors: dict[int, BaseException] = {}
        self.all_done = threading.Event()

    def done(self, rank: int, exc: BaseException | None = None) -> None:
        with self.lock:
            self.left.discard(rank)
            if exc is not None:
                self.errors[rank] = exc
            if not self.left:
                self.all_done.set()

    def running(self) -> list[int]:
        with self.lock:
            return sorted(self.left)


def await_ranks(
    phase: Countdown, rendezvous: Rendezvous, threads: list[threading.Thread], timeout: float, outcome: Outcome
) -> str:
    """Wait for every rank to finish, for an abort, or for the timeout; stop the ranks in the latter two.

    Returns notes for the report (threads that could not be stopped); raises WorldTimeout at the timeout
    and re-raises KeyboardInterrupt after stopping the ranks.
    """
    deadline = time.monotonic() + timeout
    world_size = len(threads)

    def running() -> list[threading.Thread]:
        return [threads[r] for r in phase.running()]

    turns = rendezvous.turns
    try:
        while not phase.all_done.wait(0.02):
            if rendezvous.abort_event.is_set():
                if turns is not None:
                    turns.stop()
                interrupt(threads, running, ABORT_GRACE_S)
                break
            if turns is not None:
                turns.unstick()
            if time.monotonic() >= deadline:
                if turns is not None:
                    turns.stop()
                err = timeout_error(threads, world_size, timeout, phase.running(), outcome)
                rendezvous.abort(err)
                interrupt(threads, running, ABORT_GRACE_S)
                stuck = [t.name for t in running()]
                if stuck:
                    err.args = (err.args[0] + f"\nthreads that could not be stopped: {stuck}",)
                raise err
    except KeyboardInterrupt:
        if turns is not None:
            turns.stop()
        rendezvous.abort(WorldAborted("interrupted (Ctrl-C)"))
        interrupt(threads, running, ABORT_GRACE_S)
        raise
    left = running()
    if not left:
        return ""
    stacks = stacks_of(threads)
    lines = "\n".join(f"---- {t.name} ----\n{stacks.get(threads.index(t), '(no stack)')}" for t in left)
    return f"\nthreads that could not be stopped (stuck in C code; never reused): {[t.name for t in left]}\n{lines}"
