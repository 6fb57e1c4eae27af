"""Hardening: mutated collective programs must raise, never hang; 200 failing worlds leak nothing (E2-E4)."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed import distributed_c10d as c10d

from dstest import strategies as dst
from dstest.errors import CollectiveMismatch, InvalidArgument, RankFailure, WorldTimeout
from dstest.programs import KINDS, Program, execute
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from dstest.worlds.torch_internals import installed

pytestmark = pytest.mark.cpu
WORLD = ThreadedWorld(grace=0.2)


def _per_rank(ctx, programs):
    return execute(ctx, programs[ctx.rank])


def _mutate(program: Program, step: int) -> Program:
    ops = list(program.ops)
    ops[step] = dataclasses.replace(ops[step], numel=ops[step].numel + 1)
    return dataclasses.replace(program, ops=tuple(ops))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data(), world_size=st.integers(2, 4))
def test_mutated_program_raises_instead_of_hanging(data, world_size):
    """E2: one rank's op has a different size; the world raises a mismatch on the ranks involved."""
    kinds = tuple(k for k in KINDS if k not in ("barrier", "all_to_all_single", "batch_isend_irecv"))
    program = data.draw(dst.programs(world_size, kinds=kinds))
    step = data.draw(st.integers(0, len(program.ops) - 1))
    op = program.ops[step]
    ranks = op.group_ranks(world_size)
    victim = data.draw(st.sampled_from(ranks))
    participants = {ranks[op.root], ranks[op.peer]} if op.kind == "send_recv" else set(ranks)
    assume(len(participants) >= 2 and victim in participants)
    programs = [_mutate(program, step) if r == victim else program for r in range(world_size)]
    with pytest.raises(RankFailure) as info:
        WORLD.run(RunRequest(_per_rank, world_size, args=(programs,), timeout=20))
    assert not isinstance(info.value, WorldTimeout)
    primary = [e for e in info.value.exceptions.values() if isinstance(e, CollectiveMismatch | InvalidArgument)]
    assert primary, str(info.value)


def _fault(ctx, kind):
    r = ctx.rank
    if kind == "raise" and r == 1:
        raise RuntimeError("injected")
    if kind == "exit" and r == 0:
        sys.exit(3)
    if kind == "dtype":
        dist.all_reduce(torch.ones(2, dtype=torch.float64 if r == 1 else torch.float32))
    if kind == "device":
        # a tensor the collective cannot read (meta has no data) on one rank
        dist.all_reduce(torch.ones(2, device="meta" if r == 1 else "cpu"))
    if kind == "skip":
        if r != 1:
            dist.barrier()
        return
    if kind == "hang" and r == 0:
        while True:
            threading.Event().wait(0.01)
    dist.all_reduce(torch.ones(2))


FAULTS = ["raise", "exit", "dtype", "device", "skip"]


def test_200_failing_worlds_leak_nothing():
    """E3/E4: 200 failing worlds in a row (5 fault kinds, then hangs): no thread, group or switch left."""
    original = c10d._world
    hook = sys.excepthook
    installs = installed.INSTALL.users  # warm crews of other tests may hold the thread-local world
    outcomes: dict[str, int] = {}
    for i in range(200):
        kind = FAULTS[i % len(FAULTS)]
        with pytest.raises((RankFailure, WorldTimeout)):
            WORLD.run(RunRequest(_fault, 3, args=(kind,), timeout=20))
        outcomes[kind] = outcomes.get(kind, 0) + 1
    for _ in range(3):
        with pytest.raises(WorldTimeout):
            WORLD.run(RunRequest(_fault, 3, args=("hang",), timeout=0.3))
    assert sum(outcomes.values()) == 200
    assert [t.name for t in threading.enumerate() if t.name.startswith(("dstest-rank", "dstest-fake"))] == []
    assert c10d._world is original and sys.excepthook is hook
    assert installed.INSTALL.users == installs
    assert not dist.is_initialized()


SWALLOWED = """
    import gc
    import pytest
    from dstest.errors import WorldAborted


    class Swallows:
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):  # what a gc callback does with an exception: Python reports it, "ignored"
            raise self.exc


    def test_an_abort_swallowed_by_a_callback():
        Swallows(WorldAborted("abort delivered into a gc callback"))
        gc.collect()


    def test_any_other_swallowed_exception():
        Swallows(ValueError("a real bug in a finalizer"))
        gc.collect()
"""


def test_an_abort_that_python_swallows_is_not_a_failure_but_other_unraisables_are(
    pytester: pytest.Pytester,
) -> None:
    """E4: a hung rank thread is stopped by WorldAborted raised into it until it leaves; one that lands in
    a gc callback is swallowed and reported by Python as unraisable. Under filterwarnings=error that is no
    failure of the test; any other unraisable exception still fails it."""
    pytester.makepyfile(test_swallowed=SWALLOWED)
    # A user's strict config; pytest-benchmark, where installed, warns at start-up inside an xdist worker.
    pytester.makeini("[pytest]\nfilterwarnings =\n    error\n    ignore:Benchmarks are automatically disabled\n")
    result = pytester.runpytest_subprocess("-q")  # dstest's plugin loads as it does for users
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_any_other_swallowed_exception*"])
