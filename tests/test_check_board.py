"""The process world's check board (issue 44 item 4): ranks whose digests match go on without the parent.

Contracts: E10 (the process world is as strict as the threaded one: the board never lets gloo run calls the
referee would refuse, and every report keeps the referee's text) and E2 (a mismatch raises on every rank,
naming both calls, instead of hanging); the process-world runs compare values with the threaded world (E1).

The board itself (:mod:`dstest.worlds.process.board`) is a checker: a digest that two different calls share,
or a status of MATCH for entries that differ or are missing, would let gloo run mismatched calls (a hang or
an abort instead of a report). So its rules are tested adversarially here, every perturbation of a call or of
an entry must change the answer, and then in the process world: correct programs decided on the board with
no post to the referee, async calls started by the watcher, a rank far ahead of its peer, and wrong programs
still reported with the referee's texts.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dstest
from dstest.errors import RankFailure
from dstest.worlds import collectives as C
from dstest.worlds.process import board as B
from dstest.worlds.process.messages import Dev, Meta

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not B.available(), reason="no check board on this machine (Linux futexes)"),
]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
_OPS = ["sum", "avg", "max", "min", "product"]


def _board(tmp_path: Any, world_size: int) -> B.Board:
    path = str(tmp_path / f"board-{world_size}-{time.monotonic_ns()}")
    B.create(path, world_size)
    return B.Board(path, world_size)


def _all_reduce(rank: int, size: int, dtype: Any, shape: tuple[int, ...], op: str) -> Any:
    return C.AllReduce(rank, size, Meta(dtype, shape, Dev("cpu")), op)


# -- digests ---------------------------------------------------------------------------------------------
_CALL = st.fixed_dictionaries(
    {
        "run": st.integers(1, 5),
        "gid": st.sampled_from(["0", "1", "tp", "dp-3"]),
        "members": st.sampled_from([(0, 1), (0, 1, 2, 3), (1, 3), (2, 0)]),
        "seq": st.integers(1, 400),
        "dtype": st.sampled_from(_DTYPES),
        "shape": st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
        "op": st.sampled_from(_OPS),
    }
)


def _digest(c: dict[str, Any], rank: int = 0, strict: bool = False) -> bytes:
    call = _all_reduce(rank, len(c["members"]), c["dtype"], c["shape"], c["op"])
    call.strict_shapes = strict
    return B.call_digest(c["run"], c["gid"], c["members"], c["seq"], call)


@settings(max_examples=300, deadline=None)
@given(_CALL, _CALL)
def test_two_calls_share_a_digest_exactly_when_the_referee_finds_them_equal(a, b):
    same = (a["run"], a["gid"], a["members"], a["seq"], a["op"], a["dtype"]) == (
        b["run"],
        b["gid"],
        b["members"],
        b["seq"],
        b["op"],
        b["dtype"],
    ) and _numel(a["shape"]) == _numel(b["shape"])
    assert (_digest(a, rank=0) == _digest(b, rank=1)) == same  # the rank is not part of it


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@settings(max_examples=200, deadline=None)
@given(_CALL, st.data())
def test_every_field_of_a_call_moves_its_digest(c, data):
    field = data.draw(st.sampled_from(["run", "gid", "members", "seq", "dtype", "op", "numel"]))
    other = dict(c)
    if field == "run":
        other["run"] = c["run"] + data.draw(st.integers(1, 3))
    elif field == "gid":
        other["gid"] = c["gid"] + "x"
    elif field == "members":
        other["members"] = (*c["members"], 7)
    elif field == "seq":
        other["seq"] = c["seq"] + data.draw(st.sampled_from([-1, 1, B.RING]))
    elif field == "dtype":
        other["dtype"] = data.draw(st.sampled_from([d for d in _DTYPES if d != c["dtype"]]))
    elif field == "op":
        other["op"] = data.draw(st.sampled_from([o for o in _OPS if o != c["op"]]))
    else:
        other["shape"] = (*c["shape"], 2) if _numel(c["shape"]) else (1,)
    assert _digest(c) != _digest(other)


def test_shapes_count_in_a_digest_only_under_strict_shapes():
    a, b = dict(run=1, gid="0", members=(0, 1), seq=1, dtype=torch.float32, op="sum"), {}
    b = dict(a)
    a["shape"], b["shape"] = (2, 3), (6,)
    assert _digest(a) == _digest(b)
    assert _digest(a, strict=True) != _digest(b, strict=True)


def test_a_premul_sum_factor_is_not_part_of_the_digest():
    """NCCL matches premul_sum whatever each rank's factor, and so does the referee."""
    one = C.AllReduce(0, 2, Meta(torch.float32, (4,), Dev("cpu")), C.PremulSum(0.5))
    two = C.AllReduce(1, 2, Meta(torch.float32, (4,), Dev("cpu")), C.PremulSum(2.0))
    assert B.call_digest(1, "0", (0, 1), 1, one) == B.call_digest(1, "0", (0, 1), 1, two)


