"""The threaded world: N ranks as threads of this process, real data movement, dstest's own c10d backend.

Every collective call is matched across ranks by (group, sequence number) in a :class:`Session`
(``_session.py``); the groups are dstest's c10d backend (``_backend.py``); reports and stopping threads are
in ``_failures.py``; the RNG hand-over and the watch on module globals are the session's
(``threaded_session.py``). This module holds what is the threaded world's own: the rank threads, warm crews that
keep them between runs, and the run loop:

- a rank that raises aborts the world; ranks still running are interrupted at once (WorldAborted raised
  into them), the report starts with the first real error, and ``run`` returns only when every rank has
  left the function or is named as a thread that could not be stopped (such a thread is never reused);
- a rank that finishes with unmatched or unwaited work, or that caught an error dstest raised into it,
  fails the world;
- threads a rank starts act as that rank (its groups, its context);
- each rank thread draws from a CPU generator of its own, seeded per run as the process world seeds each
  rank's (``rank_seed``): ``torch.manual_seed``, ``torch.randn``, dropout and ``nn.init`` on a rank thread
  give the numbers that rank's process would (contract E5; ``torch_internals.rank_rng``);
- Ctrl-C stops every rank within about a second.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dstest.trace as _trace
from dstest.context import RankContext, current_context, rank_seed
from dstest.errors import InvalidArgument, WorkAborted, WorldAborted
from dstest.worlds import torch_internals as _compat
from dstest.worlds._backend import BACKEND_NAME, binding, rank_process_group, register_backend, translate_group
from dstest.worlds._failures import Outcome, interrupt, reap, stacks_of, stuck_threads, timeout_error
from dstest.worlds._session import Session
from dstest.worlds.core.faults import Killed
from dstest.worlds.injected import RankKilled
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded_session import ThreadedSession, watch_module_writes

__all__ = [
    "BACKEND_NAME",
    "ThreadedWorld",
    "c10d_state",
    "shutdown_all",
    "stuck_threads",
    "thread_shared_in_last_run",
    "warm_thread_cap",
]

_THREAD_PREFIX = "dstest-rank"
_WARM_PREFIX = "dstest-warm"
_crew_ids = itertools.count(1)
#: Seconds an aborted world gives its ranks to leave their function before it names them as stuck.
ABORT_GRACE_S = 1.0


class _CollectorPaused:
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
            if self._settle and not _CollectorPaused.settled:
                _CollectorPaused.settled = True
                gc.collect()


def warm_thread_cap() -> int:
    """How many warm rank threads this process keeps at most (``DSTEST_WARM_THREADS``, default 256).

    Crews are evicted least recently used first; a world larger than the cap runs cold.
    """
    raw = os.environ.get("DSTEST_WARM_THREADS", "256")
    try:
        cap = int(raw)
    except ValueError:
        raise InvalidArgument(f"DSTEST_WARM_THREADS={raw!r} must be an int >= 0 (0: no warm crews)") from None
    if cap < 0:
        raise InvalidArgument(f"DSTEST_WARM_THREADS={raw!r} must be an int >= 0 (0: no warm crews)")
    return cap


def _batch_scheduling() -> None:
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
def _is_consequence(session: Session, exc: BaseException) -> bool:
    """Whether a rank failed because its world was already aborted (not an error of its own)."""
    if isinstance(exc, (WorldAborted, WorkAborted)):
        return True
    reason = session.aborted
    return reason is not None and bool(str(reason)) and str(reason) in str(exc)


def _call_rank(
    session: ThreadedSession,
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
        with _compat.rank_generator(generator):
            outcome.results[rank] = request.rank_call(ctx)
        returned = True
    except RankKilled as killed:  # an injected Kill (contract G5): the rank died, the run goes on
        outcome.results[rank] = Killed(rank, killed.args[0].at())
    except BaseException as exc:  # every rank's outcome is reported, so catch all
        consequence = _is_consequence(session, exc)
        outcome.fail(rank, exc, consequence=consequence)
        if not consequence:
            if isinstance(session, ThreadedSession):
                session.shared_globals.failed(session, exc)  # before the abort lets the other ranks clean up
            session.abort(exc)
    finally:
        RankContext.unbind(token)
        problem = session.rank_done(rank, returned)
        if problem is not None:
            outcome.fail(rank, problem)
            session.abort(problem)


def _capture_rank_for_thread() -> Callable[[], Any] | None:
    """In a rank thread starting a helper thread: what makes the helper act as this rank."""
    session = getattr(binding, "session", None)
    if session is None:
        return None
    rank, device = binding.rank, getattr(binding, "device", None)
    state = _compat.current_rank_state()
    ctx = current_context()
    generator = _compat.current_generator()  # a process's threads share its generator

    @contextlib.contextmanager
    def as_rank() -> Iterator[None]:
        _compat.adopt_rank_state(state)
        binding.session, binding.rank, binding.device = session, rank, device
        token = ctx.bind() if ctx is not None else None
        draws = _compat.rank_generator(generator) if generator is not None else contextlib.nullcontext()
        try:
            with draws:
                yield
        finally:
            if ctx is not None:
                RankContext.unbind(token)
            binding.__dict__.clear()
            _compat.adopt_rank_state(None)

    return as_rank


_LAST_RUN = threading.local()


def thread_shared_in_last_run() -> list[str]:
    """What the calling thread's last threaded run shared between rank threads that processes would not
    (module attributes a rank rebound, module globals holding a rank's group, torch's generator used by name):
    the plugin re-judges such a test on the process world (contract E14)."""
    return list(getattr(_LAST_RUN, "found", []))


def _finish(session: ThreadedSession, outcome: Outcome, notes: str) -> list[Any]:
    """The end of a run on the caller's thread: the failure with what rank threads shared, or the results."""
    _LAST_RUN.found = found = session.thread_shared()
    if outcome.failures:
        notes += session.rng_note() + session.shared_globals.note() + session.module_write_note()
        notes += session.fault_note()
        err = outcome.error(notes)
        if err is not None:
            err.thread_shared = found  # type: ignore[attr-defined]
            raise err
    session.raise_not_fired()
    return outcome.results


