"""Turns in a large threaded world (issue 44 item 2): a completion wakes its ranks one at a time, and nothing
a rank does outside the rendezvous can hang the others on their turn."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import CollectiveMismatch, RankFailure
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from dstest.worlds.threaded.turns import TURNS_FROM

pytestmark = pytest.mark.cpu

W = TURNS_FROM


def cold(body: Any, timeout: float = 120) -> list[Any]:
    """A cold run (warm crews keep every rank running at once: turns are for the large, cold worlds)."""
    return ThreadedWorld(warm=False).run(RunRequest(body, W, timeout=timeout))


class _Inside:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def test_a_completion_lets_one_rank_run_at_a_time() -> None:
    """After an all_reduce completes, the ranks it woke run their code one after another: a rank that
    sleeps outside the rendezvous (the GIL released) lets no other rank run meanwhile. Without turns every
    woken rank ran at once (most inside: about W)."""
    inside = _Inside()

    def body(ctx: dstest.RankContext) -> None:
        t = torch.ones(1)
        dist.all_reduce(t)
        inside.enter()
        time.sleep(0.001)
        inside.leave()
        dist.all_reduce(t)
        assert t.item() == ctx.world_size**2

    cold(body)
    assert inside.most == 1


def test_a_rank_blocked_outside_the_rendezvous_does_not_hang_the_others() -> None:
    """Ranks that wait for one another on the user's own barrier (no collective) all get there: the holder
    of the turn blocks where it hands nothing on, and the queued ranks go on without a turn."""
    barrier = threading.Barrier(W)

    def body(ctx: dstest.RankContext) -> int:
        barrier.wait(timeout=60)
        t = torch.ones(1)
        dist.all_reduce(t)
        return int(t.item())

    assert cold(body) == [W] * W


def test_futures_waited_outside_the_rendezvous_complete() -> None:
    def body(ctx: dstest.RankContext) -> float:
        t = torch.ones(2)
        fut = dist.all_reduce(t, async_op=True).get_future()
        fut.wait()
        return float(t.sum())

    assert cold(body) == [2.0 * W] * W


def test_a_mismatch_and_a_deadlock_are_reported_with_turns() -> None:
    def mismatch(ctx: dstest.RankContext) -> None:
        dist.all_reduce(torch.ones(2 if ctx.rank == W - 1 else 1))

    with pytest.raises(RankFailure) as caught:
        cold(mismatch)
    assert CollectiveMismatch.__name__ in str(caught.value)

    def deadlock(ctx: dstest.RankContext) -> None:
        if ctx.rank != 3:
            dist.all_reduce(torch.ones(1))
        else:
            dist.broadcast(torch.ones(1), 0)

    with pytest.raises(RankFailure) as caught:
        cold(deadlock)
    assert "deadlock" in str(caught.value).lower() and "broadcast" in str(caught.value)


def test_a_rank_that_raises_ends_the_run_with_turns() -> None:
    def body(ctx: dstest.RankContext) -> None:
        dist.all_reduce(torch.ones(1))
        if ctx.rank == 5:
            raise ValueError("rank five fails")
        dist.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank five fails"):
        cold(body)
    assert time.monotonic() - start < 60
