"""Where a threaded world's rank threads run: on any CPU, or all on one; ``DSTEST_RANK_CPUS`` = ``auto`` (the
default: decided once per process from the machine), ``any`` or ``one``.

Rank threads hand the GIL to one another at every collective. On a machine with a CPU to spare, a woken rank
thread is started on the idle CPU, which must first wake up itself, and then finds the GIL held: every
hand-off costs a cross-CPU wake-up (measured: ``benchmarks/bench_rank_cpus.py``). With every rank thread and
the caller of ``run`` on one CPU, a hand-off is a switch on that CPU: small collectives, FSDP2 steps and
DTensor redistributions of small models ran 2.2-3x faster here. What runs outside the GIL in parallel (the large
tensor operations of several ranks at once) then shares that one CPU, except what torch splits over its
intra-op threads, which each rank starts before it is pinned (:func:`start_intra_op_threads`): a body of
large matmuls on four ranks ran 2x slower without that, 0.92-1.0x with it; bodies of mid-sized elementwise
work, a small MLP's or a convolution's steps ran 1.06-2.3x faster. Where an idle CPU wakes quickly (bare
metal), the hand-offs cost little and the rank threads' own parallel work may count for more; that was not
measured. So ``auto`` decides, once per process (:func:`auto_decision`): ``one`` on a virtual machine
(:func:`on_a_virtual_machine`); elsewhere it times a GIL hand-off between two threads free to run on any CPU
against one between two threads on the caller's CPU (:func:`handoff_ratio`, 10-20 ms) and holds the rank
threads on one CPU where the first costs :data:`AUTO_RATIO` times the second or more. With ``-v`` a test
session says what it chose.

With ``one``, each process claims one CPU for its rank threads, for its life (:func:`choose`): one that no
other process of the user claimed, so that pytest-xdist's workers each get their own; the caller's thread is
held on it for each run and given its own CPUs back after.
Threads a rank starts inherit its CPU (and are held as it is: :func:`held_as`). Processes it starts do not: a
process inherits the CPUs of the thread that starts it, so while a pinned thread starts one (``subprocess``,
``os.system``, ``os.posix_spawn``, multiprocessing's fork, spawn and fork server, a DataLoader's or
torch.compile's workers), the thread is given back the CPUs it had before it was pinned, and pinned again once
the process is started
(:func:`children_unpinned`; the hooks are installed when ``one`` is first chosen). What the rank's code
reads of its CPUs is what a rank process reads: ``os.sched_getaffinity`` asked by a held thread about itself
answers the CPUs it had before the pin (:func:`_affinity_as_a_process_sees_it`). Where threads cannot be
pinned (not Linux), ``one`` changes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from dstest.errors import InvalidArgument
from dstest.worlds.threaded.cpu_probe import current_cpu as _current_cpu
from dstest.worlds.threaded.cpu_probe import handoff_ratio, on_a_virtual_machine, os_affinity
from dstest.worlds.threaded.cpu_probe import real_affinity as _real_affinity

__all__ = [
    "AUTO_RATIO",
    "ENV_RANK_CPUS",
    "AutoDecision",
    "auto_decision",
    "back_on",
    "children_unpinned",
    "choose",
    "decided",
    "handoff_ratio",
    "held_as",
    "held_on",
    "hold_of_this_thread",
    "mode",
    "on_a_virtual_machine",
    "own",
    "pin",
    "setting",
    "start_intra_op_threads",
]

ENV_RANK_CPUS = "DSTEST_RANK_CPUS"
_SETTINGS = ("auto", "any", "one")


def setting() -> str:
    """``DSTEST_RANK_CPUS`` as given: ``auto`` (the default), ``any`` or ``one``; raises
    :class:`InvalidArgument` naming what is allowed."""
    raw = os.environ.get(ENV_RANK_CPUS, "").strip().lower() or "auto"
    if raw not in _SETTINGS:
        raise InvalidArgument(
            f"{ENV_RANK_CPUS}={raw!r}: expected 'auto' (the default: 'one' where a hand-off between threads on "
            "two CPUs costs this machine much more than on one), 'any' (rank threads run on any CPU) or 'one' "
            "(every rank thread of a world on one CPU)"
        )
    return raw


def mode() -> str:
    """Where the rank threads run: ``any`` or ``one``, from ``DSTEST_RANK_CPUS``; ``auto`` is decided once per
    process by measuring this machine (:func:`auto_decision`)."""
    raw = setting()
    return raw if raw != "auto" else auto_decision().mode


#: ``auto`` holds the rank threads on one CPU where a GIL hand-off between two threads on different CPUs
#: takes at least this many times one between two threads on the same CPU.
AUTO_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """What ``DSTEST_RANK_CPUS=auto`` chose in this process, and why."""

    mode: str  # "any" or "one"
    #: A hand-off's median time between threads on any CPU over that between threads on one (None: not measured).
    ratio: float | None
    reason: str

    def describe(self) -> str:
        return f"rank threads on {'one CPU' if self.mode == 'one' else 'any CPU'} ({ENV_RANK_CPUS}=auto: {self.reason})"


_auto: AutoDecision | None = None
_auto_lock = threading.Lock()


def auto_decision() -> AutoDecision:
    """The process's ``auto`` decision, made on first use: ``any`` where threads cannot be pinned or the
    process has one CPU; ``one`` on a virtual machine (an idle CPU wakes slowly there, and rank threads hand
    the GIL to one another at every collective); elsewhere ``one`` where :func:`handoff_ratio` is at least
    :data:`AUTO_RATIO`, else ``any``."""
    global _auto
    with _auto_lock:
        if _auto is None:
            _auto = _decide()
        return _auto


def decided() -> AutoDecision | None:
    """The ``auto`` decision if this process made one (for a session's summary), else None."""
    return _auto


def _decide() -> AutoDecision:
    if os_affinity is None or not hasattr(os, "sched_setaffinity"):
        return AutoDecision("any", None, "threads cannot be pinned here")
    if len(_real_affinity(0)) < 2:
        return AutoDecision("any", None, "this process has one CPU")
    if on_a_virtual_machine():
        return AutoDecision("one", None, "a virtual machine (the CPUs' hypervisor flag): an idle CPU wakes slowly")
    ratio = handoff_ratio()
    chosen = "one" if ratio >= AUTO_RATIO else "any"
    return AutoDecision(
        chosen, ratio, f"a hand-off between threads on two CPUs took {ratio:.1f}x one on the same CPU here"
    )


def _forget_auto() -> None:  # a forked child decides for itself (its CPUs may differ)
    global _auto
    _auto = None


#: The CPU this process's rank threads share under ``one``, and the open file whose lock claims it.
_claimed: tuple[int, IO[bytes]] | None = None
_claim_lock = threading.Lock()


def _forget_claim() -> None:  # a forked child holds no claim of its own (the parent's lock stays the parent's)
    global _claimed
    _claimed = None


def _claim(cpu: int) -> IO[bytes] | None:
    """Hold the lock that claims ``cpu`` for this process's rank threads (released when the process ends), or
    None when another process of this user holds it."""
    try:
        import fcntl
    except ImportError:
        return None
    folder = Path(tempfile.gettempdir()) / f"dstest-rank-cpus-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        handle = open(folder / f"cpu{cpu}.lock", "ab")  # held open for the process's life
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def choose() -> int | None:
    """The CPU a new crew's (or cold run's) rank threads are to share, or None where they run on any.

    One per process, kept for its life: a CPU no other process of this user claimed for its rank threads
    (pytest-xdist's workers each get their own while there are CPUs enough), the one the caller runs on
    first; where every CPU is claimed, the caller's."""
    global _claimed
    if mode() != "one" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = _real_affinity(0)
    with _claim_lock:
        if _claimed is not None:
            if _claimed[0] in allowed:
                return _claimed[0]
            _claimed[1].close()  # a thread held off that CPU: its claim goes, another is made
            _claimed = None
        here = _current_cpu()
        here = here if here in allowed else min(allowed)
        _install_child_hooks()
        for cpu in [here, *sorted(allowed - {here})]:
            handle = _claim(cpu)
            if handle is not None:
                _claimed = (cpu, handle)
                atexit.register(handle.close)
                return cpu
        return here


#: Per thread: the CPUs the processes it starts get while dstest holds it on one CPU (None: it is not held).
_for_children = threading.local()


@contextlib.contextmanager
def children_unpinned() -> Iterator[None]:
    """For the block, the calling thread on the CPUs it had before dstest pinned it, where it is pinned: a
    process started in the block inherits those, not the one CPU."""
    cpus: set[int] | None = getattr(_for_children, "cpus", None)
    if cpus is None:
        yield
        return
    mine = _real_affinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mine)


