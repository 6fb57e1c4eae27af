"""What a rank of the threaded world can wait on: one side of a collective or of a transfer.

A wait is made when the rank posts the call and completed by the rendezvous (:mod:`.rendezvous`) under its
lock, when the last side arrives or when the call can never complete; ``Work.wait()`` and the futures
``Work.get_future()`` hands out both end here. :class:`Done` is work complete when it is made (coalesced
forms, the fake world).
"""

from __future__ import annotations

from typing import Any

import torch

import dstest.trace as _trace
from dstest.errors import WorkAborted
from dstest.worlds import collectives as C
from dstest.worlds.core import matching
from dstest.worlds.core.matching import Exchange

__all__ = ["CollectiveWait", "Done", "P2PWait", "Waitable"]


class Waitable:
    """Something a rank can wait on: one side of a collective or of a point-to-point transfer.

    ``done`` and ``error`` change only under the rendezvous lock (:meth:`complete`); reading ``done``
    without it is safe (it only ever goes from False to True).
    """

    # Each field starts as the class's value and is set on the instance when it changes: one wait is made
    # per rank per collective, so its constructor sets only what differs.
    where = ""
    record: _trace.CallRecord | None = None  # what the run's recorder keeps of this call (see _trace)
    after: Any = None  # with async hazards: copies the result into the caller's tensors at the wait
    done = False
    error: BaseException | None = None
    futures: list[torch.futures.Future[Any]] | None = None
    _waiter: Any = None  # a held lock while the rank sleeps on this wait (see Rendezvous.wait)

    def __init__(self, session: Any, global_rank: int) -> None:
        self.session = session
        self.global_rank = global_rank

    def describe(self) -> str:
        raise NotImplementedError

    def waiting_for(self) -> list[int]:
        """Global ranks whose action this wait still needs."""
        raise NotImplementedError

    def outputs(self) -> list[torch.Tensor]:
        return []

    def complete(self, error: BaseException | None = None) -> None:
        """Under the rendezvous lock: mark done, wake the rank sleeping on it, resolve handed-out futures."""
        if self.done:
            return
        self.error = self.error or error
        if self.record is not None:
            self.record.finished(self.error)
        self.done = True
        waiter = self._waiter
        if waiter is not None:
            pending = getattr(self.session, "pending", None)
            if pending is not None and pending.get(self.global_rank) is self:
                del pending[self.global_rank]
            turns = getattr(self.session, "turns", None)
            if turns is None:
                waiter.release()
            else:  # a large world: the rank wakes when its turn comes (see .turns)
                turns.admit(waiter)
        if self.futures:
            for fut in self.futures:
                self._resolve(fut)

    def _resolve(self, fut: torch.futures.Future[Any]) -> None:
        if self.error is not None:
            # torch futures take Exceptions only; an abort reaches the waiter as WorkAborted.
            err = self.error if isinstance(self.error, Exception) else WorkAborted(str(self.error))
            self.session.note_raised(self.global_rank, err)
            fut.set_exception(err)
            return
        if self.after is not None:
            self.after()
        fut.set_result(self.outputs())


class CollectiveWait(Waitable):
    """One rank's side of one collective (its ``Call``, and the exchange that matches it across ranks)."""

    def __init__(self, session: Any, global_rank: int, call: C.Call, exchange: Exchange) -> None:
        self.session = session  # Waitable.__init__'s two fields set here directly: the hot path
        self.global_rank = global_rank
        self.call = call
        self.exchange = exchange

    @property
    def where(self) -> str:  # type: ignore[override]
        return self.exchange.where

    def describe(self) -> str:
        return f"{self.call.describe()} on {self.where}"

    def waiting_for(self) -> list[int]:
        return self.exchange.waiting_for()

    def outputs(self) -> list[torch.Tensor]:
        return self.call.outputs()


class P2PWait(Waitable):
    """One rank's side of a send or recv (``peer``: the other side's global rank)."""

    def __init__(
        self, session: Any, global_rank: int, kind: str, tensor: torch.Tensor, peer: int, where: str, tag: int
    ) -> None:
        super().__init__(session, global_rank)
        self.where, self.kind, self.tag = where, kind, tag
        self.tensor = tensor  # the rank's buffer (async hazards put a private one here until the wait)
        self.peer = peer

    def describe(self) -> str:
        return matching.p2p_describe(self.kind, self.tensor, self.peer, self.tag, self.where)

    def waiting_for(self) -> list[int]:
        return [] if self.done else [self.peer]

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class Done(Waitable):
    """Work that is complete when it is made (coalesced forms, the fake world)."""

    def __init__(self, session: Any, rank: int, tensors: list[torch.Tensor]) -> None:
        super().__init__(session, rank)
        self._tensors = tensors
        self.done = True

    def describe(self) -> str:
        return "completed"

    def waiting_for(self) -> list[int]:
        return []

    def outputs(self) -> list[torch.Tensor]:
        return self._tensors