class _Countdown:
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


def _await_ranks(
    phase: _Countdown, session: Session, threads: list[threading.Thread], timeout: float, outcome: Outcome
) -> str:
    """Wait for every rank to finish, for an abort, or for the timeout; stop the ranks in the latter two.

    Returns notes for the report (threads that could not be stopped); raises WorldTimeout at the timeout
    and re-raises KeyboardInterrupt after stopping the ranks.
    """
    deadline = time.monotonic() + timeout
    world_size = len(threads)

    def running() -> list[threading.Thread]:
        return [threads[r] for r in phase.running()]

    try:
        while not phase.all_done.wait(0.02):
            if session.abort_event.is_set():
                interrupt(threads, running, ABORT_GRACE_S)
                break
            if time.monotonic() >= deadline:
                err = timeout_error(threads, world_size, timeout, phase.running(), outcome)
                session.abort(err)
                interrupt(threads, running, ABORT_GRACE_S)
                stuck = [t.name for t in running()]
                if stuck:
                    err.args = (err.args[0] + f"\nthreads that could not be stopped: {stuck}",)
                raise err
    except KeyboardInterrupt:
        session.abort(WorldAborted("interrupted (Ctrl-C)"))
        interrupt(threads, running, ABORT_GRACE_S)
        raise
    left = running()
    if not left:
        return ""
    stacks = stacks_of(threads)
    lines = "\n".join(f"---- {t.name} ----\n{stacks.get(threads.index(t), '(no stack)')}" for t in left)
    return f"\nthreads that could not be stopped (stuck in C code; never reused): {[t.name for t in left]}\n{lines}"


# -- warm crews -------------------------------------------------------------------------------------
class _WarmCrew:
    """Rank threads with their default process group already formed, serving one run after another.

    A run that succeeds leaves the crew ready (groups it created destroyed, grad mode restored); a run
    that fails, times out or leaves a transfer unmatched retires the crew, so nothing of it survives.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.session = ThreadedSession(world_size)
        self.busy = threading.Lock()
        self.broken = False  # a run left a rank without its default group: the crew cannot serve again
        self.retired = False
        self._install = _compat.thread_local_c10d_world(
            _capture_rank_for_thread, translate_group, own_backend=BACKEND_NAME
        )
        self._c10d = self._install.__enter__()
        self._tasks: list[queue.SimpleQueue[Callable[[int], None] | None]] = [
            queue.SimpleQueue() for _ in range(world_size)
        ]
        self._defaults: list[Any] = [None] * world_size
        self._phase = _Countdown(world_size)  # the start, then each run
        self._run_id = 0  # the run the ranks serve now: its store prefix (FreshRunState)
        crew = next(_crew_ids)
        self.threads = [
            threading.Thread(target=self._main, args=(r,), name=f"{_WARM_PREFIX}{crew}-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        paused = _CollectorPaused(world_size, settle=True)
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
        _batch_scheduling()
        try:
            with rank_process_group(self._c10d, self.session, rank, self.device, timedelta(days=1)):
                self._defaults[rank] = dist.group.WORLD
                fresh = _compat.FreshRunState()
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
                    self._reset_rank(fresh)
                    self._phase.done(rank)
        except BaseException as exc:
            self._phase.done(rank, exc)

    def _reset_rank(self, fresh: _compat.FreshRunState) -> None:
        """Undo what a run leaves on its rank thread: subgroups, their names and store keys, grad mode."""
        _compat.drop_subgroups()
        fresh.end()
        torch.set_grad_enabled(True)

    def run(self, request: RunRequest, recorder: _trace.Recorder, make_ctx: Callable[[int], RankContext]) -> list[Any]:
        session = self.session
        session.reset()
        watch_module_writes()
        session.configure(
            recorder, hazards=request.async_hazards, strict_shapes=request.strict_shapes, faults=request.faults
        )
        timeout = request.timeout
        _compat.thread_local_c10d_world_ensure()
        outcome = Outcome(self.world_size)

        def task(rank: int) -> None:
            _call_rank(session, rank, request, make_ctx(rank), outcome)

        phase = self._phase = _Countdown(self.world_size)
        self._run_id += 1
        for q in self._tasks:
            q.put(task)
        try:
            notes = _await_ranks(phase, session, self.threads, timeout, outcome)
        except BaseException:
            self.close(grace=0.5)
            raise
        for rank, exc in phase.errors.items():  # a rank's loop itself broke: retire the crew
            outcome.fail(rank, exc)
        session.forget_groups(set(self._defaults))
        if outcome.failures or notes or session.leftovers() or self.broken:
            self.close(grace=0.5)
        return _finish(session, outcome, notes)

    def usable(self) -> bool:
        return not self.retired and all(t.is_alive() for t in self.threads)

    def close(self, grace: float = 2.0) -> None:
        if self.retired:
            return
        self.retired = True
        for q in self._tasks:
            q.put(None)
        reap(self.threads, grace)
        self._install.__exit__(None, None, None)


class _Crews:
    """The warm crews of this process, least recently used first; stopped by :func:`shutdown_all`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.crews: OrderedDict[tuple[str, int], _WarmCrew] = OrderedDict()

    def checkout(self, device: torch.device, world_size: int) -> _WarmCrew | None:
        """A crew that is free for one run (its ``busy`` lock held), or None (in use, or over the cap)."""
        cap = warm_thread_cap()
        if world_size > cap:
            return None
        key = (str(device), world_size)
        evicted: list[_WarmCrew] = []
        with self.lock:
            crew = self.crews.get(key)
            if crew is not None and not crew.usable():
                del self.crews[key]
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
            crew = _WarmCrew(world_size, device)
            with self.lock:
                self.crews[key] = crew
        return crew if crew.busy.acquire(blocking=False) else None

    def retire(self, crew: _WarmCrew) -> None:
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


