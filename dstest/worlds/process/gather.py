"""One run's traffic with a pool's workers: the run sent to each, their replies gathered, the posts of the
cross-rank check handed to the run's referee, and workers that exit noticed (an injected ``Kill``, which
the worker announced to the referee first, or a death).
"""

from __future__ import annotations

import pickle
import selectors
import time
from typing import Any

from dstest.worlds.process.handle import WorkerHandle
from dstest.worlds.process.messages import Reply
from dstest.worlds.process.referee import Referee

#: After one rank fails, seconds the others get to finish before the pool counts as poisoned (they are
#: probably blocked in a collective that the failed rank will never join) and is replaced.
FAILURE_GRACE = 1.0


class Gathering:
    """The replies of one run, gathered until all came, one worker died, the run timed out, or the others had
    :data:`FAILURE_GRACE` seconds after a failure. A worker that an injected Kill ended (it told the referee
    first) goes into ``killed``, not ``dead``: the run goes on without it; its fault counters go into
    ``tallies``."""

    def __init__(
        self, workers: list[WorkerHandle], run_id: int, *, checked: bool, strict_shapes: bool, board: Any = None
    ) -> None:
        self.workers = workers
        self.run_id = run_id
        self.replies: dict[int, Reply] = {}
        self.dead: list[WorkerHandle] = []
        self.killed: dict[int, Any] = {}  # ranks an injected Kill ended -> the fault (contract G5)
        self.tallies: dict[int, Any] = {}  # their fault counters (RankFaults) when they died
        self.first_failure: float | None = None
        # gloo pools: their workers' groups post every call to this run's referee
        self.referee = (
            Referee(run_id, len(workers), [w.check for w in workers], strict_shapes=strict_shapes, board=board)
            if checked
            else None
        )

    def run(self, blob: bytes, timeout: float) -> None:
        """Send the run (``blob``, a pickled command) to every worker and gather until the run is over."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            try:
                w.conn.send_bytes(blob)
            except (EOFError, OSError):
                self.dead.append(w)
        # One selector for the whole run (multiprocessing's wait() builds and fills one per call, 3 W
        # registrations for every message the referee gets): its check channels, then each worker's reply
        # pipe and process sentinel until that worker replied.
        with selectors.DefaultSelector() as sel:
            self._register(sel)
            while len(self.replies) + len(self.killed) < len(self.workers) and not self.dead:
                failed = self.first_failure
                limit = deadline if failed is None else min(deadline, failed + FAILURE_GRACE)
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    break
                self._handle(sel, [key.data for key, _ in sel.select(remaining)])

    def _register(self, sel: selectors.BaseSelector) -> None:
        if self.referee is not None:
            for w in self.workers:
                sel.register(w.check, selectors.EVENT_READ, ("check", w))
        for w in self.workers:
            if w not in self.dead:
                sel.register(w.conn, selectors.EVENT_READ, ("reply", w))
                sel.register(w.process.sentinel, selectors.EVENT_READ, ("exit", w))

    def _handle(self, sel: selectors.BaseSelector, ready: list[tuple[str, WorkerHandle]]) -> None:
        for kind, w in ready:  # the referee first: a verdict may be what a reply waits for
            if kind == "check" and self.referee is not None:
                self._referee_messages(w)
        for kind, w in ready:
            if kind == "reply" and w.rank not in self.replies:
                self._take_reply(sel, w)
        for kind, w in ready:
            if kind == "exit" and w.rank not in self.replies and w not in self.dead and w.rank not in self.killed:
                self._exited(sel, w)

    def _take_reply(self, sel: selectors.BaseSelector, w: WorkerHandle) -> None:
        try:
            reply: Reply = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError):
            return
        if reply.run_id != self.run_id:
            return  # cannot happen while pools are killed on interruption; never mix runs up
        self.replies[w.rank] = reply
        sel.unregister(w.conn)
        sel.unregister(w.process.sentinel)
        if not reply.ok and self.first_failure is None:
            self.first_failure = time.monotonic()

    def _exited(self, sel: selectors.BaseSelector, w: WorkerHandle) -> None:
        """Worker ``w`` exited before it replied: killed by an injected fault (the run goes on), or dead."""
        referee = self.referee
        if referee is not None:
            self._referee_messages(w)  # its last words: an injected Kill?
        if referee is not None and w.rank in referee.killed:
            self.killed[w.rank] = referee.killed[w.rank]
            if w.rank in referee.tallies:
                self.tallies[w.rank] = referee.tallies[w.rank]
            sel.unregister(w.conn)
            sel.unregister(w.process.sentinel)
        else:
            self.dead.append(w)

    def _referee_messages(self, w: WorkerHandle) -> None:
        """Hand the referee everything worker ``w`` has posted so far."""
        assert self.referee is not None
        try:
            while w.check.poll(0):
                self.referee.handle(w.rank, w.check.recv_bytes())
        except (EOFError, OSError):
            pass  # the worker died: its sentinel reports it
