"""The threaded world against contract E1-E5 (the gloo oracle comparison lives in test_oracle_gloo.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import distributed_c10d as c10d

import dstest
from dstest import strategies as dst
from dstest.errors import CollectiveMismatch, InvalidArgument, RankFailure, WorldTimeout
from dstest.programs import KINDS, execute, reference
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

pytestmark = pytest.mark.cpu
WORLD = ThreadedWorld()


def _rank_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dstest-rank")]


def _assert_same(got: list, want: list) -> None:
    for rank, (g_rank, w_rank) in enumerate(zip(got, want)):
        for step, (g, w) in enumerate(zip(g_rank, w_rank)):
            if w is None:
                assert g is None, (rank, step)
                continue
            assert len(g) == len(w), (rank, step)
            for a, b in zip(g, w):
                assert a.dtype == b.dtype and torch.equal(a, b), (rank, step, a, b)


# -- E1: every collective, on subgroups, singletons and with non-members, against the reference ---------
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_e1_random_programs_match_reference(world_size, data):
    """E1: hypothesis draws collective programs on random subgroups; every rank ends with the reference."""
    program = data.draw(dst.programs(world_size, kinds=KINDS))
    got = WORLD.run(RunRequest(execute, world_size, args=(program,), timeout=20))
    _assert_same(got, reference(program))


def test_e1_non_member_call_is_a_no_op():
    """E1/A4: a rank outside the group that calls a collective gets torch's no-op (and warning), no hang."""

    def body(ctx):
        g = ctx.groups.excluding(0)
        t = torch.ones(2)
        if ctx.rank == 0:
            assert g is dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_world_size(g) == -1
        else:
            dist.all_reduce(t, group=g)
        return t.tolist()

    assert WORLD.run(RunRequest(body, 3)) == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]


def test_e1_async_handles_and_futures():
    """E1: async_op=True returns a handle; results appear after wait() and through get_future()."""

    def body(ctx):
        a = torch.full((2,), float(ctx.rank))
        work = dist.all_reduce(a, async_op=True)
        fut = work.get_future()
        work.wait()
        value = fut.wait()
        return a.tolist(), value[0].tolist(), work.is_completed()

    got = WORLD.run(RunRequest(body, 3))
    assert all(r == ([3.0, 3.0], [3.0, 3.0], True) for r in got)


# -- E2: mismatches raise at once, on every rank involved, naming both calls --------------------------
def _mismatch(body, world_size=2):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        WORLD.run(RunRequest(body, world_size, timeout=30))
    # A hang would end in WorldTimeout after 30 s; a mismatch is a CollectiveMismatch on every rank.
    assert not isinstance(info.value, WorldTimeout)
    assert time.monotonic() - start < 30
    return info.value


def test_e2_shape_mismatch_names_both_ranks_and_calls():
    def body(ctx):
        dist.all_reduce(torch.ones(3 + ctx.rank))

    err = _mismatch(body)
    assert set(err.exceptions) == {0, 1}
    assert all(isinstance(e, CollectiveMismatch) for e in err.exceptions.values())
    text = str(err)
    assert "rank 0 called all_reduce(float32[3]@cpu, op=sum)" in text
    assert "rank 1 called all_reduce(float32[4]@cpu, op=sum)" in text


def test_e2_op_mismatch():
    def body(ctx):
        t = torch.ones(2)
        if ctx.rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)

    err = _mismatch(body)
    assert all(isinstance(e, CollectiveMismatch) for e in err.exceptions.values())
    assert "all_reduce" in str(err) and "broadcast" in str(err)


@pytest.mark.parametrize(
    "what",
    ["dtype", "root", "reduce_op", "reduce_scatter_tensor_sizes", "all_to_all_splits", "p2p_shape"],
)
def test_e2_argument_mismatches(what):
    """E2: dtype, root, op, reduce_scatter_tensor sizes (torch's threaded group accepts those) and counts."""

    def body(ctx):
        r = ctx.rank
        if what == "dtype":
            dist.all_reduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64))
        elif what == "root":
            dist.broadcast(torch.ones(2), src=r)
        elif what == "reduce_op":
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        elif what == "reduce_scatter_tensor_sizes":
            n = 4 if r == 0 else 3
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(2 * n))
        elif what == "all_to_all_splits":
            dist.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [2, 0] if r == 0 else [1, 1])
        elif what == "p2p_shape":
            if r == 0:
                dist.send(torch.ones(2), dst=1)
            else:
                dist.recv(torch.empty(3), src=0)

    err = _mismatch(body)
    assert all(isinstance(e, CollectiveMismatch) for e in err.exceptions.values()), str(err)


