"""impl's stage-3 pieces checked directly (contract D1-D6): the partitioner, the registration check, the
gatherer and its buffer pool, and the native allgather-v ops.

These checks ask questions about buffers, launches and collectives that only impl can answer, so they are
impl's tests, not conformance specs (the specs of :mod:`dstest.conformance.zero3` drive any target's engine).
They are ``@dstest.spec`` bodies all the same, parametrized over the same worlds as before (threaded on
CPU, nccl on GPU) and world sizes 1-4; the last section checks that they catch broken implementations.

Every tensor is the same on every rank unless it is data (which differs per rank), so any rank can build
the exact reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.conformance import SIZE_KINDS
from dstest.errors import RankFailure
from dstest.specification import spec_info

WORLD_SIZES = [1, 2, 3, 4]


def _values(shape: tuple[int, ...], salt: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct non-zero values, the same on every rank (so zero padding is recognisable)."""
    n = math.prod(shape)
    values: torch.Tensor = (torch.arange(n, dtype=torch.float64) * 0.5 + 1 + 1000 * salt).to(dtype)
    return values.reshape(shape)


def _group() -> Any:
    """The data-parallel group of these checks: the whole world."""
    return dist.group.WORLD


def _stats() -> Any:
    """A fresh ``(CommStats, Comm)`` pair: the checks count what impl issues, not what they assume."""
    from impl.comm import Comm, CommStats

    stats = CommStats()
    return stats, Comm(stats)


def _shards(ctx: Any, shapes: Iterable[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[Any]]:  # fmt: skip
    """Full parameters of ``shapes`` (:func:`_values`) and this rank's padded shards of them."""
    from impl.zero.partition import partition_parameters

    fulls = [_values(s, i, dtype) for i, s in enumerate(shapes)]
    _, shards = partition_parameters([(f"p{i}", f) for i, f in enumerate(fulls)], ctx.world_size, ctx.rank)
    return fulls, shards


# -- D1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SIZE_KINDS))
@dstest.spec(world_size=WORLD_SIZES, contract="D1")
def test_d1_every_rank_holds_p_elements(ctx: Any, kind: str) -> None:
    """Every rank holds P = ceil(N/W) elements; the shards side by side are the parameter then zeros."""
    from impl.comm.collectives import all_gather_into

    W = ctx.world_size
    shape = SIZE_KINDS[kind](W)
    (full,), (shard,) = _shards(ctx, [shape])
    n = full.numel()
    p = math.ceil(n / W)
    assert shard.tensor.numel() == p, f"N={n}, W={W}: rank {ctx.rank} holds {shard.tensor.numel()}, not P={p}"
    if W == 1:
        assert p == n, f"W=1 must not pad: P={p}, N={n}"
    every = torch.empty(W * p)
    all_gather_into(every, shard.tensor, _group())
    assert torch.equal(every[:n], full.reshape(-1)), "the shards side by side are not the parameter"
    assert torch.count_nonzero(every[n:]) == 0, f"padding {every[n:].tolist()} is not zero"
    assert every.numel() - n == W * p - n < W, "padding must be shorter than one rank's share"


# -- D2 ---------------------------------------------------------------------------------------------

_D2_SHAPES = [(13, 7), (0,), (1,), (13,), (97,)]


@dstest.spec(world_size=WORLD_SIZES, contract="D2")
def test_d2_registration_check_is_one_collective(ctx: Any) -> None:
    """Correct shards pass; the check is one collective for all parameters (none at W = 1)."""
    from impl.zero.partition import check_registration

    _, shards = _shards(ctx, [SIZE_KINDS[k](ctx.world_size) for k in SIZE_KINDS])
    stats, comm = _stats()
    check_registration(shards, _group(), comm=comm)
    want = 1 if ctx.world_size > 1 else 0
    assert sum(stats.total.values()) == want, (
        f"{len(shards)} parameters checked with {dict(stats.total)}; expected {want} collective in total"
    )


@pytest.mark.parametrize("corruption", ["short", "long", "empty"])
@dstest.spec(world_size=WORLD_SIZES, contract="D2")
def test_d2_corrupted_shard_is_caught(ctx: Any, corruption: str) -> None:
    """The last rank's shard of one parameter is replaced by a tensor of another size; everything else
    about the parameter (name, shape, layout, P) is left as registered, so only a check of the real shard
    sizes can see it. Every rank must raise the clear error naming parameter, rank and both sizes."""
    from impl.zero.partition import RegistrationError, check_registration

    W = ctx.world_size
    _, shards = _shards(ctx, _D2_SHAPES)
    victim, bad_rank = shards[0], W - 1
    p = victim.layout.shard_size
    bad = {"short": p - 1, "long": p + 1, "empty": 0}[corruption]
    if ctx.rank == bad_rank:
        victim.tensor = torch.zeros(bad, dtype=victim.tensor.dtype)
    stats, comm = _stats()
    with pytest.raises(RegistrationError) as err:
        check_registration(shards, _group(), comm=comm)
    msg = str(err.value)
    for needle in (repr(victim.name), f"rank {bad_rank}", f"{bad} elements", f"= {p}"):
        assert needle in msg, f"the error must name {needle!r}: {msg}"
    assert sum(stats.total.values()) == (1 if W > 1 else 0), f"one batched collective expected: {dict(stats.total)}"


# -- D3 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SIZE_KINDS))
@dstest.spec(world_size=WORLD_SIZES, contract="D3")
def test_d3_gather_is_a_view_of_the_padded_buffer(ctx: Any, kind: str) -> None:
    """One all-gather of uniform count P from the contiguous shard into a W·P buffer; the parameter is
    ``buffer[:N].view(shape)`` (same storage, same first element); the padding is never visible."""
    from impl.zero.gather import ParamGatherer

    W = ctx.world_size
    (full,), (shard,) = _shards(ctx, [SIZE_KINDS[kind](W)])
    n, p = full.numel(), shard.layout.shard_size
    stats, comm = _stats()
    gatherer = ParamGatherer([shard], _group(), comm=comm)
    got = gatherer.gather(0)
    assert got.shape == full.shape and torch.equal(got, full), f"gathered {got} != {full}"
    buf = gatherer.buffer(0)
    launches = 1 if (W > 1 and p > 0) else 0
    assert sum(stats.total.values()) == launches, f"expected {launches} all-gather, issued {dict(stats.total)}"
    if n == 0:
        return
    assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), "the result is a copy, not a view"
    assert got.data_ptr() == buf.data_ptr() and got.is_contiguous(), "the result must be buffer[:N]"
    if W > 1:
        assert buf.numel() == W * p, f"the padded buffer has {buf.numel()} elements, not W·P = {W * p}"
        assert gatherer.last_row == p, f"each rank sent {gatherer.last_row} elements, not P = {p}"
        assert shard.tensor.is_contiguous() and shard.tensor.numel() == p
        assert torch.count_nonzero(buf[n:]) == 0, "the padding of the buffer is not zero"
    else:
        assert buf is shard.tensor, "at W = 1 the parameter is a view of the shard itself"


