"""The parent side of the cross-rank check: the referee that matches every rank's calls of one run.

The rules (matching by group and sequence number, ranks that left the run, deadlocks, the texts) are the
checking core's (:mod:`dstest.worlds.core.matching`, :mod:`dstest.worlds.core.rank_states`), which the
threaded world's rendezvous drives too; the
referee is their transport for processes: it reads the ranks' posts from pipes and answers each with a
verdict ("ok", or the error) that the rank's checked group waits for. A worker that an injected ``Kill``
ends (contract G5) says so ("killed") just before it kills itself, so the referee fails its peers' calls
at once with a backend error that names it, as it does for a rank that finished.

With the pool's check board (:mod:`dstest.worlds.process.board`), ranks whose digests match never post: the
referee gets a board call only when its digests differ or a rank waits long for it. It reads the board too,
and answers "ok" for a posted call the board matches, before it names a rank that left or a deadlock: a rank
that went on after the board matched its call is not waiting, whatever its last message said.
"""

from __future__ import annotations

import contextlib
import pickle
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from dstest.worlds.core import matching
from dstest.worlds.core.faults import RankFaults
from dstest.worlds.core.matching import Exchange
from dstest.worlds.core.rank_states import RankStates
from dstest.worlds.process import board as _board


class _Transfer(NamedTuple):
    rank: int  # global rank that posted it
    post_id: int
    meta: Any
    what: str