def test_marks_equal_no_digest_and_no_other_rank_s_mark():
    call = _all_reduce(0, 2, torch.float32, (4,), "sum")
    marks = {B.mark(1, r, 1, why) for r in range(4) for why in ("refereed", "left")}
    assert len(marks) == 8
    assert B.call_digest(1, "0", (0, 1), 1, call) not in marks


# -- entries and statuses ----------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    members=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    seq=st.integers(1, 3 * B.RING),
    perturb=st.sampled_from(["none", "bit", "missing", "other_seq", "other_run", "other_group", "mark"]),
    data=st.data(),
)
def test_status_is_match_only_when_every_member_wrote_the_same_digest(tmp_path_factory, members, seq, perturb, data):
    board = _board(tmp_path_factory.mktemp("b"), 4)
    run, gid = 3, "g"
    digest = bytes(range(16))
    victim = data.draw(st.sampled_from(members))
    with board.locked():
        for m in members:  # a write RING calls past a peer's last decided call is refused: all level here
            board._slot(m, run, B.gid_hash(gid), claim=True)
            board.set_decided(m, run, gid, max(0, seq - B.RING))
        for m in sorted(members, key=lambda m: m == victim):  # the victim last: its slot may move to another run
            d, r, s, g = digest, run, seq, gid
            if m == victim and perturb == "bit":
                bit = data.draw(st.integers(0, 127))
                d = bytes(b ^ (1 << (bit % 8)) if i == bit // 8 else b for i, b in enumerate(digest))
            elif m == victim and perturb == "missing":
                continue
            elif m == victim and perturb == "other_seq":
                s = seq + data.draw(st.sampled_from([1, B.RING]))
            elif m == victim and perturb == "other_run":
                r = run + 1
            elif m == victim and perturb == "other_group":
                g = "h"
            elif m == victim and perturb == "mark":
                d = B.mark(run, m, seq, "left")
            if (r, g, s) != (run, gid, seq):  # the victim's entry lands elsewhere (or nowhere, where refused)
                board.write(m, r, g, members, s, d)
                continue
            board.set_decided(m, run, gid, max(0, s - B.RING))
            assert board.write(m, r, g, members, s, d)
        status = board.status(run, gid, members, seq)
    if perturb == "none":
        assert status == B.MATCH
    elif perturb in ("bit", "mark"):
        assert status == (B.DIFFER if len(members) > 1 else B.MATCH)
    else:  # the victim's entry for this call is not there
        assert status == B.PENDING


def test_a_mark_over_a_written_digest_turns_a_match_into_a_difference(tmp_path):
    board = _board(tmp_path, 2)
    with board.locked():
        for r in (0, 1):
            assert board.write(r, 1, "0", (0, 1), 1, b"d" * 16)
        assert board.status(1, "0", (0, 1), 1) == B.MATCH
        board.overwrite(1, 1, "0", 1, B.mark(1, 1, 1, "left"))
        assert board.status(1, "0", (0, 1), 1) == B.DIFFER
        board.overwrite(1, 1, "0", 2, b"d" * 16)  # no entry for seq 2: nothing written
        assert board.status(1, "0", (0, 1), 2) == B.PENDING


def test_a_rank_cannot_write_over_an_entry_a_peer_still_needs(tmp_path):
    board = _board(tmp_path, 2)
    with board.locked():
        for seq in range(1, B.RING + 1):
            assert board.write(0, 1, "0", (0, 1), seq, b"a" * 16)
        # rank 1 never decided seq 1: rank 0's entry RING calls later would overwrite it
        board.set_decided(0, 1, "0", B.RING)
        board.set_decided(1, 1, "0", 5)  # rank 1 has not used the group: nothing to mark, nothing claimed
        assert board._slot(1, 1, B.gid_hash("0"), claim=False) is None
        assert not board.write(0, 1, "0", (0, 1), B.RING + 1, b"a" * 16)
        assert board.write(1, 1, "0", (0, 1), 1, b"a" * 16)
        assert not board.write(0, 1, "0", (0, 1), B.RING + 1, b"a" * 16)  # rank 1 still needs seq 1
        board.set_decided(1, 1, "0", 1)
        assert board.write(0, 1, "0", (0, 1), B.RING + 1, b"a" * 16)
        assert board.status(1, "0", (0, 1), 1) == B.PENDING  # seq 1's entry of rank 0 is gone, as allowed


def test_groups_past_the_table_are_refused_and_a_new_run_starts_empty(tmp_path):
    board = _board(tmp_path, 1)
    with board.locked():
        for g in range(B.GROUPS):
            assert board.write(0, 1, f"g{g}", (0,), 1, b"x" * 16)
        assert not board.write(0, 1, "one-too-many", (0,), 1, b"x" * 16)
        assert board.status(1, "g5", (0,), 1) == B.MATCH
        board.slots.clear()
        assert board.status(2, "g5", (0,), 1) == B.PENDING  # the next run sees none of it
        assert board.write(0, 2, "one-too-many", (0,), 1, b"x" * 16)


def test_a_write_in_another_process_view_is_seen_and_wakes_a_sleeper(tmp_path):
    """Two views of one file (two processes' maps): a sleeper on rank 1's word wakes at the bump, long
    before its timeout, and sees the entry."""
    path = str(tmp_path / "board")
    B.create(path, 2)
    mine, theirs = B.Board(path, 2), B.Board(path, 2)
    with mine.locked():
        mine.set_waiting(1, True)  # a thread of rank 1 waits: the bump goes to its word, not its watcher's
        seen = mine.word(1)
        assert mine.status(1, "0", (0, 1), 1) == B.PENDING

    def writer() -> None:
        time.sleep(0.2)
        with theirs.locked():
            theirs.write(0, 1, "0", (0, 1), 1, b"q" * 16)
            theirs.write(1, 1, "0", (0, 1), 1, b"q" * 16)
            woken = theirs.bump([1])
        theirs.wake(woken)

    t = threading.Thread(target=writer)
    start = time.monotonic()
    t.start()
    mine.sleep(1, seen, 20.0)
    assert time.monotonic() - start < 10.0
    t.join()
    with mine.locked():
        assert mine.status(1, "0", (0, 1), 1) == B.MATCH
    mine.close()
    theirs.close()


def test_the_entries_of_every_rank_group_and_sequence_number_are_apart(tmp_path):
    """Every slot of every rank's table and every place of its rings in use at once: nothing lands on
    another's place (each call is still a match of all ranks)."""
    board = _board(tmp_path, 3)
    seqs = range(1, B.RING + 1)
    with board.locked():
        for g in range(B.GROUPS):
            for seq in seqs:
                digest = B.mark(1, g, seq, "apart")  # one digest per (group, seq), written by every rank
                for r in range(3):
                    assert board.write(r, 1, f"g{g}", (0, 1, 2), seq, digest)
        words = [(board.word(r), board.word(r, watcher=True)) for r in range(3)]
        assert words == [(0, 0)] * 3  # no entry landed on a wake word
        for g in range(B.GROUPS):
            for seq in seqs:
                assert board.status(1, f"g{g}", (0, 1, 2), seq) == B.MATCH, (g, seq)


def test_two_differing_digests_differ_even_while_a_member_has_not_written(tmp_path):
    """A rank sees the mismatch as soon as two members differ (the referee gets it at once), whichever member
    is missing."""
    for missing in range(3):
        for elsewhere in (False, True):  # the missing member has not used the group, or wrote another call of it
            board = _board(tmp_path, 3)
            present = [r for r in range(3) if r != missing]
            with board.locked():
                if elsewhere:
                    board.write(missing, 1, "0", (0, 1, 2), 2, b"c" * 16)
                for r, digest in zip(present, (b"a" * 16, b"b" * 16)):
                    board.write(r, 1, "0", (0, 1, 2), 1, digest)
                assert board.status(1, "0", (0, 1, 2), 1) == B.DIFFER


def test_a_bump_moves_the_waiting_thread_s_word_or_else_the_watcher_s_and_only_that_rank_s(tmp_path):
    board = _board(tmp_path, 3)
    with board.locked():
        words = {(r, w): board.word(r, watcher=w) for r in range(3) for w in (False, True)}
        board.set_waiting(1, False)
        assert board.bump([1]) != []
        assert board.word(1, watcher=True) == words[(1, True)] + 1 and board.word(1) == words[(1, False)]
        board.set_waiting(1, True)
        board.bump([1])
        assert board.word(1) == words[(1, False)] + 1 and board.word(1, watcher=True) == words[(1, True)] + 1
        for r in (0, 2):  # the other ranks' words did not move
            assert (board.word(r), board.word(r, watcher=True)) == (words[(r, False)], words[(r, True)])
    fd = board.fd
    board.close()
    with pytest.raises(OSError):
        os.fstat(fd)


# -- the process world ---------------------------------------------------------------------------------------
def _posts_of(body: Any, ctx: Any) -> tuple[Any, int]:
    """Run ``body`` on this rank counting the posts its checker sends the referee, with the quiet wait
    raised so that a slow machine does not post a call the board would match."""
    from dstest.worlds.process import checked

    ck = checked._CHECKER
    assert ck is not None and ck.board_on
    sent: list[str] = []
    send, quiet = ck._send, ck.quiet_wait_s
    ck._send = lambda msg: (sent.append(msg[0]), send(msg))[1]  # type: ignore[method-assign]
    ck.quiet_wait_s = 5.0
    try:
        return body(ctx), sent.count("post")
    finally:
        ck._send = send  # type: ignore[method-assign]
        ck.quiet_wait_s = quiet


def _correct_body(ctx: Any) -> list[float]:
    out = []
    t = torch.full((3,), float(ctx.rank + 1))
    sub = dist.new_group([0, 1])
    for step in range(3):
        dist.all_reduce(t)
        b = torch.full((2,), float(ctx.rank + step))
        dist.broadcast(b, src=step % ctx.world_size)
        g = torch.empty(2 * ctx.world_size)
        dist.all_gather_into_tensor(g, torch.full((2,), float(ctx.rank)))
        if ctx.rank in (0, 1):
            dist.all_reduce(b, group=sub)
        out += [t.sum().item(), b.sum().item(), g.sum().item()]
    return out


def _board_world(ctx: Any) -> tuple[Any, int]:
    return _posts_of(_correct_body, ctx)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_correct_program_is_decided_on_the_board_with_no_post_to_the_referee(world_size):
    """E1, E10: the same values as the threaded world (the reference), and not one post: every call matched on the
    board. With the board's status forced to "differ", every call is posted (so the count can fail)."""
    reference = dstest.run(_correct_body, world_size, world="threaded")
    results = dstest.run(_board_world, world_size, world="process")
    assert [r[0] for r in results] == reference
    assert [r[1] for r in results] == [0] * world_size


def _all_refereed(ctx: Any) -> tuple[Any, int]:
    from dstest.worlds.process import board

    status = board.Board.status
    board.Board.status = lambda self, *a: board.DIFFER if status(self, *a) == board.MATCH else status(self, *a)  # type: ignore[method-assign]
    try:
        return _posts_of(_correct_body, ctx)
    finally:
        board.Board.status = status  # type: ignore[method-assign]


def test_a_board_that_matched_nothing_sends_every_call_to_the_referee_with_the_same_values():
    reference = dstest.run(_correct_body, 2, world="threaded")
    results = dstest.run(_all_refereed, 2, world="process")
    assert [r[0] for r in results] == reference
    assert all(r[1] >= 12 for r in results)  # 4 calls a step on rank 0 and 1, 3 steps


def _async_then_store(ctx: Any) -> float:
    """Rank 0 posts an async all_reduce and then blocks outside dstest until rank 1's synchronous one
    completed: only rank 0's watcher can start rank 0's side (gloo starts an async call when it is issued)."""
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 0:
        work = dist.all_reduce(t, async_op=True)
        store.wait([f"board-done-{ctx.seed}"])
        work.wait()
    else:
        time.sleep(0.05)  # rank 0's call is open on the board (its watcher asleep) when this one arrives
        dist.all_reduce(t)
        store.set(f"board-done-{ctx.seed}", "1")
    return t[0].item()


def test_an_async_call_nobody_waits_for_yet_is_started_by_the_watcher():
    assert dstest.run(_async_then_store, 2, world="process", timeout=60) == [3.0, 3.0]


def _far_ahead(ctx: Any, n: int) -> float:
    """Rank 1 posts ``n`` async all_reduces at once, more than the board's ring holds, before rank 0 starts."""
    t = [torch.full((1,), float(i)) for i in range(n)]
    if ctx.rank == 1:
        works = [dist.all_reduce(x, async_op=True) for x in t]
        for w in works:
            w.wait()
    else:
        time.sleep(0.2)
        for x in t:
            dist.all_reduce(x)
    return sum(x.item() for x in t)


def test_a_rank_more_calls_ahead_than_the_ring_holds_gets_the_right_values():
    n = B.RING + 40
    assert dstest.run(_far_ahead, 2, world="process", args=(n,), timeout=120) == [float(n * (n - 1))] * 2


def _one_rank_differs(ctx: Any) -> None:
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4, dtype=torch.float64 if ctx.rank == ctx.world_size - 1 else torch.float32))