_CREWS = _Crews()


def shutdown_all() -> None:
    """Stop every warm crew of this process (the plugin calls this when the test session ends)."""
    _CREWS.shutdown()


def kept_warm_threads() -> int:
    """How many warm rank threads this process keeps now (at most :func:`warm_thread_cap`)."""
    return _CREWS.kept_threads()


atexit.register(shutdown_all)


def c10d_state() -> Any:
    """This rank thread's own c10d state (the thread-local world)."""
    return _compat.c10d_state()


class ThreadedWorld:
    """Runs a function on every rank, as threads, with a real c10d process group per rank.

    ``fn(ctx, *args, **kwargs)`` runs on every rank with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``); ``run`` returns the per-rank results in rank order, or raises one
    :class:`RankFailure` carrying every failing rank's traceback, or :class:`WorldTimeout` with every
    rank's stack. ``device="cuda"`` runs the same ranks with CUDA tensors (``ctx.device``).

    ``warm=True`` keeps the rank threads and their default group between runs (a run costs a rendezvous,
    not a world's start-up); a failing run retires them, and :func:`shutdown_all` stops the rest. At most
    :func:`warm_thread_cap` threads are kept. With ``warm=False`` every run starts and ends its own threads.
    """

    name = "threaded"

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

    def run(self, request: RunRequest) -> list[Any]:
        request.refuse_watch(self.name)
        _LAST_RUN.found = []
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

        crew = _CREWS.checkout(device, world_size) if self.warm else None
        if crew is not None:
            try:
                return crew.run(request, recorder, make_ctx)
            finally:
                crew.busy.release()
                if crew.retired or crew.broken or not crew.usable() or crew.session.aborted is not None:
                    _CREWS.retire(crew)
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
        session = ThreadedSession(world_size)
        session.configure(
            recorder, hazards=request.async_hazards, strict_shapes=request.strict_shapes, faults=request.faults
        )
        outcome = Outcome(world_size)
        phase = _Countdown(world_size)
        paused = _CollectorPaused(world_size)
        with _compat.thread_local_c10d_world(
            _capture_rank_for_thread, translate_group, own_backend=BACKEND_NAME
        ) as c10d_world:

            def rank_main(rank: int) -> None:
                _batch_scheduling()
                try:
                    with rank_process_group(c10d_world, session, rank, device, timedelta(seconds=timeout)):
                        paused.started()
                        _call_rank(session, rank, request, make_ctx(rank), outcome)
                except BaseException as exc:  # init failed, or an abort landed outside the body
                    outcome.fail(rank, exc, consequence=_is_consequence(session, exc))
                    session.abort(exc)
                    session.rank_done(rank, False)
                finally:
                    phase.done(rank)

            threads = [
                threading.Thread(target=rank_main, args=(r,), name=f"{_THREAD_PREFIX}{r}", daemon=True)
                for r in range(world_size)
            ]
            try:
                for t in threads:
                    t.start()
                notes = _await_ranks(phase, session, threads, timeout, outcome)
            finally:
                paused.release()  # a rank whose start failed never reports started
            left = reap(threads, self.grace if notes else 0.5)
            if left and not notes:
                notes = f"\nthreads that could not be stopped (stuck in C code; never reused): {left}"
        return _finish(session, outcome, notes)
