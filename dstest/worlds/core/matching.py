"""The rules every world checks collectives by, and the texts of their errors, in one torch-free place.

The threaded world's rendezvous (ranks are threads, data is delivered in place) and the process world's
referee (ranks are processes that post metadata through pipes) host the ranks differently, but they
enforce one contract (contract E2), and a rule written twice drifts. So both drive these pieces and keep only
their transport (locks and wake-ups; pipes and verdict messages):

- :class:`Exchange`: every rank's side of one collective of one group, matched by (group, sequence
  number); the first call's key is what later calls must equal (``Call.key``), ``Call.check_peer`` says
  why they do not, and ``Call.check_all`` checks what needs every rank's call (all_to_all pairings);
- :class:`Transfers`: point-to-point posts waiting for their other side, first in first out per
  (group, source, destination, tag); :func:`same_buffer` is what the two sides must share;
- a rank that left the run (finished its function, or failed) while others wait on it:
  :meth:`Exchange.left_text` and :func:`p2p_left_text`;
- deadlock: :func:`everyone_waits` and :func:`deadlock_text`, when every rank still running waits and
  none of the waits can complete.

Torch-free on purpose: what is compared are plain tuples of a buffer's dtype, shape or element count and
device type (:func:`signature`), which a tensor and the process world's pickled metadata both provide, so
the process world's parent can referee without torch's collectives and the rules are testable alone.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

__all__ = [
    "FINISHED",
    "Exchange",
    "Transfers",
    "collective_where",
    "deadlock_text",
    "describe_tensor",
    "everyone_waits",
    "group_label",
    "members_mismatch_text",
    "mismatch_text",
    "p2p_describe",
    "p2p_left_text",
    "p2p_mismatch_text",
    "same_buffer",
    "signature",
]

#: How a rank that returned from its function is named in the texts (a failed rank: "failed (...)").
FINISHED = "finished its function"

#: A rank as ``Call.check_all`` names it (by group rank), to be named by its global rank.
_RANK = re.compile(r"\brank (\d+)\b")


# -- buffers -----------------------------------------------------------------------------------------------
def describe_tensor(t: Any) -> str:
    """``float32[2, 3]@cpu``: a tensor or its metadata (anything with ``dtype``, ``shape``, ``device``)."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device.type}"


def signature(t: Any, strict: bool = True) -> tuple[Any, ...]:
    """What two ranks' buffers must share: dtype, device type and the shape (``strict``) or only the
    element count (what gloo and NCCL compare: both move flat buffers)."""
    # ``is_cpu`` first: a tensor's ``device`` is a new object on every read, the costliest part of this
    # tuple (one per buffer per collective); metadata of the process world may have no ``is_cpu``.
    device = "cpu" if getattr(t, "is_cpu", False) else t.device.type
    return (t.dtype, tuple(t.shape) if strict else t.numel(), device)


def same_buffer(a: Any, b: Any, strict: bool) -> bool:
    """Whether the two sides of a transfer agree (:func:`signature`)."""
    return signature(a, strict) == signature(b, strict)


def group_label(name: str, global_ranks: Sequence[int], world_size: int) -> str:
    """``world`` for the default group, else the group's name and its global ranks (``1 [0, 2]``)."""
    if name == "0" and len(global_ranks) == world_size:
        return "world"
    return f"{name} {list(global_ranks)}"


# -- collectives -------------------------------------------------------------------------------------------
def collective_where(label: str, seq: int) -> str:
    """Where a collective runs, as every message names it: ``group world (seq 3)``."""
    return f"group {label} (seq {seq})"


def mismatch_text(where: str, a_rank: int, a: Any, b_rank: int, b: Any, why: str) -> str:
    """Two ranks' calls of one collective that cannot match (``why``: ``Call.check_peer``'s answer)."""
    return f"{where}: rank {a_rank} called {a.describe()} but rank {b_rank} called {b.describe()} ({why})"