def test_a_mismatch_after_matched_calls_is_the_referee_s_report():
    """E2, E10: a mismatch after calls the board matched is reported on every rank, naming both dtypes."""
    with pytest.raises(RankFailure) as info:
        dstest.run(_one_rank_differs, 4, world="process")
    text = str(info.value)
    assert "collective mismatch on group world (seq 2)" in text
    assert "float64" in text and "float32" in text
    assert "4 of 4 ranks failed" in text


def _left_with_an_open_call(ctx: Any) -> None:
    dist.all_reduce(torch.ones(2))
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2), async_op=True)  # posted on the board, then the function returns
        return
    time.sleep(0.3)
    dist.all_reduce(torch.ones(2))  # arrives after rank 0 gave its entry up


def test_a_rank_that_left_gives_its_open_call_up_and_its_peer_is_told_so():
    with pytest.raises(RankFailure) as info:
        dstest.run(_left_with_an_open_call, 2, world="process", timeout=60)
    text = str(info.value)
    assert "rank 0 finished its function without waiting for its all_reduce(float32[2]@cpu, op=sum)" in text
    assert "was not matched by the other ranks it needs before the function returned" in text


def _slow_then_matched(ctx: Any) -> float:
    """Rank 1 waits for its first call past the quiet wait (posted to the referee), which then matches on the
    board; more than a ring of calls later, rank 0 waits past the quiet wait while rank 1 is busy."""
    t = torch.zeros(1)
    if ctx.rank == 0:
        time.sleep(0.1)
    dist.all_reduce(t)
    for _ in range(B.RING + 5):  # the first call's entries are written over
        dist.all_reduce(t)
    if ctx.rank == 1:
        time.sleep(0.2)
    dist.all_reduce(torch.ones(1))
    return t.item()