# -- D4 ---------------------------------------------------------------------------------------------


@dstest.spec(world_size=WORLD_SIZES, contract="D4")
def test_d4_regather_allocates_nothing(ctx: Any) -> None:
    """After the first gather, gathering again (after a release, many times, with changed shards)
    allocates no buffer, reuses the same storage, and is correct."""
    from impl.zero.gather import ParamGatherer

    W = ctx.world_size
    shapes = [(13, 7), (97,), (1,), (13,)]
    fulls, shards = _shards(ctx, shapes)
    gatherer = ParamGatherer(shards, _group())
    pool = gatherer.pool
    ptrs = [gatherer.gather(i).untyped_storage().data_ptr() for i in range(len(shards))]
    first = pool.allocations
    assert first == (len(shards) if W > 1 else 0), f"first gathers allocated {first} buffers"
    for round_ in range(5):
        gatherer.release_all()
        for s in shards:  # the optimizer changes the shards between gathers
            s.tensor.add_(1.0)
        for i, full in enumerate(fulls):
            got = gatherer.gather(i)
            want = full.reshape(-1) + (round_ + 1)
            n = full.numel()
            # padding shards stay padding: only real elements change value in this reference
            assert torch.equal(got.reshape(-1), want[:n]), f"round {round_}: re-gather of p{i} is wrong"
        assert pool.allocations == first, f"round {round_}: re-gathering allocated {pool.allocations - first} buffers"
        assert sorted(gatherer.gather(i).untyped_storage().data_ptr() for i in range(len(shards))) == sorted(ptrs)
    gatherer.release_all()
    assert pool.in_use() == 0, "released buffers must go back to the pool"