class Exchange:
    """All ranks' sides of one collective on one group (matched by group and sequence number).

    ``calls`` are indexed by group rank; ``sides`` holds what the world needs to answer each rank (the
    threaded world's waits, the process world's post ids); ``error`` what the exchange failed with, which
    every side posted later gets too.
    """

    __slots__ = ("calls", "error", "first", "first_key", "global_ranks", "label", "missing", "seq", "sides")

    def __init__(self, global_ranks: Sequence[int], label: str, seq: int) -> None:
        self.global_ranks = global_ranks
        self.label = label
        self.seq = seq
        self.calls: list[Any] = [None] * len(global_ranks)
        self.missing = len(global_ranks)
        self.first: Any = None
        self.first_key: tuple[Any, ...] = ()
        self.error: Any = None
        self.sides: list[Any] = []

    @property
    def where(self) -> str:  # formatted only for messages, not on every collective
        return collective_where(self.label, self.seq)

    def join(self, call: Any, key: tuple[Any, ...] | None = None) -> str | None:
        """Add ``call`` (one rank's side); return why it cannot match the first call, leaving it out.

        ``key``: ``call.key()`` if the caller computed it already (the threaded world does, outside its
        lock). The first call's key is kept for the collective; the message is formed only on a mismatch.
        """
        mine = call.key() if key is None else key
        first = self.first
        if first is None:
            self.first, self.first_key = call, mine
        elif type(call) is not type(first) or mine != self.first_key:
            why = call.check_peer(first) or "different arguments"
            g = self.global_ranks
            return mismatch_text(
                f"collective mismatch on {self.where}", g[first.group_rank], first, g[call.group_rank], call, why
            )
        self.calls[call.group_rank] = call
        self.missing -= 1
        return None

    def verdict(self) -> str | None:
        """Once every rank joined: why the calls together cannot run (``Call.check_all``), or None.

        ``check_all`` sees the calls indexed by group rank and names ranks so ("rank 1 sends ... to rank
        0"); on a subgroup those are not the ranks a user knows, so they are named by their global ranks,
        as in every other message."""
        calls = self.calls
        why = calls[0].check_all(calls)
        if why is None:
            return None
        g = self.global_ranks
        why = _RANK.sub(lambda m: f"rank {g[int(m[1])]}", why)
        return f"collective mismatch on {self.where}: {why}; calls: " + "; ".join(
            f"rank {r} called {c.describe()}" for r, c in zip(g, calls)
        )

    def waiting_for(self) -> list[int]:
        """Global ranks that have not joined yet."""
        return [g for g, c in zip(self.global_ranks, self.calls) if c is None]

    def left(self, done: Mapping[int, Any] | set[int]) -> int | None:
        """The first member that left the run (in ``done``) without joining, or None."""
        for g, c in zip(self.global_ranks, self.calls):
            if c is None and g in done:
                return g
        return None

    def left_text(self, gone: int, phrase: str = FINISHED) -> str:
        """Why the collective can never complete: member ``gone`` left the run (``phrase``: how)."""
        posted = "; ".join(f"rank {g} called {c.describe()}" for g, c in zip(self.global_ranks, self.calls) if c)
        mine = self.calls[list(self.global_ranks).index(gone)]
        if mine is not None:  # posted but left before the collective ran (the process world issues then)
            return (
                f"collective on {self.where} cannot complete: rank {gone} {phrase} without waiting for its "
                f"{mine.describe()}, and ranks {self.waiting_for()} have not joined; {posted}"
            )
        what = self.first.describe() if self.first is not None else "a collective"
        return f"rank {gone} {phrase} without joining {what} on {self.where} ({posted}): it can never complete"


def members_mismatch_text(gid: str, seq: int, rank: int, call: Any, ranks: Sequence[int], ex: Exchange) -> str:
    """Two ranks posted sequence number ``seq`` of a group of one name with different members."""
    first = next((c for c in ex.calls if c is not None), None)
    other = (
        f"rank {ex.global_ranks[first.group_rank]} called {first.describe()} on group {gid} {list(ex.global_ranks)}"
        if first is not None
        else ""
    )
    return (
        f"collective mismatch on group {gid} (seq {seq}): rank {rank} called {call.describe()} on group "
        f"{gid} {list(ranks)} but {other} (the ranks created their groups differently)"
    )