def test_a_call_posted_as_slow_and_matched_on_the_board_is_withdrawn_from_the_referee():
    """E10 (no false report on a correct program). Without the withdrawal the referee still counted rank 1 as waiting in its first call, and named a
    deadlock when rank 0 waited for rank 1's last (a false report on a correct program, found by
    bench_checking)."""
    assert dstest.run(_slow_then_matched, 2, world="process", timeout=60) == [0.0, 0.0]


# -- random programs on the board: the threaded world's values, or the referee's report --------------------
_OPS_DRAWN = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"]
_STEP = st.tuples(
    st.sampled_from(_OPS_DRAWN),
    st.sampled_from(["world", "low", "high"]),  # the world, ranks [0, 1], ranks [1 .. W-1]
    st.integers(1, 3),  # elements per rank
    st.booleans(),  # async_op, waited at the end of the program
    st.lists(st.sampled_from([0.0, 0.0, 0.002, 0.008]), min_size=4, max_size=4),  # each rank's pause first
)


def _program(ctx: Any, steps: list[Any], perturb: tuple[int, int] | None) -> list[float]:
    w, me = ctx.world_size, ctx.rank
    groups = {"world": None, "low": dist.new_group([0, 1]), "high": dist.new_group(list(range(1, w)))}
    members = {"world": range(w), "low": [0, 1], "high": range(1, w)}
    out: list[float] = []
    pending: list[tuple[Any, torch.Tensor]] = []
    for i, (op, name, n, async_, pauses) in enumerate(steps):
        if me not in members[name]:
            continue
        group, size = groups[name], len(members[name])
        if pauses[me]:
            time.sleep(pauses[me])
        if perturb == (i, me):
            n += 1  # this rank's call differs from its peers'
        x = torch.arange(n, dtype=torch.float32) + me
        if op == "all_reduce":
            work, result = dist.all_reduce(x, group=group, async_op=async_), x
        elif op == "broadcast":
            root = dist.get_global_rank(group, 0) if group is not None else 0
            work, result = dist.broadcast(x, src=root, group=group, async_op=async_), x
        elif op == "all_gather_into_tensor":
            result = torch.empty(n * size)
            work = dist.all_gather_into_tensor(result, x, group=group, async_op=async_)
        elif op == "reduce_scatter_tensor":
            result = torch.empty(n)
            work = dist.reduce_scatter_tensor(result, x.repeat(size), group=group, async_op=async_)
        else:
            work, result = dist.barrier(group=group, async_op=async_), torch.zeros(1)
        if async_:
            pending.append((work, result))
        else:
            out.append(result.sum().item())
    for work, result in pending:
        work.wait()
        out.append(result.sum().item())
    return out


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 4), st.lists(_STEP, min_size=1, max_size=8))
def test_random_programs_on_the_board_give_the_threaded_world_s_values(world_size, steps):
    reference = dstest.run(_program, world_size, world="threaded", args=(steps, None))
    assert dstest.run(_program, world_size, world="process", args=(steps, None), timeout=60) == reference


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 4), st.lists(_STEP, min_size=1, max_size=6), st.data())
def test_one_rank_s_differing_call_in_a_random_program_is_the_referee_s_mismatch(world_size, steps, data):
    i = data.draw(st.integers(0, len(steps) - 1))
    op, name, *_ = steps[i]
    if op == "barrier":
        steps[i] = ("all_reduce", *steps[i][1:])
    members = {"world": range(world_size), "low": [0, 1], "high": range(1, world_size)}[name]
    assume(len(members) > 1)  # a group of one has no peer to differ from
    rank = data.draw(st.sampled_from(list(members)))
    with pytest.raises(RankFailure) as info:
        dstest.run(_program, world_size, world="process", args=(steps, (i, rank)), timeout=60)
    text = str(info.value)
    assert "collective mismatch on group" in text and f"rank {rank} called" in text


