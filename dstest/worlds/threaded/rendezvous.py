"""The rendezvous of one world run: collectives matched by (group, sequence number), transfers, waits.

The threaded world's groups (:mod:`.group`) post every call here (the fake world binds the same groups to
a stand-in with the same interface: ``arrive``, ``post_p2p``, ``wait``). Every wait a rank can make goes through :meth:`Rendezvous.wait` or through a
future handed out by ``Work.get_future()``; both are seen by the deadlock check:

- when every rank still running waits and none of the waits can complete, every wait fails with the
  pending call of each rank (a mismatch of groups or peers, a rank that skips a collective);
- when a rank *finishes its function*, every collective and transfer that still needs it can never
  complete: it fails at once, so a rank blocked on it through a future (DDP's reducer, FSDP's hooks) is
  woken with the error instead of hanging;
- a rank that an injected ``Kill`` ended (contract G5, :mod:`dstest.worlds.core.faults`) left the run the
  same way, and the waits that need it fail with :class:`~dstest.worlds.injected.InjectedFault` (a backend
  error, as gloo and NCCL raise when a peer is gone) instead of a mismatch; so do the sides of a
  collective a ``Fail`` broke.

What a rank leaves behind is checked when it finishes (:meth:`Rendezvous.rank_done`): work it posted that no
rank matched or that it never waited, and errors dstest raised into its code that the code caught. Each
is a failure of that rank, so no run passes with unmatched work or a swallowed mismatch.

The hot path (one collective) is shaped by its profile: the last rank to arrive checks the calls, writes
every rank's outputs (``Call.deliver``, reading the inputs in place where they cannot alias an output)
and wakes the ranks that sleep on it by releasing one lock each; a woken rank only returns. Outputs are
thus written when the collective completes, as gloo's and NCCL's background work writes them, not when
each rank waits. A wait allocates its wake-up lock only when it has to sleep; all state changes happen
under the rendezvous lock.

The rules themselves (matching by group and sequence number, a rank that finished while others wait on
it, deadlocks, and the texts of these errors) are the checking core's (:mod:`dstest.worlds.core.matching`),
which the process world's referee drives too; this module is the threaded world's transport around them.
"""

from __future__ import annotations

import threading
import traceback
from _thread import allocate_lock
from collections.abc import Sequence
from typing import Any

import torch

import dstest.trace as _trace
from dstest.errors import CollectiveMismatch, UnfinishedWork, WorldAborted
from dstest.worlds import collectives as C
from dstest.worlds.core import c10d, matching
from dstest.worlds.core.faults import (
    Fault,
    Kill,
    RankFaults,
    failed_text,
    killed_phrase,
    not_fired_error,
    not_fired_note,
    plan_for,
)
from dstest.worlds.core.matching import FINISHED, Exchange
from dstest.worlds.injected import InjectedFault
from dstest.worlds.threaded.failures import RankKilled
from dstest.worlds.threaded.hazards import guard_call, guard_recv
from dstest.worlds.threaded.waits import CollectiveWait, P2PWait, Waitable
from dstest.worlds.torch_internals import hash_store

__all__ = ["Rendezvous"]


class _RankState:
    """What one rank has posted and not yet consumed, and the errors dstest raised into its code."""

    def __init__(self) -> None:
        self.open: dict[int, Waitable] = {}
        self.raised: list[BaseException] = []


def _issued_at(wait: Waitable) -> str:
    return f", issued at {wait.record.issued_at()}" if wait.record is not None else ""


def _caught_where(err: BaseException) -> str:
    """Where the code under test caught ``err``: the outermost frame of its traceback (the handler's)."""
    tb = err.__traceback__
    if tb is None:
        return "an unknown place"
    frame = traceback.extract_tb(tb, limit=1)[0]
    return f"{frame.filename}:{frame.lineno} (in {frame.name})"


