"""contract E1 with gloo as the oracle: the same collective programs through a warm gloo process group and
through the threaded world must leave every rank with the same tensors.

Both worlds draw identical inputs from (seed, step, rank); one gloo pool per world size serves every
example of the session. Kinds gloo lacks (all_gather with per-rank sizes, list reduce_scatter, AVG) are
checked against the pure-torch reference in test_threaded_world.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dstest import get_world
from dstest import strategies as dst
from dstest.programs import GLOO_KINDS, Program, execute
from dstest.worlds import torch_internals
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu
THREADED = get_world("threaded")
GLOO = get_world("process")
# torch 2.11's gloo has no list all_to_all ("Backend gloo does not support alltoall"; all_to_all_single
# works); 2.12 added it. There the threaded all_to_all is checked against the reference only.
KINDS = sorted(GLOO_KINDS if torch_internals.gloo_has_list_all_to_all() else GLOO_KINDS - {"all_to_all"})


def _gloo_safe(program: Program) -> Program:
    """gloo has no AVG; keep every other op as drawn."""
    ops = tuple(dataclasses.replace(op, reduce_op="sum") if op.reduce_op == "avg" else op for op in program.ops)
    return dataclasses.replace(program, ops=ops)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_e1_threaded_equals_gloo(world_size, data):
    program = _gloo_safe(data.draw(dst.programs(world_size, kinds=KINDS)))
    want = GLOO.run(RunRequest(execute, world_size, args=(program,), timeout=60))
    got = THREADED.run(RunRequest(execute, world_size, args=(program,), timeout=60))
    for rank in range(world_size):
        for step, (g, w) in enumerate(zip(got[rank], want[rank])):
            assert (g is None) == (w is None), (rank, step)
            if w is None:
                continue
            assert len(g) == len(w), (rank, step, program.ops[step])
            for a, b in zip(g, w):
                assert a.dtype == b.dtype and torch.equal(a, b), (rank, step, program.ops[step], a, b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_e1_singleton_and_subgroups_against_gloo(world_size):
    """Every gloo kind, on the world, a singleton group and a subgroup that leaves rank 0 out."""
    from dstest.programs import Op

    ops = []
    for kind in KINDS:
        for ranks in (None, (world_size - 1,), tuple(range(1, world_size))):
            n = len(ranks) if ranks else world_size
            if kind == "send_recv" and n < 2:
                continue
            splits = tuple(tuple((i + j) % 3 for j in range(n)) for i in range(n))
            ops.append(Op(kind=kind, ranks=ranks, numel=3, dtype="float32", root=n - 1, peer=0, splits=splits))
    program = Program(world_size=world_size, ops=tuple(ops), seed=7)
    want = GLOO.run(RunRequest(execute, world_size, args=(program,), timeout=60))
    got = THREADED.run(RunRequest(execute, world_size, args=(program,), timeout=60))
    for rank in range(world_size):
        for step, (g, w) in enumerate(zip(got[rank], want[rank])):
            assert (g is None) == (w is None)
            if w is not None:
                assert all(torch.equal(a, b) for a, b in zip(g, w)), (rank, program.ops[step])
