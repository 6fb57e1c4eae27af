"""The state of one threaded run, and what ranks that leave it, deadlocks and aborts do to the others.

:class:`Departures` holds what the rendezvous (:mod:`.rendezvous`, its subclass, which matches and delivers
the calls) shares with these rules: the lock, the open collectives and transfers, each rank's open work and
the errors dstest raised into its code, and where each rank stands (:class:`~dstest.worlds.core.rank_states.
RankStates`, the state machine the process world's referee follows too):

- when a rank *finishes its function*, every collective and transfer that still needs it can never
  complete: it fails at once, so a rank blocked on it through a future (DDP's reducer, FSDP's hooks) is
  woken with the error instead of hanging;
- a rank that an injected ``Kill`` ended (contract G5) left the run the same way, and the waits that need it
  fail with :class:`~dstest.worlds.injected.InjectedFault` (a backend error, as gloo and NCCL raise when a
  peer is gone) instead of a mismatch; the collectives it had joined fail too (a dead process's side never
  runs);
- when every rank still running waits and none of the waits can complete, every wait fails with the
  pending call of each rank (a mismatch of groups or peers, a rank that skips a collective);
- what a rank leaves behind is checked when it finishes (:meth:`Departures.rank_done`): work it posted that
  no rank matched or that it never waited, and errors dstest raised into its code that the code caught.
  Each is a failure of that rank, so no run passes with unmatched work or a swallowed mismatch;
- an abort (a rank failed, the timeout, Ctrl-C) fails every pending wait, so that every rank unwinds (E3).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

from dstest.errors import CollectiveMismatch, UnfinishedWork, WorldAborted
from dstest.worlds.core import matching
from dstest.worlds.core.matching import Exchange
from dstest.worlds.core.rank_states import KILLED, RankStates
from dstest.worlds.injected import InjectedFault
from dstest.worlds.threaded.waits import Waitable

__all__ = ["Departures", "RankLedger", "copy_error"]


class RankLedger:
    """What one rank has posted and not yet consumed, and the errors dstest raised into its code."""

    def __init__(self) -> None:
        self.open: dict[int, Waitable] = {}
        self.raised: list[BaseException] = []


def copy_error(err: BaseException) -> BaseException:
    """A fresh instance per raising rank: one exception object raised in several threads shares __traceback__."""
    try:
        return type(err)(*err.args)
    except Exception:
        return err


def _issued_at(wait: Waitable) -> str:
    return f", issued at {wait.record.issued_at()}" if wait.record is not None else ""


def _caught_where(err: BaseException) -> str:
    """Where the code under test caught ``err``: the outermost frame of its traceback (the handler's)."""
    tb = err.__traceback__
    if tb is None:
        return "an unknown place"
    frame = traceback.extract_tb(tb, limit=1)[0]
    return f"{frame.filename}:{frame.lineno} (in {frame.name})"


def _left_over(rank: int, left: list[Waitable]) -> UnfinishedWork:
    """Rank ``rank`` finished with work it never waited (``left``): unmatched, or complete and unread."""
    lines = [
        f"  never waited, and unmatched when the rank finished (missing ranks {w.waiting_for()}): {w.describe()}"
        for w in left
        if not w.done
    ]
    lines += [  # their outputs hold the result, as gloo's would
        f"  never waited (call .wait() on the work it returned): {w.describe()}{_issued_at(w)}" for w in left if w.done
    ]
    return UnfinishedWork(
        f"rank {rank} finished its function with work left over; every async collective and "
        "transfer must be matched by its peers and waited:\n" + "\n".join(lines)
    )


def _caught(rank: int, first: BaseException) -> CollectiveMismatch:
    """Rank ``rank`` returned although its code caught ``first``, an error dstest raised into it."""
    return CollectiveMismatch(
        f"rank {rank} finished its function although dstest raised {type(first).__name__} into it, "
        f"which its code caught at {_caught_where(first)}: a mismatch fails the world even when "
        f"caught. The error was: {first}"
    )


class Departures:
    """The state of one run that matching shares with the rules for ranks that leave, deadlocks and aborts."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.exchanges: dict[tuple[Any, ...], Exchange] = {}
        self.p2p = matching.Transfers()  # of P2PWait
        self.states = RankStates(world_size)
        self.pending: dict[int, Waitable] = self.states.waiting  # global rank -> what it is blocked on
        self.killed = self.states.killed  # the ranks a Kill ended (they left the run as a crash would)
        self.aborted: BaseException | None = None
        self.abort_event = threading.Event()
        self.ranks = [RankLedger() for _ in range(world_size)]
        self.failed_exchanges: dict[tuple[Any, ...], Exchange] = {}  # broken by a Fail: later sides fail too

    def note_raised(self, rank: int, err: BaseException) -> None:
        """Remember an error dstest raised into rank ``rank``'s code (checked when the rank finishes)."""
        if 0 <= rank < self.world_size:
            self.ranks[rank].raised.append(err)

    def _raise(self, rank: int, err: BaseException) -> BaseException:
        copy = copy_error(err)
        self.note_raised(rank, copy)
        return copy

    def consume(self, wait: Waitable) -> None:
        """``wait`` was waited, polled complete or handed to a future: no longer the rank's open work."""
        if 0 <= wait.global_rank < self.world_size:
            self.ranks[wait.global_rank].open.pop(id(wait), None)

    def rank_done(self, rank: int, returned: bool) -> BaseException | None:
        """Rank ``rank`` finished its function (``returned``: without raising).

        Fails every wait that still needs the rank, and returns the rank's own failure, if any: work it
        left unmatched or unwaited, or an error dstest raised into it that its code caught.
        """
        with self.lock:
            self.states.leave(rank)  # a failed rank aborts the run: its peers' waits fail with the abort
            state = self.ranks[rank]
            left = list(state.open.values())
            state.open.clear()
            raised = [e for e in state.raised if not isinstance(e, InjectedFault)]  # expected: a fault's
            if self.exchanges or self.p2p:  # most runs end with nothing open: nothing can need the rank
                self._doom_waits_needing(rank)
            if self.pending:  # no rank waits: no deadlock
                self._detect_deadlock()
            if rank in self.killed:
                return None  # it died: what it left behind is its peers' problem, as on a real backend
        if self.aborted is not None:
            return None
        if left:
            return _left_over(rank, left)
        if returned and raised:
            return _caught(rank, raised[0])
        return None

    def _left_how(self, rank: int) -> tuple[type[BaseException], str]:
        """The error class and phrase for waits on ``rank``, which left: it finished, or a Kill ended it."""
        kind, phrase = self.states.how(rank)
        return (InjectedFault if kind == KILLED else CollectiveMismatch), phrase

    def _fail_exchange(self, ex: Exchange, err: BaseException) -> None:
        ex.error = err
        for w in ex.sides:
            w.complete(err)

    def _doom_waits_needing(self, rank: int) -> None:
        """Under the lock: fail every collective and transfer that still needs ``rank`` (it finished); for a
        rank a Kill ended, also those it had joined (as the process world's referee does: a dead process's
        side of a collective never runs)."""
        cls, phrase = self._left_how(rank)
        killed = cls is InjectedFault
        for key, ex in list(self.exchanges.items()):
            if rank in ex.global_ranks and (killed or ex.calls[ex.global_ranks.index(rank)] is None):
                del self.exchanges[key]
                self._fail_exchange(ex, cls(ex.left_text(rank, phrase)))
                if killed:  # its later sides get the same error (see arrive)
                    self.failed_exchanges[key] = ex
        for w in self.p2p.drop(lambda w: w.peer == rank):
            w.complete(cls(matching.p2p_left_text(w.global_rank, w.describe(), w.kind, rank, phrase)))

    def _detect_deadlock(self) -> None:
        """Called under the lock: fail every wait when no running rank is left to complete any of them."""
        if self.aborted is not None or not self.states.everyone_waits():
            return  # someone is still running and may yet arrive
        if any(w.done for w in self.pending.values()):
            return
        err = CollectiveMismatch(self.states.deadlock_text(lambda _r, w: (w.describe(), w.waiting_for())))
        for w in list(self.pending.values()):
            w.complete(err)

    def _check_alive(self, rank: int | None = None) -> None:
        if self.aborted is not None:
            err = WorldAborted(str(self.aborted))
            if rank is not None:
                self.note_raised(rank, err)
            raise err

    def abort(self, reason: BaseException) -> bool:
        """Fail every pending wait so that every rank unwinds (E3); False when already aborted."""
        with self.lock:
            if self.aborted is not None:
                return False
            self.aborted = reason
            waits: list[Waitable] = [w for ex in self.exchanges.values() for w in ex.sides]
            waits.extend(self.p2p.waiting())
            waits.extend(self.pending.values())
            for r in self.ranks:
                waits.extend(r.open.values())
            for w in waits:
                if not w.done:
                    w.complete(WorldAborted(str(reason)))
        self.abort_event.set()
        return True