def _uneven_all_to_all_alone(ctx: Any) -> None:
    """Each rank on a group of its own: an all_to_all_single whose one pairing sends 2 rows and expects 3."""
    mine = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]
    out = torch.empty(3)
    dist.all_to_all_single(out, torch.ones(2), output_split_sizes=[3], input_split_sizes=[2], group=mine)


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_a_one_rank_all_to_all_is_still_judged_by_the_referee(world):
    """E2, E10. A group of one has only its own digest on the board, which trivially "matches": a call whose ranks may
    differ must still go to the referee, whose pairing check refuses this one (as the threaded world does)."""
    with pytest.raises(RankFailure) as info:
        dstest.run(_uneven_all_to_all_alone, 2, world=world, timeout=60)
    assert "sends 2 rows to rank" in str(info.value)


def _rank_zero_with_a_board(tmp_path: Any) -> tuple[Any, B.Board, Any]:
    """Rank 0's checker of a 2-rank pool with a board, in run 1 (no referee: its pipe's other end is returned),
    and rank 1's view of the board, to write its entries by hand."""
    import multiprocessing

    from dstest.worlds.process.checker import Checker

    path = str(tmp_path / "board")
    B.create(path, 2)
    parent, child = multiprocessing.Pipe(duplex=True)
    ck = Checker(child, rank=0, world_size=2)
    ck.attach_board(path)
    ck.begin(1)
    return ck, B.Board(path, 2), parent


