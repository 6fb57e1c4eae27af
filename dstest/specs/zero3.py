"""SPEC part D: ZeRO-3 parameters with uneven shards and the allgather kernel; B2 and B8 at stage 3.

Component specs (D1-D6) drive impl's stage-3 pieces directly (:mod:`impl.zero.partition`,
:mod:`impl.zero.gather`): they ask questions about buffers and launches that only the implementation can
answer. Engine specs (D1, D7, D8, B2, B8) go through ``ctx.target`` and skip a target without stage 3.

Parameter sizes cover 0, 1, W-1, W+1, primes and hidden size 13 (:data:`SIZE_KINDS`). Every tensor is
the same on every rank unless it is data (which differs per rank), so any rank can build the exact
reference.
"""

from __future__ import annotations

import gc
import math
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.specs import assert_close_rel, batch, config, mse, reference_grads
from dstest.targets import require

__all__ = [
    "SIZE_KINDS",
    "Deep13",
    "Hidden13",
    "test_b2_stage3_sum_is_w_times_mean",
    "test_b8_stage3_sum_over_w_trains_like_mean",
    "test_d1_engine_partitions_to_p",
    "test_d1_every_rank_holds_p_elements",
    "test_d2_corrupted_shard_is_caught",
    "test_d2_registration_check_is_one_collective",
    "test_d3_gather_is_a_view_of_the_padded_buffer",
    "test_d4_cache_key_has_dtype_and_device",
    "test_d4_regather_allocates_nothing",
    "test_d5_hypothesis_layouts_equal_reference",
    "test_d5_uneven_gather_is_exact_concatenation",
    "test_d6_grouped_prefetch_is_one_launch",
    "test_d7_stage3_trains_like_stage0",
    "test_d8_state_is_partitioned_between_steps",
]

WORLD_SIZES = [1, 2, 3, 4]

#: Parameter sizes that break naive partitioning, as functions of W.
SIZE_KINDS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "0": lambda w: (0,),
    "1": lambda w: (1,),
    "W-1": lambda w: (w - 1,),
    "W+1": lambda w: (w + 1,),
    "7": lambda w: (7,),
    "31": lambda w: (31,),
    "97": lambda w: (97,),
    "13x13": lambda w: (13, 13),
    "13x7": lambda w: (13, 7),
    "0x5": lambda w: (0, 5),
}


def _values(shape: tuple[int, ...], salt: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct non-zero values, the same on every rank (so zero padding is recognisable)."""
    n = math.prod(shape)
    values: torch.Tensor = (torch.arange(n, dtype=torch.float64) * 0.5 + 1 + 1000 * salt).to(dtype)
    return values.reshape(shape)


def _group() -> Any:
    return dist.group.WORLD


def _stats() -> Any:
    from impl.comm import Comm, CommStats

    stats = CommStats()
    return stats, Comm(stats)


def _shards(ctx: Any, shapes: Iterable[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[Any]]:  # fmt: skip
    from impl.zero.partition import partition_parameters

    fulls = [_values(s, i, dtype) for i, s in enumerate(shapes)]
    _, shards = partition_parameters([(f"p{i}", f) for i, f in enumerate(fulls)], ctx.world_size, ctx.rank)
    return fulls, shards


# -- D1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SIZE_KINDS))
@dstest.spec(world_size=WORLD_SIZES, contract="D1")
def test_d1_every_rank_holds_p_elements(ctx: Any, kind: str) -> None:
    """Every rank holds P = ceil(N/W) elements; the shards side by side are the parameter then zeros."""
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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


class Hidden13(torch.nn.Module):
    """Hidden size 13; parameter sizes 65, 13, 169, 13, 13, 65, 5 (none divisible by 2, 3 or 4)."""

    d_in, d_out = 5, 5

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 13)
        self.mid = torch.nn.Linear(13, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.out = torch.nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.norm(torch.tanh(self.mid(h)))
        out: torch.Tensor = self.out(h)
        return out


class Deep13(torch.nn.Module):
    """Six Linear(13, 13) layers with tanh between: a model much larger than any one of its layers."""

    d_in, d_out = 13, 13

    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(13, 13) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _AllSizes(torch.nn.Module):
    """One parameter of every size in SIZE_KINDS (for W), used as an additive bias so all get gradients."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.shapes = {k: f(world_size) for k, f in SIZE_KINDS.items()}
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(s)) for s in self.shapes.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum((p.sum() for p in self.ps), torch.zeros(()))


def _build(cls: Callable[[], torch.nn.Module], ctx: Any, seed: int = 1234) -> torch.nn.Module:
    model = cls()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 0.1)
    return model.to(ctx.device)


