"""How a threaded run fails: every rank's outcome and the report made of it, the timeout's report, and the
exception that unwinds the thread of a rank an injected ``Kill`` ended.

Rank threads never format anything: they record the exception (:meth:`Outcome.fail`), and the caller's
thread formats the report after the ranks have stopped (:mod:`dstest.worlds.stopping`).
"""

from __future__ import annotations

import threading
from typing import Any

from dstest.errors import RankFailure, WorldAborted, WorldTimeout
from dstest.worlds import build_locks
from dstest.worlds.stopping import current_frames, format_exception, format_stacks, stacks_of

__all__ = ["Outcome", "RankKilled", "timeout_error"]


class RankKilled(BaseException):
    """Unwinds the thread of a rank a ``Kill`` fault ended (contract G5): a ``BaseException``, so that the
    code under test cannot swallow it with ``except Exception`` (as it cannot stop a SIGKILL). ``args[0]``:
    the fault."""


class Outcome:
    """Per-run results and failures of every rank.

    A failure is *primary* when it happened before the world was aborted (the first real error and any
    that raced with it), and a *consequence* when the rank failed because of the abort (WorldAborted, or
    an error a future delivered after it). Primary failures come first in the report.
    """

    def __init__(self, world_size: int, label: str = "") -> None:
        self.world_size = world_size
        self.label = label  # e.g. " in the process world of 2 ranks (gloo)"
        self.results: list[Any] = [None] * world_size
        self.failures: dict[int, BaseException] = {}
        self.order: list[int] = []
        self.consequences: set[int] = set()
        self.lock = threading.Lock()

    def fail(self, rank: int, exc: BaseException, *, consequence: bool = False) -> None:
        with self.lock:
            if rank in self.failures:
                return
            self.failures[rank] = exc
            self.order.append(rank)
            if consequence or isinstance(exc, WorldAborted):
                self.consequences.add(rank)

    def error(self, notes: str = "") -> RankFailure | None:
        """The report of every failure, primary ones first (formatted here, on the caller's thread)."""
        with self.lock:
            failures, order, consequences = dict(self.failures), list(self.order), set(self.consequences)
        if not failures:
            return None
        primary = [r for r in order if r not in consequences]
        shown = primary or order
        tracebacks = {r: format_exception(failures[r]) for r in order}
        head = "; ".join(f"rank {r}: {type(failures[r]).__name__}: {failures[r]}".splitlines()[0] for r in shown)
        body = "\n".join(f"---- rank {r} ----\n{tracebacks[r]}" for r in shown)
        aborted = sorted(set(order) - set(shown))
        tail = f"\nranks {aborted} were aborted because of the failure above" if aborted else ""
        return RankFailure(
            f"{len(shown)} of {self.world_size} ranks failed{self.label}: {head}\n{body}{tail}{notes}",
            {r: tracebacks[r] for r in sorted(failures)},
            {r: failures[r] for r in sorted(failures)},
        )

    def raise_failures(self, notes: str = "") -> None:
        err = self.error(notes)
        if err is not None:
            raise err


def timeout_error(
    threads: list[threading.Thread], world_size: int, timeout: float, hung: list[int], outcome: Outcome | None = None
) -> WorldTimeout:
    frames = current_frames()
    stacks = stacks_of(threads, frames)
    first = ""
    if outcome is not None:
        err = outcome.error()
        if err is not None:
            first = f"before the timeout: {err}\n"
    # A rank waiting on a torch extension's build lock, or building: say which lock and whose (issue 40).
    builds = build_locks.survey(
        {r: s for r, s in stacks.items() if r in hung}, waited=build_locks.waited_locks(threads, frames)
    )
    headline = "" if builds is None else f"; {builds.headline()}"
    notes = "" if builds is None else builds.report(stopped=False) + "\n"
    return WorldTimeout(
        f"world of {world_size} ranks ran past its timeout of {timeout:g} s; "
        f"ranks still running: {hung}{headline}\n{first}{notes}" + format_stacks(stacks),
        stacks,
    )
