"""Long hardening runs, selected with ``pytest -m soak`` only (this repository's ini sets the plugin's
``dstest_deselect_soak = true``, which keeps them out of other runs)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dstest import strategies as dst
from dstest.programs import execute
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

WORLD = ThreadedWorld()


@pytest.mark.soak
@settings(max_examples=2000, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 8))
def test_soak_random_programs(data, world_size):
    """A longer run of random programs (``pytest -m soak``)."""
    from dstest.programs import reference

    program = data.draw(dst.programs(world_size, max_ops=12))
    got = WORLD.run(RunRequest(execute, world_size, args=(program,), timeout=30))
    want = reference(program)
    for g_rank, w_rank in zip(got, want):
        for g, w in zip(g_rank, w_rank):
            assert (g is None) == (w is None)
            if w is not None:
                assert all(torch.equal(a, b) for a, b in zip(g, w))