def test_e2_group_mismatch_is_reported_as_deadlock():
    """E2: rank 0 waits on the world, rank 1 on a subgroup: reported with both pending calls, no hang."""

    def body(ctx):
        sub = dist.new_group([1, 2])
        if ctx.rank == 0:
            dist.all_reduce(torch.ones(1))
        elif ctx.rank == 1:
            dist.all_reduce(torch.ones(1), group=sub)
        else:
            dist.all_reduce(torch.ones(1))

    err = _mismatch(body, world_size=3)
    text = str(err)
    assert "deadlock" in text
    assert "rank 1 waits in all_reduce" in text and "group 1 [1, 2]" in text


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_e2_a_deadlock_completed_by_a_rank_that_finishes_last_is_reported(warm: bool):
    """E2: ranks 0 and 1 each wait to receive from the other while rank 2 still runs; once rank 2 finishes
    (it takes no part in their transfers), no rank is left to complete them: a deadlock, reported then,
    not at the timeout."""

    def body(ctx):
        if ctx.rank == 2:
            time.sleep(0.2)  # the other two are already waiting when it finishes
            return
        dist.recv(torch.empty(2), src=1 - ctx.rank)

    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        ThreadedWorld(warm=warm).run(RunRequest(body, 3, timeout=30))
    assert not isinstance(info.value, WorldTimeout) and time.monotonic() - start < 30
    text = str(info.value)
    assert "deadlock" in text and "rank 0 waits in recv" in text and "rank 1 waits in recv" in text, text


def test_e2_rank_that_skips_a_collective():
    def body(ctx):
        if ctx.rank == 0:
            dist.all_reduce(torch.ones(1))

    err = _mismatch(body)
    assert "rank 1 finished its function without joining all_reduce" in str(err)


def test_e2_local_size_errors_are_clear():
    def body(ctx):
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(2))

    err = _mismatch(body)
    assert isinstance(err.exceptions[0], InvalidArgument)
    assert "expected group size 2 x input 2 = 4" in str(err)


# -- E3: one rank's failure aborts the world, every traceback in one report; timeouts give stacks ------
def test_e3_failing_rank_aborts_the_others():
    def body(ctx):
        if ctx.rank == 1:
            raise ValueError("rank one is broken")
        dist.all_reduce(torch.ones(1))  # the others would wait forever

    with pytest.raises(RankFailure) as info:
        WORLD.run(RunRequest(body, 3, timeout=30))
    text = str(info.value)
    assert "rank 1: ValueError: rank one is broken" in text
    assert "---- rank 1 ----" in text and "raise ValueError" in text
    assert "ranks [0, 2] were aborted" in text


def test_e3_timeout_reports_every_rank_stack():
    def body(ctx):
        if ctx.rank == 0:
            while True:  # a rank stuck in Python code
                time.sleep(0.01)
        dist.barrier()

    with pytest.raises(WorldTimeout) as info:
        WORLD.run(RunRequest(body, 2, timeout=1.0))
    err = info.value
    assert set(err.stacks) == {0, 1}
    assert "time.sleep(0.01)" in err.stacks[0]
    assert "dist.barrier()" in err.stacks[1]
    assert _rank_threads() == []


# -- E4: nothing outlives a world ---------------------------------------------------------------------
@pytest.mark.parametrize("outcome", ["success", "failure", "mismatch"])
def test_e4_no_thread_or_group_survives(outcome):
    original_world = c10d._world

    def body(ctx):
        dist.new_group([0])
        if outcome == "failure" and ctx.rank == 0:
            raise RuntimeError("boom")
        dist.all_reduce(torch.ones(1 + (ctx.rank if outcome == "mismatch" else 0)))

    if outcome == "success":
        WORLD.run(RunRequest(body, 3))
    else:
        with pytest.raises(RankFailure):
            WORLD.run(RunRequest(body, 3))
    assert _rank_threads() == []
    assert c10d._world is original_world
    assert not dist.is_initialized()


# -- E5: per-rank seeded RNG --------------------------------------------------------------------------
def test_e5_each_rank_has_its_own_deterministic_rng():
    def body(ctx):
        return ctx.randn(4)

    first, second = WORLD.run(RunRequest(body, 3)), WORLD.run(RunRequest(body, 3))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1])
    other_seed = WORLD.run(RunRequest(body, 3, seed=1))
    assert not torch.equal(first[0], other_seed[0])


# -- scale ----------------------------------------------------------------------------------------------
def test_64_ranks_all_reduce_and_all_gather():
    def body(ctx):
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t)
        out = torch.empty(ctx.world_size)
        dist.all_gather_into_tensor(out, torch.tensor([float(ctx.rank)]))
        return t.item(), out

    got = WORLD.run(RunRequest(body, 64, timeout=60))
    assert got[5][0] == sum(range(64))
    assert torch.equal(got[63][1], torch.arange(64, dtype=torch.float32))