def test_calls_of_one_group_reach_gloo_in_sequence_order_whichever_thread_posted_first(tmp_path):
    """Two threads of a rank posting on one group can take their sequence numbers in one order and reach the
    board in the other; gloo must still get them in sequence order, as every peer issues them."""
    ck, peer, parent = _rank_zero_with_a_board(tmp_path)
    assert ck.board is not None
    issued: list[int] = []
    calls = {s: _all_reduce(0, 2, torch.float32, (4,), "sum") for s in (1, 2)}
    for seq in (2, 1):  # seq 2 reaches the board first
        msg = ("post", "0", (0, 1), seq, calls[seq])
        ck.board.post(msg, "0#0", calls[seq], False, f"seq {seq}", lambda seq=seq: issued.append(seq))
    assert issued == []  # rank 1 wrote nothing yet
    with peer.locked():
        for seq in (1, 2):
            peer.write(1, 1, "0#0", (0, 1), seq, B.call_digest(1, "0#0", (0, 1), seq, calls[seq]))
    ck.board.advance(["0#0"])
    assert issued == [1, 2]
    peer.close()
    parent.close()


def test_a_thread_asleep_on_the_board_wakes_when_the_watcher_decides_its_call(tmp_path):
    """The watcher can take a call off the board just before the thread that waits for it looks, and decide it
    just after that thread went to sleep: the decision must wake it (it slept its whole quiet wait, 5 ms in a
    run and 5 s here, before; found by the zero-posts test on a loaded machine)."""
    ck, peer, parent = _rank_zero_with_a_board(tmp_path)
    ck.quiet_wait_s = 5.0
    calls = ck.board
    assert calls is not None
    call = _all_reduce(0, 2, torch.float32, (4,), "sum")
    rec = calls.post(("post", "0", (0, 1), 1, call), "0#0", call, False, "seq 1", lambda: None)
    with peer.locked():
        peer.write(1, 1, "0#0", (0, 1), 1, B.call_digest(1, "0#0", (0, 1), 1, call))
    with ck.lock, calls.board.locked():  # what the watcher does first: take it off and issue it ...
        calls.issue_all(calls.progress("0#0"))
    waiter = threading.Thread(target=ck.wait_verdict, args=(rec,))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.3)  # ... the waiting thread looked, found nothing left to issue, and sleeps ...
    ck._decided(rec)  # ... then the watcher tells of its decision
    waiter.join(3.0)
    assert not waiter.is_alive() and time.monotonic() - start < 3.0
    peer.close()
    parent.close()


