"""The worker side of the check board (issue 44 item 4): a rank's collectives decided without the parent
where the pool's board (:mod:`dstest.worlds.process.board`) matches them.

A rank writes a digest of each collective into the board and keeps the call in its group's queue. A call
whose every member wrote the same digest is issued to gloo by the rank itself, in sequence order per group:
by the caller when it arrives last, else by the thread that waits for it (woken by the write of the rank that
arrived last) or, for a call nobody waits for yet, by the rank's watcher thread. The referee
(:class:`~dstest.worlds.process.referee.Referee`, in the parent) still decides everything else, from the
rank's full call as before: digests that differ (a mismatch, or a call whose ranks' arguments legitimately
differ, such as an all_to_all), a call open for longer than a verdict usually takes (so that the referee can
tell a rank that a peer finished without it, or that the world deadlocked), and the calls still open when a
rank's run ends, which it gives up on the board first (so that no peer can match them any more).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dstest.worlds.process import board as _board
from dstest.worlds.process.posted import PostedCall

if TYPE_CHECKING:
    from dstest.worlds.process.checker import Checker

__all__ = ["BoardCalls", "Outbox"]

_BOARD_NAP_S = 0.05  # the longest the board's watcher sleeps between looks at open calls (a lost wake-up)
_IDLE_NAP_S = 2.0  # how long it sleeps between runs (begin() wakes it)


class Outbox:
    """One rank's messages for the referee: queued under the checker's lock, sent in order by :meth:`flush`,
    never under the checker's lock or the board's. The referee takes the board's lock to look at it, and
    sends verdicts that this rank's listener reads under the checker's lock, so a rank blocked on a full pipe
    to the parent while holding either would deadlock with it (it did, under load, when a rank ran hundreds
    of calls ahead of its peer)."""

    def __init__(self, ck: Checker) -> None:
        self.ck = ck
        self.messages: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()  # one flush at a time: batches leave in the order they were taken

    def post(self, rec: PostedCall) -> None:
        """Post ``rec`` to the referee, once (under the checker's lock; sent by the next :meth:`flush`)."""
        if not rec.sent:
            rec.sent = True
            self.messages.append(rec.msg)

    def put(self, msg: tuple[Any, ...]) -> None:
        """Queue ``msg`` (under the checker's lock)."""
        self.messages.append(msg)

    def flush(self) -> None:
        """Send what was queued so far, in order; returns once it is sent. Called holding neither the
        checker's lock nor the board's, and never by the listener thread (which must keep reading the
        referee's verdicts: it wakes a thread that flushes instead)."""
        if not self.messages:  # most calls queue nothing; a message queued after this look is its queuer's to send
            return
        with self.lock:
            with self.ck.lock:
                out, self.messages = self.messages, []
            for msg in out:
                self.ck._send(msg)


class BoardCalls:
    """One rank's collectives on the pool's check board: their queues per group, and the watcher thread."""

    def __init__(self, ck: Checker, path: str) -> None:
        self.ck = ck
        self.board = _board.Board(path, ck.world_size)
        self.queues: dict[str, deque[PostedCall]] = {}  # by the group's board key
        self.made: dict[str, int] = {}  # groups this rank made, by name (their board keys)
        self.waiters: set[int] = set()  # threads of this rank waiting on the board (they look after open calls)
        self.outbox = Outbox(ck)
        threading.Thread(target=self._watch, name="dstest-check-board", daemon=True).start()

    def begin(self) -> None:
        """A new run (under the checker's lock): no call is open; the watcher, which naps long between runs,
        is woken to nap short."""
        self.queues = {}
        self.made = {}  # a run's groups are counted from 0 on every rank, whatever an earlier run made
        self.board.slots.clear()
        with self.board.locked():
            woken = self.board.bump([self.ck.rank])
        self.board.wake(woken)

    def wake_waiting(self) -> None:
        """Wake this rank's thread that waits on the board (its watcher, if none waits now), unless the only
        thread waiting is the calling one (it decided the call itself, and looks again before it sleeps)."""
        if self.waiters - {threading.get_ident()}:
            self._wake()

    def _wake(self) -> None:
        with self.board.locked():
            woken = self.board.bump([self.ck.rank])
        self.board.wake(woken)

    def key(self, gid: str) -> str:
        """The board key of a new group named ``gid``: its name and how many groups of that name this rank
        made before it in this run; a group the pool made outside any run (its world group, which outlives
        runs) is counted apart. Counting per run keeps the keys of a run's groups equal on every rank even
        after a run in which the ranks made different groups (one failed before making one): with counts
        kept across runs, every later call on such a name went to the referee."""
        with self.ck.lock:
            n = self.made.get(gid, 0)
            self.made[gid] = n + 1
            in_run = self.ck.active
        return f"{gid}#{n}" if in_run else f"{gid}#pool{n}"

    def post(
        self,
        msg: tuple[Any, ...],
        key: str,
        call: Any,
        refereed: bool,
        what: str,
        issue: Callable[[], Any],
        record: Any = None,
    ) -> PostedCall:
        """Post collective ``call`` (``msg``: ("post", gid, members, seq, call)) on the board, as group ``key``
        (:meth:`key`; the referee's messages keep the group's name). ``refereed``: the call needs every rank's
        call to be judged (its ranks' arguments may legitimately differ): the referee decides it."""
        board = self.board
        _kind, name, members, seq, _call = msg
        gid = key
        call.strict_shapes = self.ck.strict_shapes
        with self.ck.lock:
            self.ck.next_id += 1
            rec = PostedCall(self.ck.next_id, what, issue)
            rec.record = record
            run = self.ck.run_id
            rec.gid, rec.seq, rec.members, rec.sent = gid, seq, members, False
            rec.posted_at = time.monotonic()
            # a refereed call is not the board's to match, even where its group has one member (the referee
            # checks what needs every rank's call, all_to_all's pairings, for one rank too)
            rec.refereed = refereed
            rec.msg = ("post", run, rec.post_id, name, members, seq, call, None, None if refereed else key)
            self.ck.records[rec.post_id] = rec
            self.ck.posted.append(rec)
            queue = self.queues.get(gid)
            if queue is None:
                queue = self.queues[gid] = deque()
            if queue and queue[-1].seq > seq:  # two threads of the rank posting on one group: keep seq order
                queue.insert(sum(1 for r in queue if r.seq < seq), rec)
            else:
                queue.append(rec)
            me = self.ck.rank
            digest = (
                _board.mark(run, me, seq, "refereed") if refereed else _board.call_digest(run, gid, members, seq, call)
            )
            # Peers are woken only by the write that decides the call (the last to arrive, or one that
            # differs): a wake-up before that could only find it still open (one per call, not W - 1).
            woken: list[int] = []
            with board.locked():
                rec.on_board = board.write(me, run, gid, members, seq, digest)
                if rec.on_board and board.status(run, gid, members, seq) != _board.PENDING:
                    woken = board.bump([m for m in members if m != me])
                ready = self.progress(gid)
            if refereed or not rec.on_board:
                self.outbox.post(rec)
            self.issue_all(ready)
        self.outbox.flush()
        board.wake(woken)
        for done in ready:
            self.ck._decided(done)
        return rec

    def progress(self, gid: str) -> list[PostedCall]:
        """The calls at the head of ``gid``'s queue that can be issued now, taken out of it in order (under
        the lock and the board's lock): each matched on the board or answered "ok" by the referee. A head the
        board finds different goes to the referee."""
        board = self.board
        queue = self.queues.get(gid)
        ready: list[PostedCall] = []
        if not queue:
            return ready
        run = self.ck.run_id
        while queue:
            head = queue[0]
            if not head.ok:
                on_board = head.on_board and not head.refereed
                status = board.status(run, gid, head.members, head.seq) if on_board else _board.DIFFER
                if status != _board.MATCH:
                    if status == _board.DIFFER:
                        self.outbox.post(head)
                    break
            queue.popleft()
            self.ck.records.pop(head.post_id, None)
            if head.sent and not head.ok:  # posted as slow, then matched here: the referee must not wait for it
                self.outbox.put(("withdraw", run, head.post_id))
            board.set_decided(self.ck.rank, run, gid, head.seq)
            ready.append(head)
        return ready

    def issue_all(self, ready: list[PostedCall]) -> None:
        for rec in ready:  # in order, under the lock: a group's calls reach gloo in its sequence order
            self.ck._issue(rec)

    def advance(self, gids: Sequence[str]) -> None:
        """Issue what the board (or the referee) now allows on groups ``gids`` (from the listener: what this
        queues for the referee is sent by the thread :meth:`verdict` wakes)."""
        board = self.board
        with self.ck.lock:
            if not self.ck.board_on:
                return
            with board.locked():
                ready = [rec for gid in gids for rec in self.progress(gid)]
            self.issue_all(ready)
        for rec in ready:
            self.ck._decided(rec)

    def post_open(self, rec: PostedCall) -> None:
        """Queue ``rec`` for the referee, with every call before it in its group's queue not posted yet
        (under the checker's lock)."""
        for other in list(self.queues.get(rec.gid, ())):
            self.outbox.post(other)
            if other is rec:
                break

    def verdict(self, rec: PostedCall, msg: tuple[Any, ...]) -> None:
        """The referee's verdict on a collective of the board: an error now, "ok" in its group's order; a
        thread of this rank waiting on the board is woken."""
        if msg[0] == "ok":
            rec.ok = True
        else:
            with self.ck.lock:
                queue = self.queues.get(rec.gid)
                if queue is not None and rec in queue:
                    queue.remove(rec)
            rec.error = (msg[3], msg[4])
            self.ck._decided(rec)
        self.advance([rec.gid])  # the calls behind it may go now
        self._wake()

    def _look(self, waiting: bool) -> tuple[int, bool]:
        """Issue what the board (or the referee) allows now on every group; returns the wake word to sleep on
        (the waiting thread's, or the watcher's), read under the board's lock before looking, and whether
        anything was issued. ``waiting``: a thread of this rank waits on the board (its wake-ups go to it)."""
        board = self.board
        with self.ck.lock:
            with board.locked():
                board.set_waiting(self.ck.rank, bool(self.waiters))
                seen = board.word(self.ck.rank, watcher=not waiting)
                ready = [rec for gid in list(self.queues) for rec in self.progress(gid)] if self.ck.board_on else []
            self.issue_all(ready)
        self.outbox.flush()
        for rec in ready:  # each wakes a thread that waits for it (Checker._decided)
            self.ck._decided(rec)
        return seen, bool(ready)

    def wait(self, rec: PostedCall) -> None:
        """Wait for call ``rec`` of the board in the calling thread: it looks at the board each time a peer's
        write (or the referee's verdict) wakes it, and issues what matched itself (one thread woken per
        rank). After a few milliseconds the call goes to the referee, as every slow call does."""
        board = self.board
        with self.ck.lock:
            self.waiters.add(threading.get_ident())
        try:
            told = time.monotonic() + self.ck.quiet_wait_s
            while not rec.event.is_set():
                seen, issued = self._look(waiting=True)
                if rec.event.is_set():
                    return
                if told and time.monotonic() >= told:
                    told = 0.0
                    with self.ck.lock:
                        self.post_open(rec)
                        self.outbox.put(("wait", self.ck.run_id, rec.post_id))
                    with contextlib.suppress(EOFError, OSError):
                        self.outbox.flush()
                if not issued:  # until the quiet wait is over (then the referee hears of the wait), else a nap
                    nap = max(0.0, told - time.monotonic()) if told else _BOARD_NAP_S
                    board.sleep(self.ck.rank, seen, nap)
        finally:
            woken: list[int] = []
            with self.ck.lock:
                self.waiters.discard(threading.get_ident())
                if not self.waiters:  # wake-ups go to the watcher again, which looks at what is still open
                    with board.locked():
                        board.set_waiting(self.ck.rank, False)
                        if any(self.queues.values()):
                            woken = board.bump([self.ck.rank])
            board.wake(woken)

    def _watch(self) -> None:
        """The watcher: issues calls nobody waits for yet once the board matches them (an async call must
        start when every rank has posted it, as gloo starts it), woken by its peers' writes while no thread
        of its rank waits on the board (that thread does it then)."""
        board = self.board
        while True:
            seen, issued = self._look(waiting=False)
            if not issued:  # between runs (no call can be open) it naps long: idle pools stay idle
                nap = self._post_overdue() if self.ck.active else _IDLE_NAP_S
                board.sleep(self.ck.rank, seen, nap, watcher=True)

    def _post_overdue(self) -> float:
        """Post to the referee every call open on the board for longer than a verdict usually takes, waited for
        or not (a call waited for through its future, as DDP's reducer waits, must still learn that a peer
        finished without it); returns how long to sleep before the next one is due."""
        now = time.monotonic()
        nap = _BOARD_NAP_S
        with self.ck.lock:
            for queue in self.queues.values():
                for rec in queue:
                    if rec.sent:
                        continue
                    due = rec.posted_at + self.ck.quiet_wait_s - now
                    if due <= 0:
                        self.outbox.post(rec)
                    else:
                        nap = min(nap, due)
        with contextlib.suppress(EOFError, OSError):
            self.outbox.flush()
        return nap


# -- the end of a rank's run ------------------------------------------------------------------------------
def close_run(calls: BoardCalls) -> None:
    """At the end of this rank's run: issue what the board matched; every other open call is given up on
    the board (its digest replaced by a mark, so no peer can match it from now on) and posted to the
    referee, which reports it as the referee always did (a peer waiting for it learns that this rank
    finished without waiting for it). A call the board matched stays: it is issued once the calls before
    it in its group are answered (:func:`issue_kept`)."""
    board = calls.board
    run, me = calls.ck.run_id, calls.ck.rank
    woken: list[int] = []
    with calls.ck.lock:
        with board.locked():
            ready = [rec for gid in list(calls.queues) for rec in calls.progress(gid)]
            for gid, queue in calls.queues.items():
                for rec in queue:
                    if rec.ok:
                        continue
                    if (
                        rec.on_board
                        and not rec.refereed
                        and board.status(run, gid, rec.members, rec.seq) == _board.MATCH
                    ):
                        continue
                    if rec.on_board:
                        board.overwrite(me, run, gid, rec.seq, _board.mark(run, me, rec.seq, "left"))
                        woken += board.bump([m for m in rec.members if m != me])
                    calls.outbox.post(rec)
        calls.issue_all(ready)
    calls.outbox.flush()
    board.wake(woken)
    for rec in ready:
        calls.ck._decided(rec)


def issue_kept(calls: BoardCalls) -> None:
    """After the referee acknowledged the end of the run (every verdict it will send this rank came):
    issue the calls the board matched that still wait behind calls no verdict will come for."""
    board = calls.board
    with calls.ck.lock:
        ready: list[PostedCall] = []
        with board.locked():
            for gid, queue in calls.queues.items():
                for rec in queue:
                    if rec.ok or (
                        rec.on_board
                        and not rec.refereed
                        and board.status(calls.ck.run_id, gid, rec.members, rec.seq) == _board.MATCH
                    ):
                        ready.append(rec)
                        calls.ck.records.pop(rec.post_id, None)
                queue.clear()
        calls.issue_all(ready)
    for rec in ready:
        calls.ck._decided(rec)