class Rendezvous:
    """Rendezvous state, abort flag and bookkeeping of one world run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.store = hash_store()
        self.exchanges: dict[tuple[Any, ...], Exchange] = {}
        self.p2p = matching.Transfers()  # of P2PWait
        self.pending: dict[int, Waitable] = {}  # global rank -> what it is blocked on
        self.done: set[int] = set()
        self.aborted: BaseException | None = None
        self.abort_event = threading.Event()
        self.groups: dict[tuple[Any, int], Any] = {}  # (group key, global rank) -> that rank's group
        self.ranks = [_RankState() for _ in range(world_size)]
        self.recorder = _trace.Recorder(world_size, limit=_trace.RING_LIMIT)
        self.hazards = False  # the run request's options (see configure)
        self.strict_shapes = False
        # Injected faults (contract G5): None, or each rank's counters (None for a rank no fault names);
        # the faults that fired, and the ranks a Kill ended (they left the run as a crash would).
        self.faults: list[RankFaults | None] | None = None
        self.fired: list[Fault] = []
        self.killed: dict[int, Fault] = {}
        self.failed_exchanges: dict[tuple[Any, ...], Exchange] = {}  # broken by a Fail: later sides fail too

    def configure(
        self, recorder: _trace.Recorder, *, hazards: bool, strict_shapes: bool, faults: Sequence[Fault] = ()
    ) -> None:
        """The run's recorder and options, from its :class:`~dstest.worlds.request.RunRequest` (before any rank starts)."""
        with self.lock:
            self.recorder = recorder
            self.hazards = hazards
            self.strict_shapes = strict_shapes
            self.faults = [plan_for(faults, r) for r in range(self.world_size)] if faults else None
            self.fired, self.killed, self.failed_exchanges = [], {}, {}

    def reset(self) -> None:
        """Start a new run on a warm rendezvous (called while no rank is inside a run)."""
        with self.lock:
            self.done.clear()
            self.pending.clear()
            self.aborted = None
            self.abort_event.clear()
            self.ranks = [_RankState() for _ in range(self.world_size)]
            self.faults, self.fired, self.killed, self.failed_exchanges = None, [], {}, {}

    def leftovers(self) -> bool:
        """Whether a run left a collective or a transfer half done (then the rendezvous cannot be reused)."""
        with self.lock:
            return bool(self.exchanges) or bool(self.p2p)

    def register_group(self, group: Any) -> None:
        with self.lock:
            self.groups[(group.key, group.global_ranks[group.rank_])] = group

    def forget_groups(self, keep: set[Any]) -> None:
        with self.lock:
            self.groups = {k: g for k, g in self.groups.items() if g in keep}

    def group_of(self, key: Any, global_rank: int) -> Any | None:
        with self.lock:
            return self.groups.get((key, global_rank))

    def note_raised(self, rank: int, err: BaseException) -> None:
        """Remember an error dstest raised into rank ``rank``'s code (checked when the rank finishes)."""
        if 0 <= rank < self.world_size:
            self.ranks[rank].raised.append(err)

    def _raise(self, rank: int, err: BaseException) -> BaseException:
        copy = _copy_error(err)
        self.note_raised(rank, copy)
        return copy

    def _open(self, wait: Waitable) -> None:
        self.ranks[wait.global_rank].open[id(wait)] = wait

    def consume(self, wait: Waitable) -> None:
        """``wait`` was waited, polled complete or handed to a future: no longer the rank's open work."""
        if 0 <= wait.global_rank < self.world_size:
            self.ranks[wait.global_rank].open.pop(id(wait), None)

    # -- injected faults (contract G5) ------------------------------------------------------------------
    def inject(self, rank: int, fault: Fault) -> None:
        """A fault fired before rank ``rank``'s call: a Kill unwinds the rank (:class:`RankKilled`); the
        caller handles a Delay (sleep) and a Fail (:meth:`arrive` with ``fail``)."""
        with self.lock:
            self.fired.append(fault)
            if isinstance(fault, Kill):
                self.killed[rank] = fault
        if isinstance(fault, Kill):
            raise RankKilled(fault)

    def fault_note(self) -> str:
        """For a failure report: the run's injected faults, which fired, and which never did."""
        if not self.fired and self.faults is None:
            return ""
        fired = "; ".join(f.describe() for f in self.fired) or "none"
        return "\ninjected faults that fired: " + fired + not_fired_note(self.faults or ())

    def raise_not_fired(self) -> None:
        """After a run that passed: raise :class:`~dstest.errors.FaultNotFired` when one of its faults never
        fired (contract G5); the ranks are done, so their counters are final."""
        err = not_fired_error(self.faults or ())
        if err is not None:
            raise err

    # -- collectives ---------------------------------------------------------------------------------
    def arrive(self, group: Any, call: C.Call, fail: Fault | None = None) -> CollectiveWait:
        call.check_local()
        if self.strict_shapes:  # the class default is False
            call.strict_shapes = True
        seq = group.next_seq()
        key = (group.key, seq)
        mine = call.key()  # outside the lock
        record = self.recorder.collective(group, call, seq, group.owner)
        after = guard_call(call) if self.hazards else None
        with self.lock:
            if self.aborted is not None:
                self._check_alive()
            ex = self.exchanges.get(key)
            if ex is None:
                ex = self.failed_exchanges.get(key) if self.fired else None
                if ex is None:
                    ex = self.exchanges[key] = Exchange(group.global_ranks, group.label, seq)
            wait = CollectiveWait(self, ex.global_ranks[call.group_rank], call, ex)
            wait.record, wait.after = record, after
            if fail is not None:  # a Fail fault: this collective fails on every rank that joins it
                del self.exchanges[key]
                self._fail_exchange(ex, InjectedFault(failed_text(fail, ex.where)))
                self.failed_exchanges[key] = ex
            if ex.error is not None:
                record.finished(ex.error)
                raise self._raise(wait.global_rank, ex.error)
            why = ex.join(call, mine)
            if why is not None:
                err = CollectiveMismatch(why)
                self._fail_exchange(ex, err)
                record.finished(err)
                raise self._raise(wait.global_rank, err)
            ex.sides.append(wait)
            self.ranks[wait.global_rank].open[id(wait)] = wait
            if ex.missing:
                if self.done:  # only a finished rank can doom it; most runs have none mid-collective
                    gone = ex.left(self.killed) if self.killed else None  # a killed peer is the cause
                    gone = ex.left(self.done) if gone is None else gone
                    if gone is not None:
                        self._doom_waits_needing(gone)
                return wait
            del self.exchanges[key]
        self._complete(ex)
        return wait

    def _complete(self, ex: Exchange) -> None:
        """By the last rank to arrive, outside the lock: check every call, write every rank's outputs,
        then wake the others. The other ranks are inside the collective or past an async post, so their
        inputs are read in place (as NCCL reads them); outputs are written below autograd, whatever this
        thread's grad mode (as a backend's C++ writes them), their versions changed as gloo's copies change
        them (see ``C.raw_writes``)."""
        calls: list[C.Call] = ex.calls  # complete: no None left
        error: BaseException | None = None
        failed: dict[int, BaseException] = {}
        try:
            why = ex.verdict()
            if why is not None:
                error = CollectiveMismatch(why)
            else:
                with C.raw_writes():
                    failed = calls[0].deliver(calls)
                if calls[0].version_bumps:
                    calls[0].bump_versions([c for c in calls if c.group_rank not in failed] if failed else calls)
        except Exception as exc:
            error = exc
        with self.lock:
            ex.error = error
            for w in ex.sides:
                w.complete(error or failed.get(w.call.group_rank))

    def _fail_exchange(self, ex: Exchange, err: BaseException) -> None:
        ex.error = err
        for w in ex.sides:
            w.complete(err)

    # -- point to point --------------------------------------------------------------------------------
    def post_p2p(self, group: Any, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> P2PWait:
        c10d.check_peer_rank(kind, peer, group.size_, f"group {group.label}")
        me = group.rank_
        src, dst = (me, peer) if kind == "send" else (peer, me)
        where = f"group {group.label}"
        wait = P2PWait(self, group.global_ranks[me], kind, tensor, group.global_ranks[peer], where, tag)
        record = wait.record = self.recorder.p2p(group, kind, tensor, wait.peer, tag, wait.global_rank)
        if self.hazards and kind == "recv":
            guard_recv(wait)
        with self.lock:
            self._check_alive()
            if wait.peer in self.done:
                cls, phrase = self._left_how(wait.peer)
                err = cls(matching.p2p_left_text(wait.global_rank, wait.describe(), kind, wait.peer, phrase))
                record.finished(err)
                raise self._raise(wait.global_rank, err)
            self._open(wait)
            other = self.p2p.match((group.key, src, dst, tag), kind, wait)
            if other is None:
                return wait
        send, recv = (wait, other) if kind == "send" else (other, wait)
        error: BaseException | None = None
        if not matching.same_buffer(send.tensor, recv.tensor, self.strict_shapes):
            error = CollectiveMismatch(
                matching.p2p_mismatch_text(where, send.global_rank, send.describe(), recv.global_rank, recv.describe())
            )
        else:
            with C.raw_writes():  # gloo's recv writes in place: no autograd, no version change
                C.copy_flat(recv.tensor, send.tensor)
        with self.lock:
            send.complete(error)
            recv.complete(error)
        return wait

    # -- waiting, deadlocks, abort -------------------------------------------------------------------
    def wait(self, waitable: Waitable) -> None:
        rank = waitable.global_rank
        waiter = None
        record = waitable.record
        if record is not None:
            record.waiting(self.recorder.logs.get(rank))
        with self.lock:
            if 0 <= rank < self.world_size:  # consume(waitable), inline: once per call
                self.ranks[rank].open.pop(id(waitable), None)
            if not waitable.done:
                self._check_alive(rank)
                # Sleep on a lock of its own: complete() releases it (and drops the pending entry) under
                # the rendezvous lock, so a woken rank takes no lock on its way out.
                waiter = waitable._waiter = allocate_lock()
                waiter.acquire()
                self.pending[rank] = waitable
                self._detect_deadlock()
        if waiter is not None:
            waiter.acquire()
        if record is not None:
            record.waited()
        if waitable.error is not None:
            raise self._raise(rank, waitable.error)
        if waitable.after is not None:
            waitable.after()

    def hand_out_future(self, waitable: Waitable, fut: torch.futures.Future[Any]) -> None:
        """Resolve ``fut`` when ``waitable`` completes (at once if it has)."""
        with self.lock:
            self.consume(waitable)
            if not waitable.done:
                if waitable.futures is None:
                    waitable.futures = []
                waitable.futures.append(fut)
                return
        waitable._resolve(fut)

    def rank_done(self, rank: int, returned: bool) -> BaseException | None:
        """Rank ``rank`` finished its function (``returned``: without raising).

        Fails every wait that still needs the rank, and returns the rank's own failure, if any: work it
        left unmatched or unwaited, or an error dstest raised into it that its code caught.
        """
        with self.lock:
            self.done.add(rank)
            state = self.ranks[rank]
            left = list(state.open.values())
            state.open.clear()
            raised = [e for e in state.raised if not isinstance(e, InjectedFault)]  # expected: a fault's
            self._doom_waits_needing(rank)
            self._detect_deadlock()
            if rank in self.killed:
                return None  # it died: what it left behind is its peers' problem, as on a real backend
        problem: BaseException | None = None
        unmatched = [w for w in left if not w.done]
        unwaited = [w for w in left if w.done]  # their outputs hold the result, as gloo's would
        if left and self.aborted is None:
            lines = [
                f"  never waited, and unmatched when the rank finished (missing ranks {w.waiting_for()}): "
                f"{w.describe()}"
                for w in unmatched
            ]
            lines += [
                f"  never waited (call .wait() on the work it returned): {w.describe()}{_issued_at(w)}"
                for w in unwaited
            ]
            problem = UnfinishedWork(
                f"rank {rank} finished its function with work left over; every async collective and "
                "transfer must be matched by its peers and waited:\n" + "\n".join(lines)
            )
        elif returned and raised and self.aborted is None:
            first = raised[0]
            problem = CollectiveMismatch(
                f"rank {rank} finished its function although dstest raised {type(first).__name__} into it, "
                f"which its code caught at {_caught_where(first)}: a mismatch fails the world even when "
                f"caught. The error was: {first}"
            )
        return problem

    def _left_how(self, rank: int) -> tuple[type[BaseException], str]:
        """The error class and phrase for waits on ``rank``, which left: it finished, or a Kill ended it."""
        fault = self.killed.get(rank) if self.killed else None
        return (CollectiveMismatch, FINISHED) if fault is None else (InjectedFault, killed_phrase(fault))

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
        if self.aborted is not None or not matching.everyone_waits(self.world_size, len(self.pending), len(self.done)):
            return  # someone is still running and may yet arrive
        if any(w.done for w in self.pending.values()):
            return
        blocked = {r: (w.describe(), w.waiting_for()) for r, w in self.pending.items()}
        err = CollectiveMismatch(matching.deadlock_text(blocked, dict.fromkeys(self.done, FINISHED)))
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


def _copy_error(err: BaseException) -> BaseException:
    """A fresh instance per raising rank: one exception object raised in several threads shares __traceback__."""
    try:
        return type(err)(*err.args)
    except Exception:
        return err