# -- point to point ------------------------------------------------------------------------------------------
def p2p_describe(kind: str, buffer: Any, peer: int, tag: int, where: str) -> str:
    """``send(float32[4]@cpu to rank 1, tag=0) on group world``; ``peer`` is a global rank."""
    arrow = "to" if kind == "send" else "from"
    return f"{kind}({describe_tensor(buffer)} {arrow} rank {peer}, tag={tag}) on {where}"


def p2p_mismatch_text(where: str, send_rank: int, send_what: str, recv_rank: int, recv_what: str) -> str:
    return (
        f"point-to-point mismatch on {where}: rank {send_rank} called {send_what} but rank {recv_rank} "
        f"called {recv_what}"
    )


def p2p_left_text(rank: int, what: str, kind: str, peer: int, phrase: str = FINISHED) -> str:
    """Rank ``rank``'s transfer ``what`` (a ``kind``) can never complete: its peer left the run."""
    other = "recv" if kind == "send" else "send"
    return (
        f"rank {rank} called {what}, but rank {peer} {phrase} without a matching {other}: the transfer can "
        "never complete"
    )


class Transfers:
    """Point-to-point posts waiting for their other side, first in first out per (group, src, dst, tag)."""

    def __init__(self) -> None:
        self.queues: dict[Hashable, tuple[deque[Any], deque[Any]]] = {}

    def match(self, key: Hashable, kind: str, side: Any) -> Any:
        """The oldest waiting opposite side of ``key`` (taken out), or None after queueing ``side``."""
        pair = self.queues.get(key)
        if pair is None:  # two deques made only for a new key, not on every post
            pair = self.queues[key] = (deque(), deque())
        sends, recvs = pair
        mine, theirs = (sends, recvs) if kind == "send" else (recvs, sends)
        if not theirs:
            mine.append(side)
            return None
        return theirs.popleft()

    def drop(self, which: Callable[[Any], bool]) -> list[Any]:
        """Take out and return every waiting side for which ``which`` is true."""
        dropped: list[Any] = []
        for key, (sends, recvs) in list(self.queues.items()):
            for queue_ in (sends, recvs):
                for side in [s for s in queue_ if which(s)]:
                    queue_.remove(side)
                    dropped.append(side)
            if not sends and not recvs:
                del self.queues[key]
        return dropped

    def waiting(self) -> list[Any]:
        return [s for sends, recvs in self.queues.values() for s in (*sends, *recvs)]

    def __bool__(self) -> bool:
        return any(s or r for s, r in self.queues.values())


# -- deadlocks -------------------------------------------------------------------------------------------------
def everyone_waits(world_size: int, blocked: int, done: int) -> bool:
    """Whether no rank is left running (``blocked`` ranks wait, ``done`` left): then nothing can arrive."""
    return blocked > 0 and blocked + done >= world_size


def deadlock_text(blocked: Mapping[int, tuple[str, Sequence[int]]], done: Mapping[int, str]) -> str:
    """The deadlock report: ``blocked`` maps each waiting rank to (what it waits in, the ranks that wait
    needs); ``done`` each rank that left the run to how (:data:`FINISHED`, ``failed (...)``)."""
    lines = []
    for rank in sorted(blocked):
        what, needs = blocked[rank]
        states = ", ".join(
            f"rank {n} ("
            + (done[n] if n in done else "waiting in " + blocked[n][0] if n in blocked else "running")
            + ")"
            for n in needs
        )
        lines.append(f"  rank {rank} waits in {what} for {states}")
    return (
        "deadlock: every rank still running waits for a collective that cannot complete "
        "(mismatched collectives, groups or peers):\n" + "\n".join(lines)
    )