@dstest.spec(world_size=WORLD_SIZES, contract="D4")
def test_d4_cache_key_has_dtype_and_device(ctx: Any) -> None:
    """A buffer cached for one dtype (or device) is never handed out for another."""
    from impl.zero.gather import BufferPool, ParamGatherer

    W = ctx.world_size
    pool = BufferPool()
    f32, s32 = _shards(ctx, [(13, 7)], torch.float32)
    b16, s16 = _shards(ctx, [(13, 7)], torch.bfloat16)
    g32 = ParamGatherer(s32, _group(), pool=pool)
    g16 = ParamGatherer(s16, _group(), pool=pool)
    for _ in range(3):
        a = g32.gather(0)
        assert a.dtype == torch.float32 and torch.equal(a, f32[0])
        g32.release(0)
        b = g16.gather(0)
        assert b.dtype == torch.bfloat16 and torch.equal(b, b16[0]), "a reused buffer had the wrong dtype"
        g16.release(0)
    assert pool.allocations == (2 if W > 1 else 0), f"one buffer per dtype expected, {pool.allocations} allocated"
    cpu = pool.acquire(8, torch.float32, "cpu")
    meta = pool.acquire(8, torch.float32, "meta")
    assert cpu.device.type == "cpu" and meta.device.type == "meta", "the device is part of the cache key"
    pool.release(cpu)
    pool.release(meta)
    again = pool.acquire(8, torch.float32, "meta")
    assert again.device.type == "meta"


# -- D5 ---------------------------------------------------------------------------------------------

