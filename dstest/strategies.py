"""Hypothesis strategies for the hard cases: world sizes, group topologies, shard layouts, collective programs.

.. code-block:: python

    from hypothesis import given
    from dstest import strategies as dst

    @given(dst.shard_counts(world_size=4))
    def test_compaction(counts): ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st

from dstest.groups import TOPOLOGIES, topologies_for
from dstest.programs import KINDS, REDUCE_OPS, Op, Program
from dstest.shards import ShardLayout, padded, uneven

__all__ = [
    "awkward_numels",
    "padded_layouts",
    "programs",
    "shard_counts",
    "shard_layouts",
    "subgroups",
    "topologies",
    "world_sizes",
]


def world_sizes(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[int]:
    """World sizes, shrinking towards ``min_size`` (1: the single-rank world is a case of its own)."""
    return st.integers(min_value=min_size, max_value=max_size)


def topologies(world_size: int | None = None) -> st.SearchStrategy[str]:
    """Group topology kinds (absent, single, non_member, multi) that a world of ``world_size`` can build."""
    return st.sampled_from(topologies_for(world_size) if world_size is not None else TOPOLOGIES)


def subgroups(world_size: int, *, min_size: int = 1) -> st.SearchStrategy[tuple[int, ...]]:
    """Sorted rank subsets of a world; ranks left out are the non-members."""
    return st.lists(
        st.integers(0, world_size - 1), min_size=min_size, max_size=world_size, unique=True
    ).map(lambda ranks: tuple(sorted(ranks)))


def awkward_numels(world_size: int) -> st.SearchStrategy[int]:
    """Element counts that break naive partitioning: 0, 1, W-1, W+1, primes, and anything up to 97."""
    special = sorted({0, 1, max(0, world_size - 1), world_size + 1, 7, 13, 31, 97})
    return st.one_of(st.sampled_from(special), st.integers(0, 97))


def shard_counts(world_size: int | None = None, *, max_count: int = 64) -> st.SearchStrategy[tuple[int, ...]]:
    """Per-rank counts of a truly uneven layout, zero-size shards included (weighted towards them)."""
    sizes = st.just(world_size) if world_size is not None else world_sizes()
    count = st.one_of(st.just(0), st.integers(0, max_count))
    return sizes.flatmap(lambda w: st.lists(count, min_size=w, max_size=w).map(tuple))


def shard_layouts(world_size: int | None = None) -> st.SearchStrategy[ShardLayout]:
    return shard_counts(world_size).map(uneven)


def padded_layouts(world_size: int | None = None) -> st.SearchStrategy[ShardLayout]:
    sizes = st.just(world_size) if world_size is not None else world_sizes()
    return sizes.flatmap(lambda w: awkward_numels(w).map(lambda n: padded(n, w)))


@st.composite
def _op(draw: Any, world_size: int, kinds: tuple[str, ...]) -> Op:
    kind = draw(st.sampled_from(kinds))
    ranks: tuple[int, ...] | None = draw(st.one_of(st.none(), subgroups(world_size)))
    n = len(ranks) if ranks is not None else world_size
    if kind == "send_recv" and n < 2:
        ranks, n = None, world_size
        if n < 2:
            kind = "barrier"
    reduce_op = draw(st.sampled_from(REDUCE_OPS))
    dtype = "int64" if reduce_op in ("band", "bor", "bxor") else draw(st.sampled_from(["float32", "int64"]))
    root = draw(st.integers(0, n - 1))
    peer = (root + draw(st.integers(1, max(1, n - 1)))) % n
    splits: tuple[tuple[int, ...], ...] = ()
    if kind == "all_to_all_single":
        splits = tuple(tuple(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))) for _ in range(n))
    return Op(
        kind=kind,
        ranks=ranks,
        numel=draw(st.integers(1, 6)),
        dtype=dtype,
        reduce_op=reduce_op,
        root=root,
        peer=peer,
        splits=splits,
        async_op=draw(st.booleans()),
    )


def programs(
    world_size: int, *, kinds: Iterable[str] = KINDS, min_ops: int = 1, max_ops: int = 6
) -> st.SearchStrategy[Program]:
    """Sequences of collectives on random subgroups (with non-members) of a ``world_size`` world."""
    allowed = tuple(kinds)
    return st.builds(
        lambda ops, seed: Program(world_size=world_size, ops=tuple(ops), seed=seed),
        st.lists(_op(world_size, allowed), min_size=min_ops, max_size=max_ops),
        st.integers(0, 2**16),
    )