def _one_more_group_on_rank_0(ctx: Any) -> str:
    """A run in which rank 0 made one group more than its peers of the name the next run's subgroup gets (as
    when a rank fails before making a group its peers made)."""
    from dstest.worlds.process import checked

    sub = dist.new_group([0, 1])
    name = str(sub.group_name)
    if ctx.rank == 0:
        assert checked._CHECKER is not None
        checked._CHECKER.board_key(name)
    return name


def _subgroup_calls(ctx: Any) -> tuple[Any, int]:
    def body(ctx: Any) -> tuple[str, list[float]]:
        sub = dist.new_group([0, 1])
        t = torch.full((2,), float(ctx.rank + 1))
        for _ in range(3):
            dist.all_reduce(t, group=sub)
        return str(sub.group_name), t.tolist()

    return _posts_of(body, ctx)


def test_groups_made_unevenly_in_one_run_do_not_send_the_next_runs_calls_to_the_referee():
    """E10: a group's board key counts the groups of its name made in this run only. When they were counted
    across runs, one run in which rank 0 made a group more than rank 1 left the two ranks with different keys
    for every later group of that name: each of its calls went to the referee (slower, and the zero-posts
    test failed in whichever xdist worker ran such a test first)."""
    names = dstest.run(_one_more_group_on_rank_0, 2, world="process")
    results = dstest.run(_subgroup_calls, 2, world="process")
    assert [r[0][0] for r in results] == names  # the same name as in the uneven run: the case this checks
    assert [r[0][1] for r in results] == [[12.0, 12.0]] * 2  # (1 + 2) doubled twice
    assert [r[1] for r in results] == [0, 0]