#: Uneven layouts as functions of W (zero-size shards included).
UNEVEN: dict[str, Callable[[int], list[int]]] = {
    "balanced-13": lambda w: [13 // w + (1 if r < 13 % w else 0) for r in range(w)],
    "zero-first": lambda w: [0] * (w - 1) + [5],
    "zero-last": lambda w: [5] + [0] * (w - 1),
    "alternating": lambda w: [3 if r % 2 == 0 else 0 for r in range(w)],
    "all-zero": lambda w: [0] * w,
    "growing": lambda w: [2 * r + 1 for r in range(w)],
}


def _check_uneven(ctx: Any, counts: list[int], impl: str) -> None:
    """Rank r holds ``counts[r]`` elements of a shared tensor; the gather must be the exact concatenation
    and equal the pure-torch reference compaction of the padded buffer."""
    from impl.ops import compact_reference
    from impl.zero.gather import ParamGatherer
    from impl.zero.partition import partition, uneven_layout

    n = sum(counts)
    full = _values((n,))
    layout = uneven_layout((n,), counts)
    shard = partition("u", full, layout, ctx.rank)
    assert shard.tensor.numel() == counts[ctx.rank], "an uneven shard stores exactly its count"
    stats, comm = _stats()
    gatherer = ParamGatherer([shard], _group(), comm=comm, impl=impl)  # type: ignore[arg-type]
    got = gatherer.gather(0)
    p = max(counts)
    padded = torch.zeros(len(counts) * p)
    for r, c in enumerate(counts):
        padded[r * p : r * p + c] = full[layout.offset(r) : layout.offset(r) + c]
    want = compact_reference(padded, counts)
    assert torch.equal(want, full), "reference compaction is not the concatenation (test bug)"
    assert torch.equal(got, want), f"counts={counts}: got {got.tolist()}, want {want.tolist()}"
    issued = sum(stats.total.values())
    assert issued == (1 if ctx.world_size > 1 and p > 0 else 0), f"counts={counts}: issued {dict(stats.total)}"
    if ctx.world_size > 1 and p > 0:
        assert gatherer.compactions == 1, "one padded all-gather, then exactly one compaction"


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("layout", list(UNEVEN))
@dstest.spec(world_size=WORLD_SIZES, contract="D5")
def test_d5_uneven_gather_is_exact_concatenation(ctx: Any, layout: str, impl: str) -> None:
    """Each named uneven layout (zero-size shards included) gathers to the exact concatenation."""
    _check_uneven(ctx, UNEVEN[layout](ctx.world_size), impl)


def _share_counts(counts: list[int] | None, world_size: int) -> list[int] | None:
    """Rank 0's counts (or None: stop) on every rank: one broadcast of [flag, counts...]."""
    from impl.comm.collectives import broadcast

    msg = torch.zeros(1 + world_size, dtype=torch.int64)
    if counts is not None:
        msg[0] = 1
        msg[1:] = torch.tensor(counts)
    broadcast(msg, 0, _group())
    return msg[1:].tolist() if msg[0] == 1 else None


@dstest.spec(world_size=WORLD_SIZES, contract="D5")
def test_d5_hypothesis_layouts_equal_reference(ctx: Any) -> None:
    """Hypothesis draws the layouts (zero-size shards weighted in) on rank 0 and broadcasts each one; every
    rank gathers with the native op; a failure on any rank fails the example (and aborts the world)."""
    from hypothesis import HealthCheck, given, settings

    from dstest.strategies import shard_counts

    W = ctx.world_size
    if ctx.rank != 0:
        while (counts := _share_counts(None, W)) is not None:
            _check_uneven(ctx, counts, "native")
        return

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(shard_counts(world_size=W, max_count=17))
    def drive(counts: tuple[int, ...]) -> None:
        _share_counts(list(counts), W)
        _check_uneven(ctx, list(counts), "native")

    try:
        drive()
    finally:
        _share_counts(None, W)


# -- D6 ---------------------------------------------------------------------------------------------


@dstest.spec(world_size=WORLD_SIZES, contract="D6")
def test_d6_grouped_prefetch_is_one_launch(ctx: Any) -> None:
    """Several parameters prefetched together: one all-gather (each rank sends ΣP_t with P_t the single
    gather's ceil(N_t/W)), one compaction, results equal to single gathers, views of one buffer."""
    from impl.zero.gather import ParamGatherer

    W = ctx.world_size
    shapes = [SIZE_KINDS[k](W) for k in SIZE_KINDS]
    fulls, shards = _shards(ctx, shapes)
    stats, comm = _stats()
    grouped = ParamGatherer(shards, _group(), comm=comm)
    views = grouped.gather_many(range(len(shards)))
    for v, f in zip(views, fulls, strict=True):
        assert v.shape == f.shape and torch.equal(v, f)
    if W > 1:
        assert sum(stats.total.values()) == 1 and grouped.launches == 1, f"issued {dict(stats.total)}"
        assert grouped.compactions == 1
        want_row = sum(math.ceil(f.numel() / W) for f in fulls)
        assert grouped.last_row == want_row, (
            f"each rank sent {grouped.last_row}, single-gather formula gives {want_row}"
        )
        storages = {v.untyped_storage().data_ptr() for v in views if v.numel()}
        assert len(storages) == 1, "the prefetched parameters must be views of one buffer"
    else:
        assert sum(stats.total.values()) == 0
    singles = ParamGatherer(shards, _group())
    for i, v in enumerate(views):
        assert torch.equal(singles.gather(i), v), f"grouped and single gathers of p{i} differ"


# -- the checks catch broken implementations (mutants) -------------------------------------------------


def _body(spec_fn: Callable[..., Any]) -> Callable[..., Any]:
    """The rank body behind a ``@dstest.spec`` test, to run it with :func:`dstest.run`."""
    info = spec_info(spec_fn)
    assert info is not None
    return info.fn


@pytest.mark.cpu
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_d2_check_fails_when_the_check_compares_metadata(monkeypatch: pytest.MonkeyPatch, world_size: int) -> None:
    """A check that sends the layout's P instead of the real shard size passes every correct run and
    misses the corruption: the D2 check must fail on it."""
    body = _body(test_d2_corrupted_shard_is_caught)
    dstest.run(body, world_size, kwargs={"corruption": "short"})  # the real check: the spec passes

    import impl.zero.partition as partition_mod

    monkeypatch.setattr(partition_mod, "_local_sizes", lambda shards: [s.layout.stored(s.rank) for s in shards])
    with pytest.raises(RankFailure, match="DID NOT RAISE"):
        dstest.run(body, world_size, kwargs={"corruption": "short"})


@pytest.mark.cpu
def test_d2_check_fails_when_the_check_is_one_collective_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registration check that issues one collective per parameter fails the D2 count."""
    import impl.zero.partition as partition_mod

    original = partition_mod.check_registration

    def per_parameter(shards: Any, group: Any, *, comm: Any = None) -> None:
        for s in shards:
            original([s], group, comm=comm)

    body = _body(test_d2_registration_check_is_one_collective)
    dstest.run(body, 3)
    monkeypatch.setattr(partition_mod, "check_registration", per_parameter)
    with pytest.raises(RankFailure, match="expected 1 collective"):
        dstest.run(body, 3)
