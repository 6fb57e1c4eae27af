"""What a run of a pool reports besides its results: what the ranks printed, their collective traces, the
module state the run left behind, and, when it fails, the failure: the ranks' tracebacks, the stacks of
ranks that ran past the timeout or stayed blocked after a failure, the output of a worker that died.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
from typing import Any, NoReturn, Protocol

import dstest.trace as _trace
from dstest.errors import RankFailure, StateLeftBehind, WorkerDied, WorldAborted, WorldTimeout
from dstest.worlds import build_locks
from dstest.worlds.process.gather import FAILURE_GRACE, Gathering
from dstest.worlds.process.handle import WorkerHandle, file_size
from dstest.worlds.process.messages import FnRef, PoolKey, Reply, unpickle_exception
from dstest.worlds.stopping import format_stacks

#: Seconds to wait for faulthandler's dump after signalling a worker.
_STACK_WAIT_S = 1.0


class FailingPool(Protocol):
    """What a failure report needs of its pool: its workers, its name, and a way to kill them all."""

    key: PoolKey
    workers: list[WorkerHandle]

    def label(self) -> str: ...

    def kill(self) -> None: ...


def raise_incomplete(
    pool: FailingPool,
    ref: FnRef,
    timeout: float,
    run: Gathering,
    log_starts: dict[int, int],
    recorder: _trace.Recorder,
) -> NoReturn:
    """A run some worker did not answer: a worker died (:class:`WorkerDied`), or ranks ran past the
    timeout or stayed blocked after a failure; the pool is killed either way."""
    __tracebackhide__ = True
    if run.dead:
        _raise_died(pool, ref, run, log_starts, recorder)
    missing = [w for w in pool.workers if w.rank not in run.replies]  # never empty when no worker died
    stacks = _stacks(missing)
    # Ranks waiting on a torch extension's build lock or building: surveyed while they live (to name a
    # holder by rank), reported after the kill, which releases the locks they held (issue 40).
    builds = build_locks.survey(stacks, pids={w.rank: w.pid for w in pool.workers})
    for w in missing:
        out = w.output_since(log_starts[w.rank])
        if out:
            stacks[w.rank] = stacks.get(w.rank, "(no stack)\n") + f"-- output during the run --\n{out}"
    pool.kill()
    headline = "" if builds is None else f"; {builds.headline()}"
    notes = "" if builds is None else builds.report(stopped=True) + "\n"
    if run.first_failure is None:
        raise WorldTimeout(
            f"{pool.label()} ran {ref.qualname} past its timeout of {timeout:g} s; ranks still running: "
            f"{[w.rank for w in missing]}; the pool was replaced{headline}\n{notes}" + format_stacks(stacks),
            stacks,
        )
    aborted = {
        w.rank: (
            f"rank {w.rank} did not finish within {FAILURE_GRACE:g} s of the failure (blocked in a "
            f"collective the failed rank never joined?) and was stopped{headline}; its stack:\n"
            + notes
            + stacks.get(w.rank, "(no stack)\n")
        )
        for w in missing
    }
    raise rank_failure(pool.label(), pool.key.world_size, run.replies, aborted, pool_replaced=True)


def _raise_died(
    pool: FailingPool, ref: FnRef, run: Gathering, log_starts: dict[int, int], recorder: _trace.Recorder
) -> NoReturn:
    """A worker died during the run: what the others had replied, and what the dead ones printed."""
    __tracebackhide__ = True
    for d in run.dead:
        d.process.join(1.0)
    others = _collect_quietly(pool.workers, run.replies)
    take_traces({r: rep for r, rep in others.items() if r not in run.replies}, recorder)
    names = ", ".join(f"rank {d.rank} (pid {d.pid}) {d.describe_exit()}" for d in run.dead)
    outputs = "".join(
        f"---- output of rank {d.rank} during the run ----\n{d.output_since(log_starts[d.rank])}\n" for d in run.dead
    )
    failed = {r: rep.traceback for r, rep in others.items() if not rep.ok}
    detail = "".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(failed.items()))
    pool.kill()
    raise WorkerDied(f"{pool.label()}: {names} while running {ref.qualname}; the pool was replaced\n{outputs}{detail}")


def rank_failure(
    label: str,
    world_size: int,
    replies: dict[int, Reply],
    aborted: dict[int, str],
    *,
    pool_replaced: bool,
    note: str = "",
) -> RankFailure:
    failed = {r: rep for r, rep in replies.items() if not rep.ok}
    exceptions: dict[int, BaseException] = {}
    for r, rep in failed.items():
        exceptions[r] = unpickle_exception(rep)
    for r, text in aborted.items():
        exceptions[r] = WorldAborted(text.splitlines()[0])
    # The first real error first: ranks that were only aborted because of it come after it.
    order = sorted(failed, key=lambda r: (isinstance(exceptions[r], WorldAborted), r))
    head = "; ".join(f"rank {r}: {type(exceptions[r]).__name__}: {exceptions[r]}".splitlines()[0] for r in order)
    body = "\n".join(f"---- rank {r} ----\n{failed[r].traceback}" for r in order)
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{text}" for r, text in sorted(aborted.items()))
    if pool_replaced:
        tail += "\nthe worker pool was replaced"
    tail += note
    tracebacks = {r: rep.traceback for r, rep in failed.items()} | aborted
    return RankFailure(
        f"{len(failed)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )


def _collect_quietly(workers: list[WorkerHandle], replies: dict[int, Reply]) -> dict[int, Reply]:
    """Replies that other ranks had already sent when one died (for the report)."""
    out = dict(replies)
    for w in workers:
        if w.rank in out:
            continue
        with contextlib.suppress(Exception):
            if w.conn.poll(0.2):
                out[w.rank] = pickle.loads(w.conn.recv_bytes())
    return out


def _stacks(workers: list[WorkerHandle]) -> dict[int, str]:
    """Every listed worker's Python stacks, dumped by faulthandler on SIGUSR1."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    sizes = {}
    for w in workers:
        sizes[w.rank] = file_size(w.cfg.stack_path)
        with contextlib.suppress(OSError):
            os.kill(w.pid, signal.SIGUSR1)
    end = time.monotonic() + _STACK_WAIT_S
    stacks: dict[int, str] = {}
    last: dict[int, int] = {}
    while time.monotonic() < end and len(stacks) < len(workers):
        time.sleep(0.05)
        for w in workers:
            if w.rank in stacks:
                continue
            size = file_size(w.cfg.stack_path)
            if size > sizes[w.rank] and last.get(w.rank) == size:  # grew, then stayed put: dump done
                with open(w.cfg.stack_path, "rb") as f:
                    f.seek(sizes[w.rank])
                    stacks[w.rank] = _without_watcher(f.read().decode(errors="replace"))
            last[w.rank] = size
    return stacks