def _sends_under_the_board_lock(ctx: Any, n: int) -> tuple[float, list[str]]:
    """Run :func:`_far_ahead` with a quiet wait of 0 (every wait is posted, then matched on the board and
    withdrawn) and note every message sent to the referee while the sending thread holds the board's lock."""
    import contextlib

    from dstest.worlds.process import board as board_module
    from dstest.worlds.process import checked

    ck = checked._CHECKER
    assert ck is not None and ck.board_on
    held = threading.local()
    locked = board_module.Board.locked

    @contextlib.contextmanager
    def tracked(self: Any) -> Any:
        with locked(self):
            held.depth = getattr(held, "depth", 0) + 1
            try:
                yield
            finally:
                held.depth -= 1

    bad: list[str] = []
    send, quiet = ck._send, ck.quiet_wait_s

    def watched_send(msg: tuple[Any, ...]) -> None:
        if getattr(held, "depth", 0):
            bad.append(msg[0])
        send(msg)

    board_module.Board.locked = tracked  # type: ignore[method-assign]
    ck._send, ck.quiet_wait_s = watched_send, 0.0  # type: ignore[method-assign]
    try:
        return _far_ahead(ctx, n), bad
    finally:
        board_module.Board.locked = locked  # type: ignore[method-assign]
        ck._send, ck.quiet_wait_s = send, quiet  # type: ignore[method-assign]


def test_no_rank_sends_to_the_referee_while_it_holds_the_board_lock():
    """E10, E11: the referee takes the board's lock to read it, so a rank that blocks on a full pipe to the
    parent while holding that lock deadlocks them both. It did: under load, in the test of a rank far
    ahead of its peer, the parent waited on the lock while the rank waited for the parent to read (a hang
    of the whole pytest worker). Every message now leaves after the lock is released."""
    n = B.RING + 40
    results = dstest.run(_sends_under_the_board_lock, 2, world="process", args=(n,), timeout=120)
    assert [r[0] for r in results] == [float(n * (n - 1))] * 2
    assert [r[1] for r in results] == [[], []]
