"""The rendezvous of one threaded run: every rank's calls matched by (group, sequence number), and delivered.

The threaded world's groups (:mod:`.group`) post every call here (the fake world binds the same groups to
a stand-in with the same interface: ``arrive``, ``post_p2p``, ``wait``). Every wait a rank can make goes
through :meth:`Rendezvous.wait` or through a future handed out by ``Work.get_future()``; both are seen by
the rules for ranks that leave the run and for deadlocks, which :class:`~.departures.Departures` (the base
class) holds.

The hot path (one collective) is shaped by its profile: the last rank to arrive checks the calls, writes
every rank's outputs (``Call.deliver``, reading the inputs in place where they cannot alias an output)
and wakes the ranks that sleep on it by releasing one lock each; a woken rank only returns. Outputs are
thus written when the collective completes, as gloo's and NCCL's background work writes them, not when
each rank waits. A wait allocates its wake-up lock only when it has to sleep; all state changes happen
under the rendezvous lock.

The rules themselves (matching by group and sequence number, a rank that finished while others wait on
it, deadlocks, and the texts of these errors) are the checking core's (:mod:`dstest.worlds.core.matching`,
:mod:`dstest.worlds.core.rank_states`), which the process world's referee drives too; this module is the
threaded world's transport around them.
"""

from __future__ import annotations

from _thread import allocate_lock
from typing import Any

import torch

import dstest.trace as _trace
from dstest.errors import CollectiveMismatch
from dstest.worlds import collectives as C
from dstest.worlds.core import c10d, matching
from dstest.worlds.core.faults import Fault, Kill, RankFaults, failed_text, not_fired_error, not_fired_note, plan_for
from dstest.worlds.core.matching import Exchange
from dstest.worlds.injected import InjectedFault
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded.departures import Departures, RankLedger
from dstest.worlds.threaded.failures import RankKilled
from dstest.worlds.threaded.hazards import guard_call, guard_recv
from dstest.worlds.threaded.turns import Turns
from dstest.worlds.threaded.waits import CollectiveWait, P2PWait, Waitable
from dstest.worlds.torch_internals import hash_store
from dstest.worlds.torch_internals.raw_writes import below_autograd

__all__ = ["Rendezvous"]

_NO_CHECK_ALL = C.Call.check_all


class Rendezvous(Departures):
    """Matches the calls of every rank of one world run, delivers their results, and holds the run's options."""

    #: A large cold world's turns (:mod:`.turns`): who of its ranks runs Python; None: every rank at once.
    turns: Turns | None = None

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.store = hash_store()
        self.groups: dict[tuple[Any, int], Any] = {}  # (group key, global rank) -> that rank's group
        self.recorder = _trace.Recorder(world_size, limit=_trace.RING_LIMIT)
        self.hazards = False  # the run request's options (see configure)
        self.strict_shapes = False
        # Injected faults (contract G5): None, or each rank's counters (None for a rank no fault names),
        # and the faults that fired.
        self.faults: list[RankFaults | None] | None = None
        self.fired: list[Fault] = []

    def configure(self, recorder: _trace.Recorder, request: RunRequest) -> None:
        """The run's recorder and options, from its request (before any rank starts)."""
        faults = request.faults
        with self.lock:
            self.recorder = recorder
            self.hazards = request.async_hazards
            self.strict_shapes = request.strict_shapes
            self.faults = [plan_for(faults, r) for r in range(self.world_size)] if faults else None
            self.fired, self.failed_exchanges = [], {}
            self.killed.clear()

    def reset(self) -> None:
        """Start a new run on a warm rendezvous (called while no rank is inside a run)."""
        with self.lock:
            self.states.reset()
            self.aborted = None
            if self.abort_event.is_set():
                self.abort_event.clear()
            if any(ledger.open or ledger.raised for ledger in self.ranks):  # a run that passed leaves them empty
                self.ranks = [RankLedger() for _ in range(self.world_size)]
            self.faults, self.fired, self.failed_exchanges = None, [], {}

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

    # -- injected faults (contract G5) ------------------------------------------------------------------
    def inject(self, rank: int, fault: Fault) -> None:
        """A fault fired before rank ``rank``'s call: a Kill unwinds the rank (:class:`RankKilled`); the
        caller handles a Delay (sleep) and a Fail (:meth:`arrive` with ``fail``)."""
        with self.lock:
            self.fired.append(fault)
            if isinstance(fault, Kill):
                self.states.kill(rank, fault)
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
        seq = group._seq = group._seq + 1  # Group.next_seq, inline: once per rank and collective
        key = (group.xid, seq)  # two ints: hashed in C (see group.exchange_id)
        mine = call.key()  # outside the lock
        record = self.recorder.collective(group, call, seq, group.owner)
        after = guard_call(call) if self.hazards else None
        with self.lock:
            if self.aborted is not None:
                self._check_alive()
            exchanges = self.exchanges
            ex = exchanges.get(key)
            if ex is None:
                ex = self.failed_exchanges.get(key) if self.fired else None
                if ex is None:
                    ex = exchanges[key] = Exchange(group.global_ranks, group.label, seq)
            wait = CollectiveWait(self, ex.global_ranks[call.group_rank], call, ex)
            wait.record = record
            if after is not None:
                wait.after = after
            if fail is not None:  # a Fail fault: this collective fails on every rank that joins it
                del exchanges[key]
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
                if self.states.left:  # only a rank that left can doom it; most runs have none mid-collective
                    gone = self.states.gone_from(ex)  # a killed peer first: it is the cause
                    if gone is not None:
                        self._doom_waits_needing(gone)
                return wait
            del exchanges[key]
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
            # Exchange.verdict asks Call.check_all, which only some collectives have (not all_reduce's)
            why = ex.verdict() if type(calls[0]).check_all is not _NO_CHECK_ALL else None
            if why is not None:
                error = CollectiveMismatch(why)
            else:
                with below_autograd():  # C.raw_writes(), one call less
                    failed = calls[0].deliver(calls)
                if calls[0].version_bumps:
                    calls[0].bump_versions([c for c in calls if c.group_rank not in failed] if failed else calls)
        except Exception as exc:
            error = exc
        with self.lock:
            ex.error = error
            for w in ex.sides:
                w.complete(error or failed.get(w.call.group_rank))

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
            if wait.peer in self.states.left:
                cls, phrase = self._left_how(wait.peer)
                err = cls(matching.p2p_left_text(wait.global_rank, wait.describe(), kind, wait.peer, phrase))
                record.finished(err)
                raise self._raise(wait.global_rank, err)
            self.ranks[wait.global_rank].open[id(wait)] = wait
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

    # -- waiting -------------------------------------------------------------------------------------
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
            turns = self.turns
            if turns is None:
                waiter.acquire()
            else:  # a large world: hand the turn on while asleep, be handed one to wake (see .turns)
                turns.give()
                waiter.acquire()
                turns.woke(waiter)
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
