"""The parent side of the cross-rank check: the referee that matches every rank's calls of one run."""

from __future__ import annotations

import contextlib
import pickle
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, NamedTuple


class _Exchange:
    """Every rank's side of one collective of one group (matched by group and sequence number)."""

    __slots__ = ("calls", "error", "gid", "members", "posts", "seq", "where")

    def __init__(self, gid: str, members: tuple[int, ...], seq: int, where: str) -> None:
        self.gid = gid
        self.members = members
        self.seq = seq
        self.where = where
        self.calls: dict[int, Any] = {}  # global rank -> Call
        self.posts: dict[int, int] = {}  # global rank -> post id
        self.error: tuple[str, str] | None = None


class _Transfer(NamedTuple):
    rank: int  # global rank that posted it
    post_id: int
    meta: Any
    what: str


def _buffer(meta: Any, strict: bool) -> tuple[Any, ...]:
    """What a transfer's two sides must share: dtype and element count (gloo's check), or the shape too."""
    return (meta.dtype, tuple(meta.shape) if strict else meta.numel())


class _Referee:
    """Matches the calls every rank of one run posts, and answers each rank with "ok" or an error.

    Lives in the parent for one run, fed by :meth:`_Pool._exchange`; it sees every rank at once, so it
    also tells a rank that waits for a collective another rank will never join because that rank
    finished or failed, and reports a deadlock when every rank still running waits in a call that
    cannot complete.
    """

    def __init__(self, run_id: int, world_size: int, conns: list[Connection], strict_shapes: bool = False) -> None:
        self.run_id = run_id
        self.strict_shapes = strict_shapes  # shapes must be equal, not only element counts (SPEC E2)
        self.world_size = world_size
        self.conns = conns
        self.exchanges: dict[tuple[str, int], _Exchange] = {}
        self.transfers: dict[tuple[str, int, int, int], tuple[deque[_Transfer], deque[_Transfer]]] = {}
        # (rank, post id) -> (what, exchange or transfer key, the peer's global rank for a transfer)
        self.pending: dict[tuple[int, int], tuple[str, Any, int | None]] = {}
        self.blocked: dict[int, int] = {}  # rank -> post id it waits for
        self.done: dict[int, str] = {}  # rank -> "finished its function" | "failed (...)"
        self.failed: set[int] = set()

    # -- messages ---------------------------------------------------------------------------------------
    def handle(self, rank: int, blob: bytes) -> None:
        msg = pickle.loads(blob)
        if msg[1] != self.run_id:
            return
        kind = msg[0]
        if kind == "post":
            self._post(rank, msg[2], msg[3], msg[4], msg[5], msg[6])
        elif kind == "p2p":
            self._p2p(rank, *msg[2:])
        elif kind == "wait":
            if (rank, msg[2]) in self.pending:
                self.blocked[rank] = msg[2]
                self._detect_deadlock()
        elif kind == "done":
            self._done(rank, bool(msg[2]), str(msg[3]))

    def _send(self, rank: int, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(EOFError, OSError):
            self.conns[rank].send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _ok(self, rank: int, post_id: int) -> None:
        self.pending.pop((rank, post_id), None)
        if self.blocked.get(rank) == post_id:
            del self.blocked[rank]
        self._send(rank, ("ok", self.run_id, post_id))

    def _fail(self, rank: int, post_id: int, kind: str, message: str) -> None:
        self.pending.pop((rank, post_id), None)
        if self.blocked.get(rank) == post_id:
            del self.blocked[rank]
        self._send(rank, ("err", self.run_id, post_id, kind, message))

    def _fail_exchange(self, ex: _Exchange, kind: str, message: str, skip: int | None = None) -> None:
        """Fail every side of ``ex`` posted so far, and those posted later (``skip``: a rank that left)."""
        ex.error = (kind, message)
        for r, post_id in ex.posts.items():
            if r != skip and (r, post_id) in self.pending:
                self._fail(r, post_id, kind, message)

    def _gone(self, rank: int) -> tuple[str, str]:
        """(kind, phrase) for a rank that left the run: it finished normally or it failed."""
        return ("aborted" if rank in self.failed else "mismatch", self.done[rank])

    # -- collectives ----------------------------------------------------------------------------------------
    def _post(self, rank: int, post_id: int, gid: str, members: tuple[int, ...], seq: int, call: Any) -> None:
        from dstest.worlds import _collectives as C

        key = (gid, seq)
        ex = self.exchanges.get(key)
        if ex is None:
            label = "world" if gid == "0" and len(members) == self.world_size else f"{gid} {list(members)}"
            ex = self.exchanges[key] = _Exchange(gid, members, seq, f"group {label} (seq {seq})")
        call.strict_shapes = self.strict_shapes
        what = f"{call.describe()} on {ex.where}"
        self.pending[(rank, post_id)] = (what, key, None)
        ex.posts[rank] = post_id
        if ex.error is not None:
            self._fail(rank, post_id, *ex.error)
            return
        if members != ex.members:
            first = next(iter(ex.calls.items()), None)
            other = f"rank {first[0]} called {first[1].describe()} on group {gid} {list(ex.members)}" if first else ""
            self._fail_exchange(
                ex,
                "mismatch",
                f"collective mismatch on group {gid} (seq {seq}): rank {rank} called {call.describe()} on group "
                f"{gid} {list(members)} but {other} (the ranks created their groups differently)",
            )
            return
        if ex.calls:
            first_rank, first = next(iter(ex.calls.items()))
            why = call.check_peer(first)
            if why is not None:
                err = C.mismatch(f"collective mismatch on {ex.where}", first_rank, first, rank, call, why)
                self._fail_exchange(ex, "mismatch", str(err))
                return
        ex.calls[rank] = call
        gone = [r for r in members if r in self.done and r not in ex.calls]
        if gone:
            kind, phrase = self._gone(gone[0])
            self._fail_exchange(ex, kind, self._left_message(ex, gone[0], phrase))
            return
        if len(ex.calls) < len(members):
            return
        del self.exchanges[key]
        calls = sorted(ex.calls.values(), key=lambda c: c.group_rank)
        why = calls[0].check_all(calls)
        if why is not None:
            self._fail_exchange(
                ex,
                "mismatch",
                f"collective mismatch on {ex.where}: {why}; calls: "
                + "; ".join(f"rank {r} called {ex.calls[r].describe()}" for r in members),
            )
            return
        for r, p in ex.posts.items():
            self._ok(r, p)

    def _left_message(self, ex: _Exchange, gone: int, phrase: str) -> str:
        waiting = "; ".join(f"rank {r} called {c.describe()}" for r, c in sorted(ex.calls.items()))
        if gone in ex.calls:
            return (
                f"collective on {ex.where} cannot complete: rank {gone} {phrase} without waiting for its "
                f"{ex.calls[gone].describe()}, and ranks {[r for r in ex.members if r not in ex.calls]} "
                f"have not joined; {waiting}"
            )
        return f"collective on {ex.where} cannot complete: rank {gone} {phrase} without calling it; {waiting}"

    # -- point to point -------------------------------------------------------------------------------------
    def _p2p(
        self,
        rank: int,
        post_id: int,
        gid: str,
        members: tuple[int, ...],
        kind: str,
        me: int,
        peer: int,
        tag: int,
        meta: Any,
        what: str,
    ) -> None:
        src, dst = (me, peer) if kind == "send" else (peer, me)
        key = (gid, src, dst, tag)
        peer_rank = members[peer]
        self.pending[(rank, post_id)] = (what, key, peer_rank)
        sends, recvs = self.transfers.setdefault(key, (deque(), deque()))
        mine, theirs = (sends, recvs) if kind == "send" else (recvs, sends)
        entry = _Transfer(rank, post_id, meta, what)
        if not theirs:
            if peer_rank in self.done:
                k, phrase = self._gone(peer_rank)
                self._fail(
                    rank,
                    post_id,
                    k,
                    f"rank {rank} called {what}, but rank {peer_rank} {phrase} without a matching "
                    f"{'recv' if kind == 'send' else 'send'}",
                )
                return
            mine.append(entry)
            return
        other = theirs.popleft()
        send, recv = (entry, other) if kind == "send" else (other, entry)
        if _buffer(send.meta, self.strict_shapes) != _buffer(recv.meta, self.strict_shapes):
            message = (
                f"point-to-point mismatch on group {gid}: rank {send.rank} called {send.what} but rank "
                f"{recv.rank} called {recv.what}"
            )
            self._fail(send.rank, send.post_id, "mismatch", message)
            self._fail(recv.rank, recv.post_id, "mismatch", message)
            return
        self._ok(send.rank, send.post_id)
        self._ok(recv.rank, recv.post_id)

    # -- ranks leaving, deadlocks ---------------------------------------------------------------------------
    def _done(self, rank: int, ok: bool, summary: str) -> None:
        self.done[rank] = "finished its function" if ok else f"failed ({summary})"
        if not ok:
            self.failed.add(rank)
        self.blocked.pop(rank, None)
        kind, phrase = self._gone(rank)
        for ex in list(self.exchanges.values()):
            if rank in ex.members and ex.error is None:  # its own side stays unanswered: it reports that
                self._fail_exchange(ex, kind, self._left_message(ex, rank, phrase), skip=rank)
        for sends, recvs in self.transfers.values():
            for queue_ in (sends, recvs):
                for t in [t for t in queue_ if t.rank == rank]:
                    queue_.remove(t)  # left unmatched: the rank itself reports them
        for (r, post_id), (what, _key, peer) in list(self.pending.items()):
            if r != rank and peer == rank:
                self._fail(
                    r, post_id, kind, f"rank {r} called {what}, but rank {rank} {phrase} without a matching transfer"
                )
        self._send(rank, ("ack", self.run_id))
        self._detect_deadlock()

    def _needs(self, rank: int, post_id: int) -> list[int]:
        _what, key, peer = self.pending[(rank, post_id)]
        if peer is not None:
            return [peer]
        ex = self.exchanges.get(key)
        return [r for r in ex.members if r not in ex.calls] if ex is not None else []

    def _detect_deadlock(self) -> None:
        if not self.blocked or len(self.blocked) + len(self.done) < self.world_size:
            return  # some rank is still running and may yet post what the others wait for
        lines = []
        for r in sorted(self.blocked):
            what = self.pending[(r, self.blocked[r])][0]
            needs = ", ".join(
                f"rank {n} ("
                + (
                    self.done[n]
                    if n in self.done
                    else "waiting in " + self.pending[(n, self.blocked[n])][0]
                    if n in self.blocked
                    else "running"
                )
                + ")"
                for n in self._needs(r, self.blocked[r])
            )
            lines.append(f"  rank {r} waits in {what} for {needs}")
        message = (
            "deadlock: every rank still running waits for a collective that cannot complete "
            "(mismatched collectives, groups or peers):\n" + "\n".join(lines)
        )
        for r, post_id in list(self.blocked.items()):
            self._fail(r, post_id, "mismatch", message)