def _unpinned(start: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(start)
    def starting_a_process(*args: Any, **kwargs: Any) -> Any:
        with children_unpinned():
            return start(*args, **kwargs)

    starting_a_process.__dstest_unpinned__ = start  # type: ignore[attr-defined]
    return starting_a_process


_hooks_installed = False


def _install_child_hooks() -> None:
    """Wrap the standard library's ways of starting a process (those that run no Python fork hook) in
    :func:`children_unpinned`, and give ``os.fork`` a hook that does the same; once per process."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    import subprocess

    targets: list[tuple[Any, str]] = [
        (subprocess, "_fork_exec"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (os, "system"),
    ]
    with contextlib.suppress(ImportError):  # POSIX only
        import _posixsubprocess

        targets.append((_posixsubprocess, "fork_exec"))  # multiprocessing's spawn and fork server
    for owner, name in targets:
        start = getattr(owner, name, None)
        if callable(start) and not hasattr(start, "__dstest_unpinned__"):
            setattr(owner, name, _unpinned(start))
    if os_affinity is not None and not hasattr(os.sched_getaffinity, "__dstest_real__"):
        os.sched_getaffinity = _affinity_as_a_process_sees_it
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork)


def _affinity_as_a_process_sees_it(pid: int) -> set[int]:
    """``os.sched_getaffinity`` as a rank's code sees it: asked by a thread dstest holds on the one CPU about
    itself or its process (pid 0, its own thread id, ``os.getpid()``), the CPUs it had before (those of the
    process), as a rank process of the process world or under torchrun sees; anything else, the operating
    system's answer.

    Code sizes its pools by it (a DataLoader warns when ``num_workers`` exceeds it, which fails a test run
    with warnings as errors): under ``one`` it would otherwise see one CPU where a process sees all. A
    thread the code itself moved elsewhere (``os.sched_setaffinity``) sees where it is. What reads the
    affinity in C (``os.process_cpu_count`` from Python 3.13, psutil) still sees the one CPU."""
    real = _real_affinity(pid)
    if pid == 0 or pid == threading.get_native_id() or pid == os.getpid():
        view, pinned = hold_of_this_thread()
        if view is not None and real == {pinned}:
            return set(view)
    return real


_affinity_as_a_process_sees_it.__dstest_real__ = os_affinity  # type: ignore[attr-defined]


def _before_fork() -> None:
    cpus: set[int] | None = getattr(_for_children, "cpus", None)
    if cpus is not None:
        _for_children.held = _real_affinity(0)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def _after_fork() -> None:
    held: set[int] | None = getattr(_for_children, "held", None)
    if held is not None:
        _for_children.held = None
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, held)


#: Worlds of up to this many ranks start each rank thread's intra-op threads before it is pinned
#: (:func:`start_intra_op_threads`): a thread or two per rank, made once per warm crew.
INTRA_OP_UP_TO = 64


def start_intra_op_threads(cpu: int | None, on: set[int] | None, world_size: int) -> None:
    """Start the calling rank thread's intra-op threads while it may still run on the CPUs ``on`` (the
    caller's), just before it is pinned to ``cpu`` (None: it is not, and nothing is done); in worlds of up to
    :data:`INTRA_OP_UP_TO` ranks.

    torch's CPU operations split large work over a team of threads (OpenMP) that each thread starts at its
    first parallel operation and keeps; the team's threads keep the CPUs their thread had then. Started after
    the pin, a rank's large matmul runs on its one CPU (measured: 2x slower than on any CPU); started before,
    the rank thread itself stays on the one CPU, where the GIL hand-offs are cheap, and its team computes on
    every CPU the caller had. One parallel operation starts it: an elementwise fill of 2^16 elements, above
    torch's grain of 2^15 per thread (about 0.1 ms, once per thread)."""
    if cpu is None or on is None or len(on) < 2 or world_size > INTRA_OP_UP_TO:
        return
    import torch

    if torch.get_num_threads() < 2:
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, on)
    torch.empty(1 << 16).fill_(0.0)