@dstest.spec(world_size=WORLD_SIZES, contract="D1")
def test_d1_engine_partitions_to_p(ctx: Any) -> None:
    """A stage-3 engine over parameters of every awkward size holds ΣP fp32 master elements per rank."""
    require(ctx.target, "stage3", "state_bytes")
    W = ctx.world_size
    model = _build(lambda: _AllSizes(W), ctx)
    numels = [p.numel() for p in model.parameters()]
    engine = ctx.target.initialize(model, config(3, "mean"))
    held = engine.state_bytes()
    want = 4 * sum(math.ceil(n / W) for n in numels)
    assert held["master_params"] == want, (
        f"W={W}: master parameters take {held['master_params']} bytes, expected 4·ΣP = {want} for sizes {numels}"
    )
    full = engine.full_parameters()
    for (name, _), n in zip(model.named_parameters(), numels, strict=True):
        assert full[name].numel() == n, f"{name}: full_parameters() has {full[name].numel()} elements, not {n}"


# -- D2 ---------------------------------------------------------------------------------------------

_D2_SHAPES = [(13, 7), (0,), (1,), (13,), (97,)]


@dstest.spec(world_size=WORLD_SIZES, contract="D2")
def test_d2_registration_check_is_one_collective(ctx: Any) -> None:
    """Correct shards pass; the check is one collective for all parameters (none at W = 1)."""
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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
    require(ctx.target, "impl_components")  # about impl's pieces, whatever the target
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


# -- D7 ---------------------------------------------------------------------------------------------


def _train(ctx: Any, engine: Any, step: int, model_cls: type, scale: float = 1.0) -> float:
    x, y = batch(ctx.seed, ctx.rank, step, d_in=model_cls.d_in, d_out=model_cls.d_out, device=ctx.device)  # type: ignore[attr-defined]
    loss = mse(engine(x), y)
    engine.backward(loss * scale if scale != 1.0 else loss)
    return float(loss.detach())


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@dstest.spec(world_size=[1, 2, 3], contract="D7")
def test_d7_stage3_trains_like_stage0(ctx: Any, optimizer: str) -> None:
    """5 steps, hidden size 13 (no parameter size divisible by W): same losses and fp32 parameters
    (relative 1e-6) at stage 3 as at stage 0."""
    require(ctx.target, "stage0", "stage3")
    engines = {
        s: ctx.target.initialize(_build(Hidden13, ctx), config(s, "mean", optimizer=optimizer, lr=0.05)) for s in (0, 3)
    }
    for step in range(5):
        losses = {}
        for s, engine in engines.items():
            losses[s] = _train(ctx, engine, step, Hidden13)
            engine.step()
        assert abs(losses[3] - losses[0]) <= 1e-6 * abs(losses[0]), f"step {step}: loss {losses[3]} != {losses[0]}"
        assert_close_rel(
            engines[3].full_parameters(), engines[0].full_parameters(), 1e-6, f"step {step}: fp32 parameters"
        )


# -- D8 ---------------------------------------------------------------------------------------------

_STOP_TYPES: tuple[type, ...] = (types.ModuleType, type, dist.ProcessGroup)


