"""Hardening in the style of issue 10's probes (contract E2, E9, E10): a generator of *broken* rank bodies.

Each drawn body breaks a run in one of the ways a realistic user does (orphan async work, a caught
mismatch, a rank that skips a collective and finishes, an error while a peer spins, a shape, dtype, op or
root mismatch, a group-order mismatch) at a random point of an otherwise correct sequence of collectives.
Every one must fail the run with RankFailure, never pass and never reach the world's timeout, and the next,
correct run on the same world must pass. A few examples run in the default ``-m cpu`` run, many more under
``-m soak``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import dstest
from dstest.errors import RankFailure, WorldTimeout

BREAKS = (
    "orphan_async",  # an async all_reduce on one rank that nobody matches, never waited
    "unwaited_async",  # matched by every rank, never waited
    "orphan_isend",  # an isend nobody receives
    "caught_mismatch",  # shapes differ; the code under test swallows the error
    "skip_and_finish",  # one rank skips the rest and returns
    "raise_while_peer_spins",  # one rank raises, the others spin in Python
    "shape",
    "dtype",
    "op",
    "root",
    "group_order",  # ranks call collectives on two groups in different orders
)


@dataclass(frozen=True)
class Broken:
    steps: int  # correct all_reduces before the break
    at: int  # which step breaks
    rank: int  # the rank that breaks it
    kind: str


def _body(ctx, broken: Broken):
    t = torch.ones(3)
    for step in range(broken.steps):
        me = ctx.rank == broken.rank
        if step != broken.at:
            dist.all_reduce(t)
            continue
        kind = broken.kind
        if kind == "orphan_async" and me:
            dist.all_reduce(torch.ones(2), async_op=True)
        elif kind == "unwaited_async":
            dist.all_reduce(torch.ones(2), async_op=True)
        elif kind == "orphan_isend" and me:
            dist.isend(torch.ones(2), dst=(ctx.rank + 1) % ctx.world_size)
        elif kind == "caught_mismatch":
            try:
                dist.all_reduce(torch.ones(4 if me else 3))
            except Exception:
                pass
        elif kind == "skip_and_finish":
            if me:
                return "skipped"
            dist.all_reduce(t)
        elif kind == "raise_while_peer_spins":
            if me:
                raise ValueError("the real error")
            while True:
                pass
        elif kind == "shape":
            dist.all_reduce(torch.ones(4 if me else 3))
        elif kind == "dtype":
            dist.all_reduce(torch.ones(3, dtype=torch.float64 if me else torch.float32))
        elif kind == "op":
            dist.all_reduce(t, op=dist.ReduceOp.MAX if me else dist.ReduceOp.SUM)
        elif kind == "root":
            dist.broadcast(t, src=1 if me else 0)
        elif kind == "group_order":
            a, b = dist.new_group(list(range(ctx.world_size))), dist.new_group(list(range(ctx.world_size)))
            first, second = (b, a) if me else (a, b)
            dist.all_reduce(torch.ones(1), group=first)
            dist.all_reduce(torch.ones(2), group=second)
    return "ran"


def _broken(world_size: int, kinds: tuple[str, ...]) -> st.SearchStrategy[Broken]:
    @st.composite
    def draw(draw_: st.DrawFn) -> Broken:
        steps = draw_(st.integers(1, 4))
        return Broken(
            steps=steps,
            at=draw_(st.integers(0, steps - 1)),
            rank=draw_(st.integers(0, world_size - 1)),
            kind=draw_(st.sampled_from(kinds)),
        )

    return draw()


def _check(world: str, world_size: int, broken: Broken) -> None:
    with pytest.raises(RankFailure) as info:
        dstest.run(_body, world_size, world=world, args=(broken,), timeout=30)
    assert not isinstance(info.value, WorldTimeout), broken
    assert "ran past its timeout" not in str(info.value), broken
    # and nothing of the broken run reaches the next one
    ok = Broken(steps=2, at=-1, rank=0, kind="none")
    assert dstest.run(_body, world_size, world=world, args=(ok,), timeout=30) == ["ran"] * world_size


@pytest.mark.cpu
@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_broken_bodies_fail_on_the_threaded_world(world_size, data):
    _check("threaded", world_size, data.draw(_broken(world_size, BREAKS)))


@pytest.mark.cpu
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_broken_bodies_fail_on_the_process_world(data):
    _check("process", 2, data.draw(_broken(2, BREAKS)))


@pytest.mark.cpu
@pytest.mark.parametrize("kind", BREAKS)
@pytest.mark.parametrize("world", ["threaded", "process"])
def test_every_break_fails(world, kind):
    """Each class at least once on each world, whatever hypothesis draws."""
    _check(world, 2, Broken(steps=2, at=1, rank=0, kind=kind))


@pytest.mark.soak
@settings(max_examples=400, deadline=None)
@given(data=st.data(), world_size=st.integers(2, 5), world=st.sampled_from(["threaded", "process"]))
def test_soak_broken_bodies(data, world_size, world):
    _check(world, world_size, data.draw(_broken(world_size, BREAKS)))
