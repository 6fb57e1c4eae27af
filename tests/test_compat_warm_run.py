"""contracts F1, F2: the one warm-run path of the compat plugins (:mod:`dstest.compat._warm_run`), on its own.

The plugins' tests (``test_compat_deepspeed.py``, ``test_compat_torch.py``) run whole suites in a subprocess;
these check the pieces every plugin now shares: which pools count as replaced, the reason a run's pool
was replaced, and that the classes a plugin patched get their own attributes back.
"""

from __future__ import annotations

import pytest

from dstest.compat._warm_run import Elsewhere, PoolSeen, WarmState, patch, restore, run_warm
from dstest.errors import RankFailure

pytestmark = pytest.mark.cpu

POOL = PoolSeen(1, (10, 11))


@pytest.mark.parametrize(
    ("before", "after", "replaced"),
    [
        (POOL, POOL, False),  # the same pool
        (POOL, PoolSeen(2, (12, 13)), True),  # another
        (POOL, PoolSeen(2, ()), True),  # another, whose workers have not started yet
        (PoolSeen(2, ()), PoolSeen(2, (12, 13)), False),  # the workers of the same pool came up
        (POOL, PoolSeen(None, ()), True),  # killed, none started since
        (PoolSeen(None, ()), POOL, False),  # the first pool of its size, started by the run, kept
        (PoolSeen(None, ()), PoolSeen(None, ()), True),  # the first pool, started by the run, then killed
    ],
)
def test_a_pool_is_replaced_when_another_or_none_is_there_after(
    before: PoolSeen, after: PoolSeen, replaced: bool
) -> None:
    assert before.replaced(after) is replaced


def test_restore_puts_back_what_a_class_had_and_removes_what_it_did_not() -> None:
    class Base:
        def own(self) -> str:
            return "own"

        def kept(self) -> str:
            return "kept"

    class Derived(Base):
        pass

    state = WarmState()
    patch(state, Base, {"own": lambda self: "patched"}, keep=("kept",))
    patch(state, Derived, {"own": lambda self: "derived"})  # Derived had no "own" of its own
    assert Derived().own() == "derived" and Base().own() == "patched"
    restore(state)
    assert Base().own() == "own" and Base().kept() == "kept" and Derived().own() == "own"
    assert "own" not in vars(Derived) and state.patched == {}


def _asks_to_be_replaced(ctx: object) -> int:
    from dstest.worlds.process import byref

    byref.replace_after_this_run("a test left its worker unusable")
    return 7


def _rank_1_fails_while_rank_0_waits(ctx: object) -> None:
    """Rank 0 blocks where the process world's checks cannot release it (as in a world a test formed itself),
    so it is stopped with its worker."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(600)


def _returns_rank(ctx: object) -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_run_warm_counts_the_run_and_notes_a_replaced_pool_with_why() -> None:
    """A run that keeps its pool is counted and not noted; one whose worker asked to be replaced is noted with
    its world size (its result still comes back); ranks stopped after another's failure are noted as such;
    a run that says its workers are always fresh after it is not noted."""
    state = WarmState()
    assert run_warm(state, "t::keeps", _returns_rank, 2, (), timeout=60, watch="torch.distributed") == [0, 1]
    assert run_warm(state, "t::keeps", _returns_rank, 2, (), timeout=60, watch="torch.distributed") == [0, 1]
    assert state.replaced == []
    assert run_warm(state, "t::asks", _asks_to_be_replaced, 2, (), timeout=60, watch="torch.distributed") == [7, 7]
    assert state.replaced == [Elsewhere("t::asks", "the test left its workers unusable", 2)]
    with pytest.raises(RankFailure, match="rank 1 gives up"):
        run_warm(state, "t::fails", _rank_1_fails_while_rank_0_waits, 2, (), timeout=60, watch="torch.distributed")
    assert state.replaced[1:] == [Elsewhere("t::fails", "a rank failed while its peers were blocked", 2)]
    run_warm(state, "t::own", _asks_to_be_replaced, 2, (), timeout=60, watch="torch.distributed", fresh_after=True)
    assert len(state.replaced) == 2 and state.warm_runs == 5