def _reachable_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and closures (with ``.grad``),
    stopping at modules, classes and process groups (which lead to other ranks' state)."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _STOP_TYPES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            continue
        if type(obj).__module__.startswith(("dstest.worlds", "torch.distributed")):
            continue
        stack.extend(gc.get_referents(obj))
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t.layout != torch.strided or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        out[s.data_ptr()] = max(out.get(s.data_ptr(), 0), s.nbytes())
    return out


@dstest.spec(world_size=WORLD_SIZES, contract="D8")
def test_d8_state_is_partitioned_between_steps(ctx: Any) -> None:
    """Between steps: no parameter holds data; master params, gradients and AdamW state are ΣP fp32
    elements each; all tensors reachable from the engine add up to that plus communication buffers
    bounded by one layer, not the model. During forward only the running layer is gathered."""
    require(ctx.target, "stage3", "state_bytes", "comm_buffer_bytes")
    W = ctx.world_size
    depth = 6
    model = _build(lambda: Deep13(depth), ctx)
    layers = list(model.layers)  # type: ignore[arg-type]
    numels = [p.numel() for p in model.parameters()]
    layer_numel = 13 * 13 + 13
    share = 4 * sum(math.ceil(n / W) for n in numels)
    full = 4 * sum(numels)
    cfg = config(3, "mean", optimizer="AdamW", zero={"reduce_bucket_size": layer_numel})
    engine = ctx.target.initialize(model, cfg)

    seen_during_forward: list[tuple[int, list[int]]] = []

    def probe(k: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
            seen_during_forward.append((k, sizes))

        return hook

    for k, layer in enumerate(layers):
        # registered after the engine's hooks: runs after the gather, before the release
        layer.register_forward_hook(probe(k), prepend=True)

    for step in range(3):
        seen_during_forward.clear()
        _train(ctx, engine, step, Deep13)
        engine.step()
        for k, sizes in seen_during_forward:
            want = [layer_numel if j == k else 0 for j in range(depth)]
            assert sizes == want, f"step {step}, layer {k} running: gathered sizes per layer {sizes}, want {want}"
        for name, p in model.named_parameters():
            assert p.numel() == 0 and p.grad is None, f"step {step}: {name} still holds {p.numel()} elements"
        held = engine.state_bytes()
        for key, want in (("master_params", share), ("gradients", share), ("optimizer_state", 2 * share)):
            assert held[key] == want, f"step {step}: {key} = {held[key]} bytes, expected ΣP·4 = {want}"
        comm = engine.comm_buffer_bytes()
        # One layer's worth: the grouped gather's result (N) with its send row and W-row receive buffer,
        # and one bucket's reduce-scatter staging (W rows in, one row out); a row is ΣP of the layer.
        row = math.ceil(13 * 13 / W) + math.ceil(13 / W)
        bound = 4 * (layer_numel + 2 * (W + 1) * row) if W > 1 else 0
        assert comm <= bound, f"step {step}: comm buffers hold {comm} bytes, more than one layer's {bound}"
        if W > 1:
            assert comm < full, f"comm buffers ({comm} bytes) as large as the whole model ({full})"
        alive = sum(_storage_bytes(_reachable_tensors(engine)).values())
        assert alive <= 4 * share + comm + 4 * 64, (
            f"step {step}: {alive} bytes of tensors alive, partitioned state is {4 * share} + comm {comm}"
        )


# -- B2, B8 at stage 3 --------------------------------------------------------------------------------

#: Stage-3 reduction paths: zero_optimization extras, top-level extras.
STAGE3_PATHS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "reduce_scatter": ({}, {}),
    "all_reduce_fallback": ({"reduce_scatter": False}, {}),
    "non_contiguous": ({"contiguous_gradients": False}, {}),
    "small_buckets": ({"reduce_bucket_size": 8}, {}),
    "overlap": ({"overlap_comm": True, "reduce_bucket_size": 8}, {}),
    "accumulation": ({}, {"gradient_accumulation_steps": 2}),
}


def _stage3_step(ctx: Any, engine: Any, step: int, gas: int, scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor]]:  # fmt: skip
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for k in range(gas):
        losses.append(_train(ctx, engine, step * gas + k, Hidden13, scale))
        if k == gas - 1:
            grads = engine.full_gradients()
        engine.step()
    return sum(losses) / gas, grads


@pytest.mark.parametrize("path", list(STAGE3_PATHS))
@dstest.spec(world_size=[1, 2, 3], contract="B2")
def test_b2_stage3_sum_is_w_times_mean(ctx: Any, path: str) -> None:
    """Stage 3: mean is (1/W)·Σ g_r (fp64 reference), sum is Σ g_r = W x mean, on every reduction path."""
    require(ctx.target, "stage3")
    zero, top = STAGE3_PATHS[path]
    gas = top.get("gradient_accumulation_steps", 1)
    W = ctx.world_size
    batches = [[batch(ctx.seed, r, k, d_in=Hidden13.d_in, d_out=Hidden13.d_out) for k in range(gas)] for r in range(W)]
    got = {}
    for op in ("mean", "sum"):
        engine = ctx.target.initialize(_build(Hidden13, ctx), config(3, op, zero=zero, **top))
        _, got[op] = _stage3_step(ctx, engine, 0, gas)
        want = reference_grads(lambda: _build(Hidden13, ctx), batches, op)
        assert_close_rel(got[op], want, 1e-6, f"{op} at stage 3, path {path}")
    assert_close_rel(got["sum"], {k: W * v for k, v in got["mean"].items()}, 1e-6, "sum vs W x mean")


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@dstest.spec(world_size=[1, 2, 3], contract="B8")
def test_b8_stage3_sum_over_w_trains_like_mean(ctx: Any, optimizer: str) -> None:
    """Stage 3, 5 steps: a "sum" run whose loss is divided by W matches a "mean" run step by step."""
    require(ctx.target, "stage3")
    W = ctx.world_size
    mean = ctx.target.initialize(_build(Hidden13, ctx), config(3, "mean", optimizer=optimizer, lr=0.05))
    summ = ctx.target.initialize(_build(Hidden13, ctx), config(3, "sum", optimizer=optimizer, lr=0.05))
    for step in range(5):
        loss_m, grads_m = _stage3_step(ctx, mean, step, 1)
        loss_s, grads_s = _stage3_step(ctx, summ, step, 1, scale=1.0 / W)
        assert abs(loss_m - loss_s) <= 1e-6 * max(abs(loss_m), 1e-12), f"step {step}: loss {loss_s} != {loss_m}"
        assert_close_rel(grads_s, grads_m, 1e-6, f"step {step}: full gradients")
        assert_close_rel(summ.full_parameters(), mean.full_parameters(), 1e-6, f"step {step}: fp32 parameters")