def _without_watcher(dump: str) -> str:
    """A faulthandler dump without the worker's own parent-watch thread (noise in a report)."""
    blocks = dump.split("\n\n")
    return "\n\n".join(b for b in blocks if "in _watch_parent" not in b).strip() + "\n"


def warn_state_left_behind(ref: FnRef, replies: dict[int, Reply]) -> None:
    """One :class:`StateLeftBehind` warning for what the run changed in watched modules, on any rank."""
    found = sorted({item for rep in replies.values() for item in rep.left_behind})
    if found:
        import warnings

        warnings.warn(
            StateLeftBehind(
                f"{ref.qualname} left module-level state behind in the warm workers (put back before the next "
                "run; a fresh process would not have seen it): " + "; ".join(found)
            ),
            stacklevel=2,
        )


def fault_note(faults: Any, killed: dict[int, Any]) -> str:
    """For a failure report: the run's injected faults (contract G5), and the ranks a Kill ended."""
    if not faults:
        return ""
    dead = f" (ranks {sorted(killed)} were killed)" if killed else ""
    return "\ninjected faults of the run: " + "; ".join(f.describe() for f in faults) + dead


def take_traces(replies: dict[int, Reply], recorder: _trace.Recorder) -> None:
    """The ranks' collective records, into the recorder of the run (see ``_trace.world_run``)."""
    for r, rep in sorted(replies.items()):
        if rep.trace is not None:
            records, totals = rep.trace
            recorder.merge(r, records, totals)


def forward_output(rank: int, text: str) -> None:
    """What a rank printed, to this process's stdout (pytest captures it per test, as in the threaded world)."""
    if not text:
        return
    lines = text.splitlines()
    sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in lines))
