"""The handle a threaded world's collective returns (``dist.Work``): its wait joins the rendezvous.

Made by the groups of :mod:`.group` around one of the rank's waits (:mod:`.waits`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from dstest.worlds import torch_internals
from dstest.worlds.threaded.waits import P2PWait, Waitable
from dstest.worlds.torch_internals.dispatched import DispatchedWork

__all__ = ["Work"]


class Work(DispatchedWork):
    """The handle a collective returns; ``wait()`` joins the rendezvous and copies this rank's result."""

    def __init__(self, waitable: Waitable) -> None:
        super().__init__()
        self._waitable = waitable

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._waitable.session.wait(self._waitable)
        return True

    def is_completed(self) -> bool:
        w = self._waitable
        if not w.done:
            return False
        if w.error is None:  # polled complete: the caller may read the result now (as with gloo)
            w.session.consume(w)
        return True

    def exception(self) -> BaseException | None:
        return self._waitable.error

    def result(self) -> list[torch.Tensor]:
        return self._waitable.outputs()

    def source_rank(self) -> int:
        w = self._waitable
        return w.peer if isinstance(w, P2PWait) else -1

    def get_future(self) -> torch.futures.Future[Any]:
        source, handed_out = torch_internals.linked_future()  # failed in C++ too when the call fails (DDP's reducer)
        self._waitable.session.hand_out_future(self._waitable, source)
        return handed_out