def own() -> set[int] | None:
    """The CPUs the calling thread may run on (None where that cannot be asked)."""
    return _real_affinity(0) if os_affinity is not None else None


def back_on(home: set[int] | None) -> None:
    """The calling thread (a warm or parked rank thread between runs) on the CPUs ``home`` again, where a run
    moved it (code that binds its rank to cores): the next run, another test's, starts where a new thread
    would. One system call when nothing moved."""
    if home is not None and _real_affinity(0) != home:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, home)


def pin(cpu: int | None, children: set[int] | None = None) -> None:
    """Hold the calling thread on ``cpu`` (None: leave it where it may run); the processes it starts get
    ``children`` (default: the CPUs it had)."""
    if cpu is not None:
        before = own() if children is None else children
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})
        _for_children.cpus = before
        _for_children.pinned = cpu


Hold = tuple[set[int] | None, int | None]


def hold_of_this_thread() -> Hold:
    """How dstest holds the calling thread: (the CPUs its processes get and its code reads, its one CPU), or
    (None, None) where it does not hold it."""
    return getattr(_for_children, "cpus", None), getattr(_for_children, "pinned", None)


@contextlib.contextmanager
def held_as(hold: Hold) -> Iterator[None]:
    """For the block, the calling thread (one a held rank started: it inherited the rank's one CPU) is held as
    that rank is: the processes it starts get the rank's CPUs, and its code reads them."""
    if hold[0] is None:
        yield
        return
    outer = hold_of_this_thread()
    _for_children.cpus, _for_children.pinned = hold
    try:
        yield
    finally:
        _for_children.cpus, _for_children.pinned = outer


@contextlib.contextmanager
def held_on(cpu: int | None, then: set[int] | None = None) -> Iterator[None]:
    """The calling thread held on ``cpu`` for the block; after it, on ``then`` (default: the CPUs it had).
    A cold run's rank thread, made while its caller was held, gets the caller's own CPUs (``then``): a
    parked thread serves later runs on them, whatever this run's setting, and wherever the run's code moved it."""
    if cpu is None:
        try:
            yield
        finally:
            back_on(then)
        return
    after = _real_affinity(0) if then is None else then
    outer = hold_of_this_thread()
    pin(cpu, children=outer[0] if outer[0] is not None else then)  # a new rank thread's: its caller's own CPUs
    try:
        yield
    finally:
        _for_children.cpus, _for_children.pinned = outer
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, after)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_claim)
    os.register_at_fork(after_in_child=_forget_auto)