class Referee:
    """Matches the calls every rank of one run posts, and answers each rank with "ok" or an error.

    Lives in the parent for one run, fed by :class:`~dstest.worlds.process.gather.Gathering`; it sees every rank at once, so it
    also tells a rank that waits for a collective another rank will never join because that rank
    finished or failed, and reports a deadlock when every rank still running waits in a call that
    cannot complete.
    """

    def __init__(
        self,
        run_id: int,
        world_size: int,
        conns: list[Connection],
        strict_shapes: bool = False,
        board: _board.Board | None = None,
    ) -> None:
        self.run_id = run_id
        self.board = board  # the pool's check board, read for the calls posted from it
        # (rank, post id) -> (the group's name, its key on the board, members, seq)
        self.on_board: dict[tuple[int, int], tuple[str, str, tuple[int, ...], int]] = {}
        if board is not None:
            board.slots.clear()
        self.strict_shapes = strict_shapes  # shapes must be equal, not only element counts (contract E2)
        self.world_size = world_size
        self.conns = conns
        self.exchanges: dict[tuple[str, int], Exchange] = {}  # sides: (rank, post id)
        self.transfers = matching.Transfers()  # of _Transfer
        # (rank, post id) -> (what, exchange or transfer key, the peer's global rank and the kind of a transfer)
        self.pending: dict[tuple[int, int], tuple[str, Any, int | None, str]] = {}
        # Where each rank stands (the state machine both worlds follow): the post id a rank waits for, the
        # ranks that left the run and how, the ranks an injected Kill ended (contract G5).
        self.states = RankStates(world_size)
        self.blocked: dict[int, int] = self.states.waiting
        self.killed = self.states.killed
        self.tallies: dict[int, RankFaults] = {}  # the killed ranks' fault counters when they died

    # -- messages ---------------------------------------------------------------------------------------
    def handle(self, rank: int, blob: bytes) -> None:
        msg = pickle.loads(blob)
        if msg[1] != self.run_id:
            return
        kind = msg[0]
        if kind == "post":  # its last fields: an injected Fail's text, the group's key on the board (if on it)
            if len(msg) > 8 and msg[8]:
                self.on_board[(rank, msg[2])] = (msg[3], msg[8], msg[4], msg[5])
                if self._matched_on_board(msg[8], msg[4], msg[5]):
                    self._answer_matched(msg[3], msg[5], [(rank, msg[2])])
                    return
            self._post(rank, msg[2], msg[3], msg[4], msg[5], msg[6], msg[7] if len(msg) > 7 else None)
        elif kind == "p2p":
            self._p2p(rank, *msg[2:])
        elif kind == "withdraw":  # a call posted as slow that the rank then saw matched on the board
            side = (rank, msg[2])
            info = self.on_board.get(side)
            if info is not None and side in self.pending:
                self.pending.pop(side)
                self.on_board.pop(side)
                self.states.stop_waiting(rank, msg[2])
                self._answer_matched(info[0], info[3], [])  # the other sides posted of it matched too
        elif kind == "wait":
            if (rank, msg[2]) in self.pending:
                self.states.wait(rank, msg[2])
                self._detect_deadlock()
        elif kind == "done":  # its last field: whether the rank waits for an acknowledgement (without it: yes)
            self._done(rank, bool(msg[2]), str(msg[3]), ack=bool(msg[4]) if len(msg) > 4 else True)
        elif kind == "killed":  # an injected Kill: the worker kills itself right after this message
            self.states.kill(rank, msg[2])
            if len(msg) > 3 and msg[3] is not None:
                self.tallies[rank] = msg[3]
            self._done(rank, False, "", ack=False)  # it is dead by now

    def _send(self, rank: int, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(EOFError, OSError):
            self.conns[rank].send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _answer(self, rank: int, post_id: int, *answer: str) -> None:
        """Answer rank ``rank``'s post ``post_id`` ("ok", or "err" with the error's kind and message)."""
        self.pending.pop((rank, post_id), None)
        self.on_board.pop((rank, post_id), None)
        self.states.stop_waiting(rank, post_id)
        verdict, *error = answer
        self._send(rank, (verdict, self.run_id, post_id, *error))

    def _ok(self, rank: int, post_id: int) -> None:
        self._answer(rank, post_id, "ok")

    def _fail(self, rank: int, post_id: int, kind: str, message: str) -> None:
        self._answer(rank, post_id, "err", kind, message)

    def _fail_exchange(self, ex: Exchange, kind: str, message: str, skip: int | None = None) -> None:
        """Fail every side of ``ex`` posted so far, and those posted later (``skip``: a rank that left)."""
        ex.error = (kind, message)
        for r, post_id in ex.sides:
            if r != skip and (r, post_id) in self.pending:
                self._fail(r, post_id, kind, message)

    # -- collectives ----------------------------------------------------------------------------------------
    def _post(
        self, rank: int, post_id: int, gid: str, members: tuple[int, ...], seq: int, call: Any, fail: str | None
    ) -> None:
        key = (gid, seq)
        ex = self.exchanges.get(key)
        if ex is None:
            ex = self.exchanges[key] = Exchange(members, matching.group_label(gid, members, self.world_size), seq)
        call.strict_shapes = self.strict_shapes
        self.pending[(rank, post_id)] = (f"{call.describe()} on {ex.where}", key, None, "")
        ex.sides.append((rank, post_id))
        if fail is not None and ex.error is None:  # an injected Fail: every rank that joins it gets the error
            self._fail_exchange(ex, "injected", fail)
            return
        if ex.error is not None:
            self._fail(rank, post_id, *ex.error)
            return
        if members != ex.global_ranks:
            self._fail_exchange(ex, "mismatch", matching.members_mismatch_text(gid, seq, rank, call, members, ex))
            return
        why = ex.join(call)
        if why is not None:
            self._fail_exchange(ex, "mismatch", why)
            return
        gone = self.states.gone_from(ex)  # a killed peer first: it is the cause
        if gone is not None:
            kind, phrase = self.states.how(gone)
            self._fail_exchange(ex, kind, ex.left_text(gone, phrase))
            return
        if ex.missing:
            return
        del self.exchanges[key]
        why = ex.verdict()
        if why is not None:
            self._fail_exchange(ex, "mismatch", why)
            return
        for r, p in ex.sides:
            self._ok(r, p)

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
        self.pending[(rank, post_id)] = (what, key, peer_rank, kind)
        entry = _Transfer(rank, post_id, meta, what)
        other = self.transfers.match(key, kind, entry)
        if other is None:
            if peer_rank in self.states.left:
                self.transfers.drop(lambda t: t is entry)
                k, phrase = self.states.how(peer_rank)
                self._fail(rank, post_id, k, matching.p2p_left_text(rank, what, kind, peer_rank, phrase))
            return
        send, recv = (entry, other) if kind == "send" else (other, entry)
        if not matching.same_buffer(send.meta, recv.meta, self.strict_shapes):
            where = f"group {matching.group_label(gid, members, self.world_size)}"
            message = matching.p2p_mismatch_text(where, send.rank, send.what, recv.rank, recv.what)
            self._fail(send.rank, send.post_id, "mismatch", message)
            self._fail(recv.rank, recv.post_id, "mismatch", message)
            return
        self._ok(send.rank, send.post_id)
        self._ok(recv.rank, recv.post_id)

    # -- the check board ------------------------------------------------------------------------------------
    def _matched_on_board(self, key: str, members: tuple[int, ...], seq: int) -> bool:
        board = self.board
        if board is None:
            return False
        with board.locked():
            return board.status(self.run_id, key, members, seq) == _board.MATCH

    def _answer_matched(self, gid: str, seq: int, sides: list[tuple[int, int]]) -> None:
        """Call ``seq`` of ``gid`` matched on the board: "ok" to every side posted of it (each rank issues it
        in its group's order), and its exchange is closed."""
        ex = self.exchanges.pop((gid, seq), None)
        for side in {*sides, *(ex.sides if ex is not None else ())}:
            if side in self.pending or side in sides:
                self._ok(*side)

    def _resolve_board(self) -> None:
        """Answer the posted calls the board has matched since they were posted (before anything that reads
        which ranks still wait: a rank whose call matched went on)."""
        board = self.board
        if board is None or not self.on_board:
            return
        matched: dict[tuple[str, int], list[tuple[int, int]]] = {}
        with board.locked():
            for side, (gid, key, members, seq) in self.on_board.items():
                if board.status(self.run_id, key, members, seq) == _board.MATCH:
                    matched.setdefault((gid, seq), []).append(side)
        for (gid, seq), sides in matched.items():
            self._answer_matched(gid, seq, sides)

    # -- ranks leaving, deadlocks ---------------------------------------------------------------------------
    def _done(self, rank: int, ok: bool, summary: str, ack: bool) -> None:
        self._resolve_board()
        kind, phrase = self.states.leave(rank, ok, summary)
        for ex in list(self.exchanges.values()):
            if rank in ex.global_ranks and ex.error is None:  # its own side stays unanswered: it reports that
                self._fail_exchange(ex, kind, ex.left_text(rank, phrase), skip=rank)
        self.transfers.drop(lambda t: t.rank == rank)  # left unmatched: the rank itself reports them
        for (r, post_id), (what, _key, peer, p2p_kind) in list(self.pending.items()):
            if r != rank and peer == rank:
                self._fail(r, post_id, kind, matching.p2p_left_text(r, what, p2p_kind, rank, phrase))
        if ack:
            self._send(rank, ("ack", self.run_id))
        self._detect_deadlock()

    def _needs(self, rank: int, post_id: int) -> list[int]:
        _what, key, peer, _kind = self.pending[(rank, post_id)]
        if peer is not None:
            return [peer]
        ex = self.exchanges.get(key)
        return ex.waiting_for() if ex is not None else []

    def _detect_deadlock(self) -> None:
        if not self.states.everyone_waits():
            return  # some rank is still running and may yet post what the others wait for
        self._resolve_board()
        if not self.states.everyone_waits():
            return
        message = self.states.deadlock_text(lambda r, p: (self.pending[(r, p)][0], self._needs(r, p)))
        for r, post_id in list(self.blocked.items()):
            self._fail(r, post_id, "mismatch", message)
