"""The worker side of the cross-rank check: a rank's posted calls, their verdicts, and the end of a run.

The groups that post through it are in :mod:`dstest.worlds.process.checked`; the parent's referee is in
:mod:`dstest.worlds.process.referee`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import dstest.trace as _trace
from dstest.errors import (
    CollectiveMismatch,
    UnfinishedWork,
    WorldAborted,
)
from dstest.worlds.core.faults import Fault, RankFaults, plan_for
from dstest.worlds.injected import InjectedFault
from dstest.worlds.process.board_calls import BoardCalls, close_run, issue_kept
from dstest.worlds.process.posted import PostedCall

#: Verdict kinds of injected faults (contract G5): a peer was killed, or a Fail broke the collective.
_INJECTED = ("killed", "injected")

# Cross-rank checking, worker side
# ------------------------------------------------------------------------------------------------------
#
# gloo checks almost nothing across ranks: a shape, op, root or group-order mismatch hangs, a dtype
# mismatch aborts the process. So in a gloo pool every process group a run uses is a ``_CheckedGroup``, a
# Python ProcessGroup (registered as the c10d backend ``dstest_gloo``) that forwards to a real
# ProcessGroupGloo only after the parent's referee (``Referee``) saw every rank's side of the call and
# found that they match. torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper does a similar check with a
# monitored barrier and a fingerprint all-gather over a helper gloo group; that only tells a rank that
# *its* call differs, needs every rank to reach the check (a skipped collective still hangs), and cannot
# see a rank that finished. The referee sees all ranks at once: who posted what, who waits, who finished.
#
#   rank r                                   parent (referee, inside the run's wait loop)
#   dist.all_reduce(t)
#     -> post(group, seq, Call of metadata) ---> compare with the other ranks' calls of (group, seq)
#     <- "ok" (once all posted) | error   <---- mismatch / a member finished / deadlock -> error to all
#   listener thread: "ok" -> issue the gloo op; wait() waits for it
#
# A call is issued to gloo only once every rank of its group posted a matching one, so gloo never sees
# an unmatched or mismatched call, and work that a run leaves unmatched cannot leak into the next run.
# Issuing happens on the listener thread, in verdict order (per group: sequence order), so async calls
# keep their meaning: they start when every rank has posted them, whether or not anyone waits yet.
#
# The check board (issue 44 item 4, :mod:`dstest.worlds.process.board`) takes the parent out of the common
# case: a rank writes a digest of each collective into the pool's shared board, and when every member's
# digest is there and equal, each rank issues the call itself (the last to arrive at once, the others on
# the wake-up its write sends them), in sequence order per group. The referee still decides every call the
# board does not match: digests that differ (a mismatch, or a call such as all_to_all whose ranks'
# arguments legitimately differ), a rank that waits more than a few milliseconds (it posts its call then, so
# that the referee can name a peer that finished or a deadlock), and calls still open when a rank's run
# ends. Point-to-point calls and runs with injected faults go to the referee as before.


_CHECK_DRAIN_S = 10.0  # seconds a rank waits, at the end of a run, for matched work still in flight
_CHECK_ACK_S = 30.0  # seconds a rank waits for the referee to acknowledge the end of its run
_CHECK_QUIET_WAIT_S = 0.005  # seconds a rank waits for a verdict before it tells the referee it waits


def check_error(kind: str, message: str) -> BaseException:
    if kind == "aborted":
        return WorldAborted(message)
    if kind in _INJECTED:
        return InjectedFault(message)
    return CollectiveMismatch(message)


class Checker:
    """This worker's side of the check: posts calls, receives verdicts, issues matched calls to gloo."""

    def __init__(self, conn: Connection, rank: int, world_size: int) -> None:
        self.conn = conn
        self.rank = rank
        self.world_size = world_size
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.run_id = 0  # 0: between runs, calls go straight to gloo (the pool's warm-up all_reduce)
        self.records: dict[int, PostedCall] = {}
        self.posted: list[PostedCall] = []
        self.raised: list[str] = []  # mismatches raised on this rank during the run
        self.next_id = 0
        self.acked = threading.Event()
        self.recorder = _trace.Recorder(world_size, "process", callers=3)
        self.faults: RankFaults | None = None  # this rank's injected faults in this run (contract G5)
        # The check board (issue 44 item 4): this rank's calls on the pool's board, whether this run uses
        # it, and the run's shape rule (part of a call's digest).
        self.board: BoardCalls | None = None
        self.board_on = False
        self.strict_shapes = False
        self.quiet_wait_s = _CHECK_QUIET_WAIT_S
        self.listener = threading.Thread(target=self._listen, name="dstest-check-listener", daemon=True)
        self.listener.start()

    def attach_board(self, path: str) -> None:
        """Use the pool's check board (the file at ``path``) from the next run on."""
        self.board = BoardCalls(self, path)

    def board_key(self, gid: str) -> str:
        """The key of a new group named ``gid`` on the check board (its name where the pool has no board)."""
        return self.board.key(gid) if self.board is not None else gid

    @property
    def active(self) -> bool:
        return self.run_id != 0

    def _send(self, msg: tuple[Any, ...]) -> None:
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(blob)

    # -- runs -------------------------------------------------------------------------------------------
    def begin(self, run_id: int, faults: tuple[Fault, ...] = (), strict_shapes: bool = False) -> None:
        with self.lock:
            self.faults = plan_for(faults, self.rank) if faults else None
            # Runs with injected faults go through the referee only: it is what fails a call as a fault says.
            self.board_on = self.board is not None and not faults
            self.strict_shapes = strict_shapes
            if self.board is not None:
                self.board.begin()
            self.run_id = run_id
            self.records.clear()
            self.posted = []
            self.raised = []
            self.next_id = 0
            self.acked.clear()
            self.recorder = _trace.Recorder(self.world_size, "process", callers=3)

    def kill(self, fault: Fault) -> None:
        """An injected Kill: tell the referee (so the peers' calls that need this rank fail at once; with the
        rank's fault counters, for the faults that never fired), then die as a killed process does: SIGKILL,
        no cleanup, no reply."""
        with contextlib.suppress(EOFError, OSError):
            self._send(("killed", self.run_id, fault, self.faults))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
        os._exit(137)  # not reached where SIGKILL exists

    def end(self, failure: BaseException | None) -> tuple[BaseException | None, str | None]:
        """Close this rank's run with the referee; returns (the error the run must fail with, why the
        worker is unusable), both None when everything this rank posted was matched and waited."""
        summary = "" if failure is None else f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
        if self.board_on and self.board is not None:
            close_run(self.board)
        with self.lock:
            answered = all(rec.event.is_set() for rec in self.posted)
        # The referee's acknowledgement comes after every verdict it sent this rank, so waiting for it is
        # what makes a verdict still on its way count below. When every call this rank posted was answered,
        # nothing the referee sends can change this rank's end: it neither waits nor asks for one (a round
        # trip through the parent per run, issue 44 item 4). The referee still hears of the end, for the
        # peers that need it.
        try:
            self._send(("done", self.run_id, failure is None, summary, not answered))
        except (EOFError, OSError):
            self.run_id = 0
            return None, "the check channel to the parent is closed"
        acked = answered or self.acked.wait(_CHECK_ACK_S)
        if self.board_on and self.board is not None:
            issue_kept(self.board)
        with self.lock:
            posted = list(self.posted)
            raised = list(self.raised)
            self.run_id = 0  # late verdicts of this run are dropped from here on
        unhealthy = None if acked else f"the referee did not acknowledge the end of the run within {_CHECK_ACK_S:g} s"
        problems, unhealthy = self._left_behind(posted, unhealthy)
        if failure is not None:
            return None, unhealthy
        if problems:
            return (
                UnfinishedWork(f"rank {self.rank} finished its function with work left behind: " + "; ".join(problems)),
                unhealthy,
            )
        if raised:
            return (
                CollectiveMismatch(
                    f"rank {self.rank}: a collective mismatch was raised and caught by the code under test, "
                    f"which then finished normally; the world still fails: {raised[0]}"
                ),
                unhealthy,
            )
        return None, unhealthy

    def _left_behind(self, posted: list[PostedCall], unhealthy: str | None) -> tuple[list[str], str | None]:
        """What this rank's posted calls left at the end of its run (each a report line), and why the worker
        is unusable (``unhealthy``, or a matched call that did not complete)."""
        problems: list[str] = []
        for rec in posted:
            if not rec.event.is_set():
                problems.append(
                    f"{rec.what} was not matched by the other ranks it needs before the function returned, "
                    f"and never waited (nothing of it reached gloo)"
                )
                continue
            if rec.inner is not None and not rec.waited:
                # Matched, so every rank issued it and it completes: let it finish before the next run.
                # Never a second wait on waited work: gloo closes the pair when that one times out.
                try:
                    rec.inner.wait(datetime.timedelta(seconds=_CHECK_DRAIN_S))
                except Exception as exc:
                    unhealthy = unhealthy or f"{rec.what} did not complete at the end of the run: {exc}"
            if not rec.waited:
                if rec.error is not None:
                    problems.append(f"{rec.what} failed and was never waited: {rec.error[1].splitlines()[0]}")
                else:
                    issued = f", issued at {rec.record.issued_at()}" if rec.record is not None else ""
                    problems.append(
                        f"{rec.what} was never waited (async_op=True, isend or irecv without wait()){issued}"
                    )
        return problems, unhealthy

    # -- posting ------------------------------------------------------------------------------------------
    def post(self, msg: tuple[Any, ...], what: str, issue: Callable[[], Any], record: Any = None) -> PostedCall:
        """Send one call's description (``msg`` without run and post ids) and return its record."""
        with self.lock:
            self.next_id += 1
            rec = PostedCall(self.next_id, what, issue)
            rec.record = record
            self.records[rec.post_id] = rec
            self.posted.append(rec)
            run_id = self.run_id
        self._send((msg[0], run_id, rec.post_id, *msg[1:]))
        return rec

    def wait_verdict(self, rec: PostedCall) -> None:
        rec.waited = True
        if rec.record is not None:
            rec.record.waiting(self.recorder.logs.get(self.rank))
        if rec.gid and not rec.event.is_set() and self.board is not None:
            self.board.wait(rec)
            self._raise_for(rec)
            return
        # The referee hears of the wait (for its deadlock and finished-peer reports) only when the verdict
        # is slow in coming: a matched call's verdict usually arrives first, one message less per call.
        if not rec.event.wait(self.quiet_wait_s):
            with contextlib.suppress(EOFError, OSError):
                self._send(("wait", self.run_id, rec.post_id))
            rec.event.wait()
        self._raise_for(rec)

    def _raise_for(self, rec: PostedCall) -> None:
        """Raise what ``rec``'s verdict says (a mismatch, an injected fault, gloo's refusal), if anything."""
        if rec.error is not None:
            if rec.error[0] != "aborted" and rec.error[0] not in _INJECTED:  # a fault's error is expected
                with self.lock:
                    self.raised.append(rec.error[1].splitlines()[0])
            raise check_error(*rec.error)
        if rec.issue_error is not None:
            raise rec.issue_error

    # -- verdicts -----------------------------------------------------------------------------------------
    def _listen(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return
            kind, run_id = msg[0], msg[1]
            if run_id != self.run_id:
                continue  # a verdict of an earlier run
            if kind == "ack":
                self.acked.set()
                continue
            rec = self.records.pop(msg[2], None)
            if rec is None:
                continue
            if rec.gid and self.board is not None:  # a collective of the board: issued in its group's order
                self.board.verdict(rec, msg)
                continue
            if kind == "ok":
                self._issue(rec)
            else:
                rec.error = (msg[3], msg[4])
            self._decided(rec)

    def _issue(self, rec: PostedCall) -> None:
        try:
            rec.inner = rec.issue()
        except Exception as exc:
            rec.issue_error = exc

    def _decided(self, rec: PostedCall) -> None:
        """``rec`` has its verdict (and its gloo work, if "ok"): its waiter and callbacks learn of it."""
        if rec.record is not None:
            rec.record.finished(check_error(*rec.error) if rec.error is not None else rec.issue_error)
        with self.lock:
            rec.event.set()
            callbacks = list(rec.callbacks)
        if rec.gid and self.board is not None:
            # Another thread of this rank may be asleep on the board waiting for this call (it looked before
            # the call was decided here, by the watcher or the listener): wake it, or it sleeps its full nap.
            self.board.wake_waiting()
        for cb in callbacks:
            with contextlib.suppress(Exception):
                cb()