def test_fake_world_answers_for_65536_ranks():
    def body(ctx):
        out = torch.empty(2 * ctx.world_size)
        dist.all_gather_into_tensor(out, torch.ones(2))
        return dist.get_rank(), dist.get_world_size(), out.numel()

    assert dstest.get_world("fake").run(RunRequest(body, 65536)) == [(0, 65536, 131072), (65535, 65536, 131072)]


def test_bad_world_size_is_a_clear_error():
    with pytest.raises(dstest.InvalidWorldSize, match="world_size=0 must be an int >= 1"):
        WORLD.run(RunRequest(lambda ctx: None, 0))


# -- warm crews: kept between successful runs, retired by failures, stopped at the end -------------------
def _warm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dstest-warm")]


def test_warm_world_reuses_threads_and_resets_rank_state():
    """Subgroups and grad mode a run leaves behind do not reach the next run on the same threads."""
    from dstest.worlds.threaded import c10d_state

    warm = ThreadedWorld(warm=True)

    def first(ctx):
        dist.new_group([0])
        torch.set_grad_enabled(False)
        return threading.current_thread()

    def second(ctx):
        return threading.current_thread(), len(c10d_state().pg_map), torch.is_grad_enabled()

    threads = warm.run(RunRequest(first, 3))
    again = warm.run(RunRequest(second, 3))
    assert all(a[0] is t for a, t in zip(again, threads))
    assert all(a[1:] == (1, True) for a in again)


def test_warm_world_retires_its_crew_on_failure_and_shutdown_stops_the_rest():
    from dstest.worlds.threaded import shutdown_all

    warm = ThreadedWorld(warm=True)
    before = warm.run(RunRequest(lambda ctx: threading.current_thread(), 2))

    def fails(ctx):
        if ctx.rank == 0:
            raise RuntimeError("boom")
        dist.barrier()

    with pytest.raises(RankFailure):
        warm.run(RunRequest(fails, 2))
    after = warm.run(RunRequest(lambda ctx: threading.current_thread(), 2))
    assert not any(a is b for a in after for b in before)
    assert not any(t.is_alive() for t in before)

    def unmatched_isend(ctx):
        if ctx.rank == 0:
            dist.isend(torch.ones(1), dst=1)  # never received, never waited

    with pytest.raises(RankFailure, match=r"rank 0: (UnfinishedWork|CollectiveMismatch)(.|\n)*send\(float32\[1\]@cpu to rank 1"):
        warm.run(RunRequest(unmatched_isend, 2))  # issue 10.1: orphan work fails the run that left it
    assert not any(t.is_alive() for t in after)
    assert warm.run(RunRequest(lambda ctx: dist.get_world_size(), 2)) == [2, 2]  # and never leaks into the next
    shutdown_all()
    assert _warm_threads() == []
    assert c10d._world.__class__.__name__ == "_World"


def test_e4_a_crew_whose_thread_ended_is_closed_before_the_next_run():
    """A crew thread that ended between runs (here: told to stop) makes its crew unusable; the next run gets a
    new crew, and the old crew's other threads end (nothing outlives a world, E4)."""
    from dstest.worlds.threaded.crews import CREWS

    warm = ThreadedWorld(warm=True)
    before = warm.run(RunRequest(lambda ctx: threading.current_thread(), 3))
    crew = CREWS.crews[("cpu", 3)]
    crew._tasks[1].put(None)  # rank 1's thread leaves its loop
    before[1].join(5)
    assert not before[1].is_alive()
    after = warm.run(RunRequest(lambda ctx: threading.current_thread(), 3))
    assert not any(a is b for a in after for b in before)
    for t in before:
        t.join(5)
    assert not any(t.is_alive() for t in before), [t.name for t in before if t.is_alive()]
    assert crew.retired


def test_warm_world_survives_a_spec_that_destroys_the_default_group():
    warm = ThreadedWorld(warm=True)

    def destroys(ctx):
        dist.destroy_process_group()
        return threading.current_thread()

    threads = warm.run(RunRequest(destroys, 2))
    assert warm.run(RunRequest(lambda ctx: dist.get_world_size(), 2)) == [2, 2]
    assert not any(t.is_alive() for t in threads)


def test_e3_a_crew_replaced_after_a_failure_starts_without_a_full_collection(monkeypatch):
    """Only the process's first warm crew ends its start with a full garbage collection; a crew replaced
    after a failed run does not (that collection added 70-200 ms to reporting every failure)."""
    import gc

    world = ThreadedWorld(warm=True)
    world.run(RunRequest(_all_reduce_sum, 2))  # a crew has started in this process: the settling is done
    full = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: full.append(generation) or real(0))

    def fails_on_rank_1(ctx):
        if ctx.rank == 1:
            raise ValueError("rank 1 fails")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailure):
        world.run(RunRequest(fails_on_rank_1, 2))
    assert world.run(RunRequest(_all_reduce_sum, 2)) == [2.0, 2.0]  # on a new crew
    assert full == []


def _all_reduce_sum(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
