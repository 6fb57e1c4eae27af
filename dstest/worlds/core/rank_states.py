"""Where each rank of a run stands, for the checks that need every rank: running, waiting in a call, or gone.

Both simulated worlds follow one state machine for ranks that leave the run and for deadlock (contract E2),
so it is written once, here, without torch; each world keeps only its transport (the threaded world's
rendezvous wakes rank threads, the process world's referee answers workers through pipes):

- a rank *waits* in one call at a time (:meth:`RankStates.wait`, :meth:`RankStates.stop_waiting`);
- a rank *leaves* the run (:meth:`RankStates.leave`): it finished its function, it failed, or an injected
  ``Kill`` ended it (:meth:`RankStates.kill`, recorded when the fault fires, which may be before the rank
  leaves). From then on every call that still needs it fails, with the kind and the phrase of
  :meth:`RankStates.how`; :meth:`RankStates.gone_from` names the member of a collective that left without
  joining it (a killed one first: it is the cause);
- when every rank still running waits, nothing can arrive any more: :meth:`RankStates.everyone_waits`,
  and :meth:`RankStates.deadlock_text` says what each rank waits in and for whom.

The texts are the checking core's (:mod:`dstest.worlds.core.matching`); the kinds say which error a world
raises: :data:`KILLED` (a backend error, as gloo and NCCL raise when a peer is gone), :data:`FAILED` (the
run is aborted by the failed rank), :data:`LEFT` (a mismatch: the program never posts the peer's side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dstest.worlds.core.faults import Fault, killed_phrase
from dstest.worlds.core.matching import FINISHED, Exchange, deadlock_text, everyone_waits

__all__ = ["FAILED", "KILLED", "LEFT", "RankStates"]

#: The kinds of :meth:`RankStates.how`: a call that needs a gone rank fails as a backend error (killed),
#: as an abort (the rank failed) or as a mismatch (it finished without posting the peer's side).
KILLED, FAILED, LEFT = "killed", "aborted", "mismatch"


class RankStates:
    """Which ranks of one run wait in a call, which left and how; the deadlock rule over them.

    ``waiting`` maps a waiting rank to what its world waits on (the threaded world's wait object, the
    process world's post id); ``left`` maps a rank that left to how the texts name that (:data:`FINISHED`,
    ``failed (...)``, or how a fault killed it); ``killed`` maps a rank a ``Kill`` ended to the fault.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.waiting: dict[int, Any] = {}
        self.left: dict[int, str] = {}
        self.failed: set[int] = set()
        self.killed: dict[int, Fault] = {}

    def reset(self) -> None:
        """Every rank running again (a new run); the containers are kept, so aliases of them stay valid."""
        self.waiting.clear()
        self.left.clear()
        self.failed.clear()
        self.killed.clear()

    def wait(self, rank: int, what: Any) -> None:
        self.waiting[rank] = what

    def stop_waiting(self, rank: int, what: Any = None) -> None:
        """Rank ``rank`` no longer waits (only if it waits in ``what``, when given)."""
        if what is None or self.waiting.get(rank) is what or self.waiting.get(rank) == what:
            self.waiting.pop(rank, None)

    def kill(self, rank: int, fault: Fault) -> None:
        """An injected ``Kill`` ended rank ``rank`` (it may still be unwinding): calls that need it fail as
        a backend error from now on."""
        self.killed[rank] = fault

    def leave(self, rank: int, ok: bool = True, summary: str = "") -> tuple[str, str]:
        """Rank ``rank`` left the run (``ok``: it returned; else it failed with ``summary``); returns
        :meth:`how` for the calls that still need it."""
        fault = self.killed.get(rank)
        self.left[rank] = killed_phrase(fault) if fault is not None else FINISHED if ok else f"failed ({summary})"
        if not ok:
            self.failed.add(rank)
        self.waiting.pop(rank, None)
        return self.how(rank)

    def how(self, rank: int) -> tuple[str, str]:
        """(kind, phrase) of a call that fails because ``rank`` is gone: killed, failed, or finished."""
        fault = self.killed.get(rank) if self.killed else None
        if fault is not None:
            return KILLED, killed_phrase(fault)
        return (FAILED if rank in self.failed else LEFT), self.left.get(rank, FINISHED)

    def gone_from(self, ex: Exchange) -> int | None:
        """The member of ``ex`` that left the run without joining it (a killed one first), or None."""
        gone = ex.left(self.killed) if self.killed else None
        return ex.left(self.left) if gone is None else gone

    def everyone_waits(self) -> bool:
        """Whether no rank is left running while some wait: nothing the waits need can arrive any more."""
        return everyone_waits(self.world_size, len(self.waiting), len(self.left))

    def deadlock_text(self, describe: Callable[[int, Any], tuple[str, Sequence[int]]]) -> str:
        """The deadlock report; ``describe(rank, what)`` says what a waiting rank waits in and which ranks
        that wait needs."""
        return deadlock_text({r: describe(r, w) for r, w in self.waiting.items()}, self.left)
