"""Checking the checkers: the core matching of both worlds (contract E2), as properties.

The rules both simulated worlds match collectives by live in :mod:`dstest.worlds.core.matching` (the
``Exchange`` of one collective, point-to-point ``Transfers``, ``signature``, the deadlock rule and the
texts), in the ``Call`` classes' ``key``/``check_peer``/``check_all``, and in the c10d table of
:mod:`dstest.worlds.core.c10d`. These properties drive those pieces directly, in pure Python, over random
collectives of random groups of random worlds:

- every rank making the same call matches (no error), whatever the arrival order, shapes or strictness;
- one perturbation of one rank's call (the op, the dtype, the element count, the shape under
  ``strict_shapes``, the device, the root, the reduce op, the split sizes or sizes of one pairing) is
  refused with a message that names the perturbed rank, another rank, and both calls, whose descriptions
  differ (so the difference is visible);
- sequences of calls refereed as the process world referees them (:class:`Referee`, fed the messages a
  worker sends): identical programs end with every call answered "ok"; one rank missing a call, making an
  extra one, swapping two, using other group members or another group, or sending with another tag or to
  another peer makes a rank fail with a text naming the perturbed rank, and no rank is left waiting;
- the same c10d call gives the same key and description in both worlds (tensors in the threaded world,
  pickled metadata in the process world), however its arguments are passed.

A small fixed sample then runs through ``dstest.run`` on the threaded and the process world, to show that
each world applies the same rule. See docs/checking-the-checkers.md.
"""

from __future__ import annotations

import pickle
import random
import re
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st

import dstest
from dstest.errors import CollectiveMismatch, RankFailure
from dstest.worlds import collectives as C
from dstest.worlds.core import c10d, matching
from dstest.worlds.process.messages import Dev, Meta
from dstest.worlds.process.referee import Referee

pytestmark = pytest.mark.cpu

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
REDUCE_OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"]
OPS = sorted(C.CALLS)
ROOTED = {"reduce", "broadcast", "gather", "scatter"}
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}


# -- one collective, as every rank of its group would call it ----------------------------------------------
@dataclass(frozen=True)
class Coll:
    """One collective of a group of ``n`` ranks; :func:`build` makes group rank ``r``'s ``Call`` of it."""

    op: str
    n: int
    dtype: Any
    shape: tuple[int, ...]
    root: int
    reduce_op: str
    sizes: tuple[tuple[int, ...], ...]  # all_gather: each rank's input shape
    pairs: tuple[tuple[tuple[int, ...], ...], ...]  # all_to_all: pairs[i][j], the shape rank i sends to j
    splits: tuple[tuple[int, ...], ...]  # all_to_all_single: splits[i][j], the rows rank i sends to j
    tail: tuple[int, ...]  # all_to_all_single: the shape of one row
    device: str = "cpu"
    tensors: bool = False  # real tensors (the threaded world's buffers) or metadata (the process world's)


def buf(c: Coll, shape: tuple[int, ...]) -> Any:
    if c.tensors:
        return torch.empty(shape, dtype=c.dtype, device="cpu" if c.device == "cpu" else "meta")
    return Meta(c.dtype, tuple(shape), Dev(c.device))


def build(c: Coll, r: int) -> C.Call:
    """Group rank ``r``'s side of ``c``, valid on that rank alone (``check_local`` passes)."""
    n, b = c.n, (lambda s: buf(c, s))
    op = c.op
    call: C.Call
    if op == "all_reduce":
        call = C.AllReduce(r, n, b(c.shape), c.reduce_op)
    elif op == "reduce":
        call = C.Reduce(r, n, b(c.shape), c.reduce_op, c.root)
    elif op == "broadcast":
        call = C.Broadcast(r, n, b(c.shape), c.root)
    elif op == "all_gather":
        call = C.AllGather(r, n, [b(s) for s in c.sizes], b(c.sizes[r]))
    elif op == "all_gather_into_tensor":
        call = C.AllGatherIntoTensor(r, n, b((n, *c.shape)), b(c.shape))
    elif op == "reduce_scatter":
        call = C.ReduceScatter(r, n, b(c.shape), [b(c.shape) for _ in range(n)], c.reduce_op)
    elif op == "reduce_scatter_tensor":
        call = C.ReduceScatterTensor(r, n, b(c.shape), b((n, *c.shape)), c.reduce_op)
    elif op == "all_to_all":
        call = C.AllToAll(r, n, [b(c.pairs[i][r]) for i in range(n)], [b(c.pairs[r][j]) for j in range(n)])
    elif op == "all_to_all_single":
        ins, outs = [c.splits[r][j] for j in range(n)], [c.splits[i][r] for i in range(n)]
        call = C.AllToAllSingle(r, n, b((sum(outs), *c.tail)), b((sum(ins), *c.tail)), outs, ins)
    elif op == "gather":
        call = C.Gather(r, n, [b(c.shape) for _ in range(n)] if r == c.root else [], b(c.shape), c.root)
    elif op == "scatter":
        call = C.Scatter(r, n, b(c.shape), [b(c.shape) for _ in range(n)] if r == c.root else [], c.root)
    else:
        assert op == "barrier", op
        call = C.Barrier(r, n)
    call.check_local()
    return call


small_shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@st.composite
def colls(draw: st.DrawFn, n: int | None = None, ops: list[str] | None = None) -> Coll:
    n = draw(st.integers(1, 6)) if n is None else n
    op = draw(st.sampled_from(ops or OPS))
    sizes = tuple(draw(small_shapes) for _ in range(n))
    pairs = tuple(tuple(draw(small_shapes) for _ in range(n)) for _ in range(n))
    splits = tuple(tuple(draw(st.integers(0, 3)) for _ in range(n)) for _ in range(n))
    return Coll(
        op=op,
        n=n,
        dtype=draw(st.sampled_from(DTYPES)),
        shape=draw(small_shapes),
        root=draw(st.integers(0, n - 1)),
        reduce_op=draw(st.sampled_from(REDUCE_OPS)),
        sizes=sizes,
        pairs=pairs,
        splits=splits,
        tail=draw(st.lists(st.integers(1, 3), max_size=2).map(tuple)),
        tensors=draw(st.booleans()),
    )


@st.composite
def groups(draw: st.DrawFn, min_size: int = 1) -> tuple[int, tuple[int, ...], str]:
    """(world size, the group's global ranks, its name): the world group ("0") or a subgroup."""
    world = draw(st.integers(max(2, min_size), 8))
    members = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=min_size, max_size=world))))
    name = "0" if len(members) == world and draw(st.booleans()) else str(draw(st.integers(1, 9)))
    return world, members, name


def other_shape(shape: tuple[int, ...], draw: st.DrawFn) -> tuple[int, ...]:
    """A shape with another element count."""
    numel = _numel(shape)
    new = draw(small_shapes.filter(lambda s: _numel(s) != numel))
    return new


def same_count_other_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Another shape with the same element count (as gloo and NCCL move flat buffers, a legal difference)."""
    numel = _numel(shape)
    return (numel,) if tuple(shape) != (numel,) else (numel, 1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def join_all(ex: matching.Exchange, calls: dict[int, C.Call], order: list[int]) -> str | None:
    """Join the calls (by group rank) in ``order``; the first refusal, or the verdict once all joined."""
    for r in order:
        why = ex.join(calls[r])
        if why is not None:
            return why
    assert ex.missing == 0
    return ex.verdict()


_JOIN = re.compile(
    r"^collective mismatch on group (?P<label>.+) \(seq (?P<seq>\d+)\): rank (?P<a>\d+) called (?P<da>.+) "
    r"but rank (?P<b>\d+) called (?P<db>.+) \((?P<why>[^()]*)\)$"
)
_VERDICT = re.compile(
    r"^collective mismatch on group (?P<label>.+) \(seq (?P<seq>\d+)\): (?P<why>.+); calls: (?P<calls>.+)$"
)


# -- every rank the same: no error -----------------------------------------------------------------------------
@given(g=groups(), data=st.data(), strict=st.booleans(), seq=st.integers(1, 1000))
def test_identical_calls_match_in_any_arrival_order(
    g: tuple[int, tuple[int, ...], str], data: Any, strict: bool, seq: int
) -> None:
    world, members, name = g
    coll = data.draw(colls(n=len(members)))
    calls = {r: build(coll, r) for r in range(coll.n)}
    for call in calls.values():
        call.strict_shapes = strict
    ex = matching.Exchange(members, matching.group_label(name, members, world), seq)
    order = data.draw(st.permutations(range(coll.n)))
    assert join_all(ex, calls, order) is None
    assert ex.waiting_for() == [] and ex.left(set(members)) is None
    assert [c.group_rank for c in ex.calls] == list(range(coll.n))


@given(data=st.data())
def test_premul_sum_factors_may_differ_across_ranks(data: Any) -> None:
    """NCCL matches a premul_sum on the op, each rank with its own factor: so must both worlds."""
    coll = replace(data.draw(colls(n=data.draw(st.integers(2, 5)), ops=sorted(REDUCING))), reduce_op="premul_sum")
    calls = {}
    for r in range(coll.n):
        call = build(coll, r)
        call.reduce_op = C.PremulSum(data.draw(st.floats(-4, 4)))
        calls[r] = call
    ex = matching.Exchange(tuple(range(coll.n)), "world", 1)
    assert join_all(ex, calls, data.draw(st.permutations(range(coll.n)))) is None


@given(data=st.data())
def test_same_count_other_shape_matches_unless_strict(data: Any) -> None:
    """Contract E2: ranks agree on element counts (both backends move flat buffers); ``strict_shapes``
    also refuses other shapes, naming both ranks and both calls."""
    ops = [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "scatter",
    ]
    coll = data.draw(colls(n=data.draw(st.integers(2, 6)), ops=ops))
    bad = data.draw(st.integers(0, coll.n - 1))
    odd = replace(coll, shape=same_count_other_shape(coll.shape))
    order = data.draw(st.permutations(range(coll.n)))
    for strict in (False, True):
        calls = {r: build(odd if r == bad else coll, r) for r in range(coll.n)}
        for call in calls.values():
            call.strict_shapes = strict
        why = join_all(matching.Exchange(tuple(range(coll.n)), "world", 1), calls, order)
        if not strict:
            assert why is None, why
        else:
            _assert_names_both(why, bad, calls, tuple(range(coll.n)))


# -- one rank's call perturbed: refused, naming both ranks and both calls ----------------------------------
PERTURBATIONS = ["op", "dtype", "count", "strict_shape", "device", "root", "reduce_op", "splits", "pairing"]


def perturb(kind: str, c: Coll, bad: int, draw: st.DrawFn) -> Coll | None:
    """``c`` as rank ``bad`` calls it after one perturbation of ``kind`` (None: the op has no such argument)."""
    op = c.op
    if kind == "op":
        return replace(c, op=draw(st.sampled_from([o for o in OPS if o != op])))
    if op == "barrier":
        return None
    if kind == "dtype":
        return replace(c, dtype=draw(st.sampled_from([d for d in DTYPES if d != c.dtype])))
    if kind == "device":
        return replace(c, device="meta")
    if kind == "root":
        return replace(c, root=draw(st.sampled_from([r for r in range(c.n) if r != c.root]))) if op in ROOTED else None
    if kind == "reduce_op":
        if op not in REDUCING:
            return None
        return replace(c, reduce_op=draw(st.sampled_from([o for o in REDUCE_OPS if o != c.reduce_op])))
    if kind in ("count", "strict_shape"):
        change = (lambda s: other_shape(s, draw)) if kind == "count" else same_count_other_shape
        if op == "all_gather":  # the size bad expects of rank j (j == bad: its own input too)
            j = draw(st.integers(0, c.n - 1))
            return replace(c, sizes=tuple(change(s) if i == j else s for i, s in enumerate(c.sizes)))
        if op == "all_to_all":  # what bad sends to another rank j, or expects from it
            j = draw(st.sampled_from([i for i in range(c.n) if i != bad]))
            pairs = [list(p) for p in c.pairs]
            if draw(st.booleans()):
                pairs[bad][j] = change(pairs[bad][j])
            else:
                pairs[j][bad] = change(pairs[j][bad])
            return replace(c, pairs=tuple(tuple(p) for p in pairs))
        if op == "all_to_all_single":
            return replace(c, tail=change(c.tail)) if kind == "count" else None  # the rows' shape is compared whole
        return replace(c, shape=change(c.shape))
    if kind == "splits" and op == "all_to_all_single":  # one more row to another rank j, or expected from it
        j = draw(st.sampled_from([i for i in range(c.n) if i != bad]))
        splits = [list(s) for s in c.splits]
        if draw(st.booleans()):
            splits[bad][j] += 1
        else:
            splits[j][bad] += 1
        return replace(c, splits=tuple(tuple(s) for s in splits))
    if kind == "pairing" and op == "all_to_all":  # what bad sends to j and expects from j, swapped
        j = draw(st.sampled_from([i for i in range(c.n) if i != bad]))
        if _numel(c.pairs[bad][j]) == _numel(c.pairs[j][bad]):
            return None  # nothing changes (non-strict: the element counts are compared)
        return replace(c, pairs=_transposed_pair(c.pairs, bad, j))
    return None


def _transposed_pair(pairs: tuple[tuple[tuple[int, ...], ...], ...], a: int, b: int) -> Any:
    """Rank ``a`` swaps what it sends to ``b`` with what it expects from ``b`` (a classic pairing slip)."""
    p = [list(row) for row in pairs]
    p[a][b], p[b][a] = p[b][a], p[a][b]
    return tuple(tuple(row) for row in p)


def _assert_names_both(why: str | None, bad: int, calls: dict[int, C.Call], members: tuple[int, ...]) -> None:
    """The refusal names the perturbed rank (as a global rank), another rank, and both ranks' calls."""
    assert why is not None, "the perturbed call was accepted"
    bad_global = members[bad]
    m = _JOIN.match(why)
    if m is not None:
        a, b = int(m["a"]), int(m["b"])
        assert bad_global in (a, b) and a != b, why
        assert {a, b} <= set(members), why
        by_global = {members[r]: c for r, c in calls.items()}
        assert m["da"] == by_global[a].describe() and m["db"] == by_global[b].describe(), why
        assert m["da"] != m["db"], f"both calls read the same: the difference is not shown: {why}"
        return
    m = _VERDICT.match(why)
    assert m is not None, why
    named = [int(x) for x in re.findall(r"\brank (\d+)", m["why"])]
    assert bad_global in named and len(set(named)) >= 2, why
    assert set(named) <= set(members), f"names ranks outside the group {list(members)}: {why}"
    assert m["calls"] == "; ".join(f"rank {members[r]} called {calls[r].describe()}" for r in sorted(calls)), why


@given(g=groups(min_size=2), data=st.data(), strict=st.booleans(), kind=st.sampled_from(PERTURBATIONS))
def test_one_perturbed_call_is_refused_naming_both_ranks(
    g: tuple[int, tuple[int, ...], str], data: Any, strict: bool, kind: str
) -> None:
    world, members, name = g
    coll = data.draw(colls(n=len(members)))
    bad = data.draw(st.integers(0, coll.n - 1))
    odd = perturb(kind, coll, bad, data.draw)
    assume(odd is not None)
    assert odd is not None
    if kind == "strict_shape":
        strict = True
    calls = {r: build(odd if r == bad else coll, r) for r in range(coll.n)}
    for call in calls.values():
        call.strict_shapes = strict
    seq = data.draw(st.integers(1, 50))
    label = matching.group_label(name, members, world)
    ex = matching.Exchange(members, label, seq)
    order = data.draw(st.permutations(range(coll.n)))
    why = join_all(ex, calls, order)
    _assert_names_both(why, bad, calls, members)
    assert why is not None and why.startswith(f"collective mismatch on group {label} (seq {seq}): ")
    if kind == "op":
        assert why.endswith("(different collectives)")


@given(g=groups(min_size=2), data=st.data(), kind=st.sampled_from(["count", "splits", "pairing", "device"]))
def test_a_perturbed_pairing_is_refused_once_every_rank_joined(
    g: tuple[int, tuple[int, ...], str], data: Any, kind: str
) -> None:
    """What only all the calls together show (``check_all``: who sends what to whom in all_to_all and
    all_to_all_single): refused when the last rank joins, naming the pair and listing every call."""
    world, members, name = g
    coll = data.draw(colls(n=len(members), ops=["all_to_all", "all_to_all_single"]))
    bad = data.draw(st.integers(0, coll.n - 1))
    odd = perturb(kind, coll, bad, data.draw)
    # all_to_all_single's row shape and device type are in its key: refused as the rank joins
    assume(odd is not None and not (coll.op == "all_to_all_single" and kind in ("count", "device")))
    assert odd is not None
    calls = {r: build(odd if r == bad else coll, r) for r in range(coll.n)}
    label = matching.group_label(name, members, world)
    ex = matching.Exchange(members, label, 3)
    for r in data.draw(st.permutations(range(coll.n))):
        assert ex.join(calls[r]) is None, "the pairing is only refused once every rank joined"
    why = ex.verdict()
    assert why is not None and why.startswith(f"collective mismatch on group {label} (seq 3): rank ")
    _assert_names_both(why, bad, calls, members)


@given(g=groups(min_size=2), data=st.data())
def test_a_rank_that_never_joins_is_named_with_what_the_others_called(
    g: tuple[int, tuple[int, ...], str], data: Any
) -> None:
    world, members, name = g
    coll = data.draw(colls(n=len(members)))
    gone = data.draw(st.integers(0, coll.n - 1))
    ex = matching.Exchange(members, matching.group_label(name, members, world), 7)
    joined = [r for r in data.draw(st.permutations(range(coll.n))) if r != gone]
    for r in joined:
        assert ex.join(build(coll, r)) is None
    assert ex.missing == 1 and ex.waiting_for() == [members[gone]]
    assert ex.left({members[gone]}) == members[gone]
    assert ex.left({m for m in members if m != members[gone]}) is None
    text = ex.left_text(members[gone], "failed (ValueError: x)")
    first = joined[0]
    posted = "; ".join(f"rank {members[r]} called {build(coll, r).describe()}" for r in sorted(joined))
    assert text == (
        f"rank {members[gone]} failed (ValueError: x) without joining {build(coll, first).describe()} on "
        f"{ex.where} ({posted}): it can never complete"
    )


# -- p2p: Transfers and same_buffer ------------------------------------------------------------------------
@dataclass(frozen=True)
class Xfer:
    src: int
    dst: int
    tag: int
    dtype: Any
    shape: tuple[int, ...]


xfers = st.builds(
    Xfer,
    src=st.integers(0, 3),
    dst=st.integers(0, 3),
    tag=st.integers(0, 2),
    dtype=st.sampled_from(DTYPES),
    shape=small_shapes,
).filter(lambda x: x.src != x.dst)


def _meta(x: Xfer) -> Meta:
    return Meta(x.dtype, x.shape, Dev("cpu"))


def _post_all(
    transfers: list[tuple[Xfer, Xfer]], rnd: random.Random
) -> tuple[list[tuple[Any, Any]], matching.Transfers]:
    """Post each transfer's send (as the sender has it) and recv (as the receiver has it), each rank's posts
    in program order, the ranks interleaved at random. Returns the matched (send, recv) pairs."""
    posts: dict[int, list[tuple[str, int]]] = {}
    for i, (s, r) in enumerate(transfers):
        posts.setdefault(s.src, []).append(("send", i))
        posts.setdefault(r.dst, []).append(("recv", i))
    t = matching.Transfers()
    pairs = []
    while posts:
        rank = rnd.choice(sorted(posts))
        kind, i = posts[rank].pop(0)
        if not posts[rank]:
            del posts[rank]
        x = transfers[i][0 if kind == "send" else 1]
        side = (kind, i, x)
        other = t.match(("g", x.src, x.dst, x.tag), kind, side)
        if other is not None:
            pairs.append((side, other) if kind == "send" else (other, side))
    return pairs, t


@given(program=st.lists(xfers, max_size=12), seed=st.integers(0, 2**32), strict=st.booleans())
def test_p2p_posts_in_program_order_match_their_own_other_side(program: list[Xfer], seed: int, strict: bool) -> None:
    pairs, t = _post_all([(x, x) for x in program], random.Random(seed))
    assert not t and t.waiting() == []
    assert sorted(s[1] for s, _ in pairs) == list(range(len(program)))
    for send, recv in pairs:
        assert send[1] == recv[1]  # first in first out per (group, source, destination, tag)
        assert matching.same_buffer(_meta(send[2]), _meta(recv[2]), strict)


@given(
    program=st.lists(xfers, min_size=1, max_size=10),
    data=st.data(),
    kind=st.sampled_from(["dtype", "count", "strict_shape", "tag", "peer"]),
)
def test_a_perturbed_p2p_side_is_refused_or_left_waiting(program: list[Xfer], data: Any, kind: str) -> None:
    i = data.draw(st.integers(0, len(program) - 1))
    x = program[i]
    if kind == "dtype":
        y = replace(x, dtype=data.draw(st.sampled_from([d for d in DTYPES if d != x.dtype])))
    elif kind == "count":
        y = replace(x, shape=other_shape(x.shape, data.draw))
    elif kind == "strict_shape":
        y = replace(x, shape=same_count_other_shape(x.shape))
    elif kind == "tag":
        y = replace(x, tag=data.draw(st.sampled_from([t for t in range(4) if t != x.tag])))
    else:
        y = replace(x, dst=data.draw(st.sampled_from([d for d in range(4) if d not in (x.src, x.dst)])))
    pairs, t = _post_all(
        [(y, x) if j == i else (p, p) for j, p in enumerate(program)], random.Random(data.draw(st.integers(0, 99)))
    )
    if kind in ("tag", "peer"):  # one (source, destination, tag) lost a send another gained: a side waits
        assert t and t.waiting()
        return
    strict = kind == "strict_shape"
    (send, recv) = next((s, r) for s, r in pairs if s[1] == i)
    assert recv[1] == i
    assert not matching.same_buffer(_meta(send[2]), _meta(recv[2]), strict)
    assert matching.same_buffer(_meta(send[2]), _meta(recv[2]), True) is False
    if kind == "strict_shape":
        assert matching.same_buffer(_meta(send[2]), _meta(recv[2]), False)
    text = matching.p2p_mismatch_text(
        "group world",
        send[2].src,
        matching.p2p_describe("send", _meta(send[2]), send[2].dst, send[2].tag, "group world"),
        recv[2].dst,
        matching.p2p_describe("recv", _meta(recv[2]), recv[2].src, recv[2].tag, "group world"),
    )
    assert f"rank {x.src} called send(" in text and f"but rank {x.dst} called recv(" in text


@given(program=st.lists(xfers, min_size=1, max_size=10), seed=st.integers(0, 99), data=st.data())
def test_transfers_drop_takes_out_exactly_what_it_is_asked(program: list[Xfer], seed: int, data: Any) -> None:
    """What a rank that left the run had posted is dropped, and nothing else (Transfers.drop)."""
    sends = [(x, replace(x, tag=x.tag + 10)) for x in program]  # no send finds its recv: all wait
    _pairs, t = _post_all(sends, random.Random(seed))
    waiting = t.waiting()
    assert len(waiting) == 2 * len(program)
    rank = data.draw(st.integers(0, 3))
    mine = [s for s in waiting if (s[2].src if s[0] == "send" else s[2].dst) == rank]
    dropped = t.drop(lambda s: (s[2].src if s[0] == "send" else s[2].dst) == rank)
    assert sorted(map(repr, dropped)) == sorted(map(repr, mine))
    assert sorted(map(repr, t.waiting())) == sorted(repr(s) for s in waiting if s not in mine)
    assert bool(t) == bool(len(waiting) - len(mine))
    t.drop(lambda s: True)
    assert not t and t.queues == {}


# -- sequences of calls, refereed as the process world referees them ----------------------------------------
class _Conn:
    def __init__(self) -> None:
        self.inbox: list[tuple[Any, ...]] = []

    def send_bytes(self, blob: bytes) -> None:
        self.inbox.append(pickle.loads(blob))


@dataclass(frozen=True)
class Step:
    """One call of a rank's program: a collective ``coll`` on group ``gid`` of ``members``, or a transfer."""

    gid: str
    members: tuple[int, ...]
    coll: Coll | None = None
    p2p: tuple[str, int, int] | None = None  # (kind, peer's group rank, tag)


def referee(programs: dict[int, list[Step]], world: int, rnd: random.Random) -> dict[int, str | None]:
    """Run every rank's program against a process-world referee; each rank posts a call and waits for its
    verdict before the next, then reports that it finished; a rank that gets an error fails (reports
    "done" with the error) as a real rank would. Returns each rank's error (None: it finished). Fails if
    a rank is left waiting for ever (a hang)."""
    conns = [_Conn() for _ in range(world)]
    ref = Referee(1, world, conns)  # type: ignore[arg-type]
    pos = dict.fromkeys(programs, 0)
    seqs: dict[tuple[int, str], int] = {}
    waiting: dict[int, int] = {}  # rank -> post id it waits for
    result: dict[int, str | None] = {}

    def send(rank: int, *msg: Any) -> None:
        ref.handle(rank, pickle.dumps((msg[0], 1, *msg[1:])))

    def answer(rank: int, post_id: int) -> tuple[Any, ...] | None:
        return next((m for m in conns[rank].inbox if m[0] in ("ok", "err") and m[2] == post_id), None)

    while len(result) < len(programs):
        runnable = [r for r in sorted(programs) if r not in result and (r not in waiting or answer(r, waiting[r]))]
        assert runnable, f"ranks {sorted(waiting)} wait for ever: {ref.pending}"
        rank = rnd.choice(runnable)
        if rank in waiting:
            verdict = answer(rank, waiting.pop(rank))
            assert verdict is not None
            if verdict[0] == "err":
                result[rank] = verdict[4]
                send(rank, "done", False, f"CollectiveMismatch: {verdict[4]}".splitlines()[0][:300])
            continue
        if pos[rank] == len(programs[rank]):
            result[rank] = None
            send(rank, "done", True, "")
            continue
        step = programs[rank][pos[rank]]
        pos[rank] += 1
        post_id = pos[rank]
        me = step.members.index(rank)
        if step.coll is not None:
            seq = seqs[(rank, step.gid)] = seqs.get((rank, step.gid), 0) + 1
            send(rank, "post", post_id, step.gid, step.members, seq, build(step.coll, me))
        else:
            assert step.p2p is not None
            kind, peer, tag = step.p2p
            meta = Meta(torch.float32, (2,), Dev("cpu"))
            what = matching.p2p_describe(kind, meta, step.members[peer], tag, f"group {step.gid}")
            send(rank, "p2p", post_id, step.gid, step.members, kind, me, peer, tag, meta, what)
        waiting[rank] = post_id
        send(rank, "wait", post_id)
    assert not ref.blocked, ref.blocked
    if all(e is None for e in result.values()):  # nothing failed: nothing may be left half matched
        assert not ref.pending and not ref.exchanges and not ref.transfers
    return result


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, list[Step], list[tuple[int, int]]]:
    """A world and one program for all its ranks: collectives on the world group and on a subgroup of two
    or more ranks, and transfers (with their two ends; -1 for collectives)."""
    world = draw(st.integers(2, 5))
    sub = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=2, max_size=world))))
    steps: list[Step] = []
    ends: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(1, 5))):
        where = draw(st.sampled_from(["world", "sub", "p2p"]))
        if where == "p2p":
            a, b = draw(st.permutations(range(world)))[:2]
            steps.append(Step("0", tuple(range(world)), p2p=("send", b, draw(st.integers(0, 1)))))
            ends.append((a, b))
            continue
        gid, members = ("0", tuple(range(world))) if where == "world" else ("1", sub)
        steps.append(Step(gid, members, draw(colls(n=len(members)))))
        ends.append((-1, -1))
    return world, steps, ends


def per_rank(world: int, steps: list[Step], ends: list[tuple[int, int]]) -> dict[int, list[Step]]:
    """Each rank's own program: its groups' collectives, and its side of each transfer."""
    out: dict[int, list[Step]] = {r: [] for r in range(world)}
    for step, (a, b) in zip(steps, ends):
        if step.p2p is None:
            for r in step.members:
                out[r].append(step)
            continue
        _kind, _peer, tag = step.p2p
        out[a].append(Step(step.gid, step.members, p2p=("send", b, tag)))
        out[b].append(Step(step.gid, step.members, p2p=("recv", a, tag)))
    return out


def _must_differ(a: Step, b: Step, rank: int) -> bool:
    """Whether swapping ``a`` and ``b`` in ``rank``'s program is wrong whatever the peers do: two collectives
    on different groups (each needs the other's peers first), or on one group with calls that cannot
    match. (Two transfers to different peers may legally run in either order.)"""
    if a.coll is None or b.coll is None:
        return False
    if a.gid != b.gid:
        return True
    mine, theirs = build(a.coll, a.members.index(rank)), build(b.coll, b.members.index(rank))
    return type(mine) is not type(theirs) or mine.key() != theirs.key()


@given(prog=programs(), seed=st.integers(0, 2**16))
def test_identical_programs_are_refereed_without_error(prog: Any, seed: int) -> None:
    world, steps, ends = prog
    result = referee(per_rank(world, steps, ends), world, random.Random(seed))
    assert result == dict.fromkeys(range(world)), result


SEQUENCE_PERTURBATIONS = ["missing", "extra", "swap", "members", "other_group", "tag", "peer"]


@given(prog=programs(), seed=st.integers(0, 2**16), data=st.data(), kind=st.sampled_from(SEQUENCE_PERTURBATIONS))
def test_a_perturbed_program_fails_a_rank_naming_the_perturbed_rank(prog: Any, seed: int, data: Any, kind: str) -> None:
    world, steps, ends = prog
    ranks = per_rank(world, steps, ends)
    bad = data.draw(st.sampled_from([r for r in range(world) if ranks[r]]))
    mine = ranks[bad]
    k = data.draw(st.integers(0, len(mine) - 1))
    step = mine[k]
    if kind == "missing":
        mine.pop(k)
    elif kind == "extra":
        mine.insert(data.draw(st.integers(0, len(mine))), step)
    elif kind == "swap":
        assume(k + 1 < len(mine) and _must_differ(mine[k], mine[k + 1], bad))
        mine[k], mine[k + 1] = mine[k + 1], mine[k]
    elif kind == "members":  # the same group name, created with other ranks on this rank
        assume(step.coll is not None)
        assert step.coll is not None
        others = [m for m in range(world) if m != bad]
        members = tuple(sorted({bad, *data.draw(st.sets(st.sampled_from(others), min_size=1))}))
        assume(members != step.members)
        mine[k] = Step(step.gid, members, data.draw(colls(n=len(members), ops=[step.coll.op])))
    elif kind == "other_group":  # the same ranks, but another group
        mine[k] = replace(step, gid="9")
    elif kind == "tag":
        assume(step.p2p is not None)
        assert step.p2p is not None
        mine[k] = replace(step, p2p=(step.p2p[0], step.p2p[1], 7))
    else:
        assume(step.p2p is not None and world > 2)
        assert step.p2p is not None
        peer = data.draw(st.sampled_from([r for r in range(world) if r not in (bad, step.p2p[1])]))
        mine[k] = replace(step, p2p=(step.p2p[0], peer, step.p2p[2]))
    result = referee(ranks, world, random.Random(seed))
    errors = {r: e for r, e in result.items() if e is not None}
    assert errors, f"the perturbed program ({kind} on rank {bad}) passed"
    named = [r for r, e in errors.items() if re.search(rf"\brank {bad}\b", e)]
    assert named, errors
    for e in errors.values():  # every refusal names a pair of ranks (or every blocked rank of a deadlock)
        assert len(set(re.findall(r"\brank (\d+)", e))) >= 2, e


# -- deadlock: the rule and its text ---------------------------------------------------------------------------
@given(world=st.integers(1, 8), data=st.data())
def test_everyone_waits_exactly_when_no_rank_is_left_running(world: int, data: Any) -> None:
    states = data.draw(st.lists(st.sampled_from(["running", "blocked", "done"]), min_size=world, max_size=world))
    blocked, done = states.count("blocked"), states.count("done")
    assert matching.everyone_waits(world, blocked, done) == ("running" not in states and blocked > 0)


@given(world=st.integers(2, 6), data=st.data())
def test_the_deadlock_text_names_every_waiting_rank_and_what_it_waits_for(world: int, data: Any) -> None:
    states = data.draw(st.lists(st.sampled_from(["blocked", "done", "running"]), min_size=world, max_size=world))
    assume("blocked" in states)
    blocked = {
        r: (f"op{r}", data.draw(st.lists(st.integers(0, world - 1), unique=True, max_size=world)))
        for r, s in enumerate(states)
        if s == "blocked"
    }
    done = {r: matching.FINISHED if r % 2 else "failed (X: y)" for r, s in enumerate(states) if s == "done"}
    text = matching.deadlock_text(blocked, done)
    head, *lines = text.split("\n")
    assert head == (
        "deadlock: every rank still running waits for a collective that cannot complete "
        "(mismatched collectives, groups or peers):"
    )
    assert len(lines) == len(blocked)
    for line, r in zip(lines, sorted(blocked)):
        what, needs = blocked[r]
        state = {
            n: done[n] if n in done else f"waiting in {blocked[n][0]}" if n in blocked else "running" for n in needs
        }
        assert line == f"  rank {r} waits in {what} for " + ", ".join(f"rank {n} ({state[n]})" for n in needs)


# -- the c10d table: both worlds build the same call, however the arguments are passed -------------------------
def _c10d_args(method: c10d.Method, n: int, rank: int, root: int, shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
    """Arguments of ``method`` as torch passes them, for group rank ``rank`` of ``n`` (``root``: of gather,
    scatter, reduce and broadcast)."""
    opts = getattr(torch._C._distributed_c10d, method.options)() if method.options else None
    if opts is not None and hasattr(opts, "reduceOp"):
        opts.reduceOp = dist.ReduceOp.MAX
    if opts is not None and hasattr(opts, "rootRank"):
        opts.rootRank = root
    t = torch.zeros(shape, dtype=dtype)
    scaled = torch.zeros((n, *shape), dtype=dtype)
    name = method.name
    args: dict[str, Any] = {"opts": opts}
    if name in ("allreduce", "broadcast", "reduce"):
        args["tensors"] = [t]
    elif name == "allreduce_coalesced":
        args["tensors"] = [t, t]
    elif name == "allgather":
        args.update(outputs=[[t.clone() for _ in range(n)]], inputs=[t])
    elif name in ("_allgather_base",):
        args.update(output=scaled, inp=t)
    elif name == "_reduce_scatter_base":
        args.update(output=t, inp=scaled)
    elif name == "reduce_scatter":
        args.update(outputs=[t], inputs=[[t.clone() for _ in range(n)]])
    elif name == "alltoall":
        args.update(outputs=[t.clone() for _ in range(n)], inputs=[t.clone() for _ in range(n)])
    elif name == "alltoall_base":
        args.update(output=scaled, inp=scaled.clone(), output_split_sizes=[], input_split_sizes=[])
    elif name == "gather":
        args.update(outputs=[[t.clone() for _ in range(n)]] if rank == root else [], inputs=[t])
    elif name == "scatter":
        args.update(outputs=[t], inputs=[[t.clone() for _ in range(n)]] if rank == root else [])
    elif name == "barrier":
        pass
    return args


class _Recorder:
    """A stand-in group: what the installed c10d methods hand to ``_c10d``."""

    def _c10d(self, method: c10d.Method, args: dict[str, Any]) -> Any:
        return method, dict(args)


_Recording = c10d.install(type("_Recording", (_Recorder,), {}))


@given(
    name=st.sampled_from([m.name for m in c10d.METHODS if m.kind in ("collective", "flat")]),
    n=st.integers(1, 4),
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    data=st.data(),
)
def test_both_worlds_build_the_same_call_from_a_c10d_call(
    name: str, n: int, shape: tuple[int, ...], dtype: Any, data: Any
) -> None:
    from dstest.worlds.process.checked_group import _METAS
    from dstest.worlds.threaded.group import _TENSORS

    method = next(m for m in c10d.METHODS if m.name == name)
    how = data.draw(st.sampled_from(["position", "keyword", "mixed", "default"]))
    threaded_calls, process_calls = {}, {}
    for rank in range(n):  # every rank (the root's arguments differ from the others')
        args = _c10d_args(method, n, rank, 0 if how == "default" else n - 1, shape, dtype)  # default: root 0
        # passed by position, by keyword, or with the defaults (opts, tag) left out: _c10d gets the same
        by_name = [p for p in method.params if p in args]
        positional = [args[p] for p in method.params]
        group = _Recording()
        if how == "position":
            got = getattr(group, name)(*positional)
        elif how == "keyword":
            got = getattr(group, name)(**{p: args[p] for p in by_name})
        elif how == "mixed":
            cut = data.draw(st.integers(0, len(by_name)))
            got = getattr(group, name)(*positional[:cut], **{p: args[p] for p in by_name[cut:]})
        else:
            got = getattr(group, name)(*[args[p] for p in method.params if p != "opts"])
            args = {**args, "opts": None}
        assert got == (method, args)
        if args["opts"] is None:
            args["opts"] = getattr(torch._C._distributed_c10d, method.options)()
        assert method.args is not None
        threaded = threaded_calls[rank] = C.CALLS[method.op](rank, n, *method.args(_TENSORS, args))
        process = process_calls[rank] = C.CALLS[method.op](rank, n, *method.args(_METAS, args))
        threaded.check_local()
        process.check_local()
        for strict in (False, True):
            threaded.strict_shapes = process.strict_shapes = strict
            assert threaded.key() == process.key()
        assert threaded.describe() == process.describe()
        if method.kind == "flat":  # the coalesced all-reduce reduces its tensors as one flat buffer
            flat = matching.describe_tensor(torch.zeros(2 * _numel(shape), dtype=dtype))
            assert threaded.describe() == f"all_reduce({flat}, op={'sum' if how == 'default' else 'max'})"
    for calls in (threaded_calls, process_calls):  # and the ranks' calls match each other
        assert join_all(matching.Exchange(tuple(range(n)), "world", 1), calls, list(range(n))) is None


@given(
    shape=st.lists(st.integers(0, 4), max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(["cpu", "meta"]),
)
def test_a_tensor_and_its_metadata_have_one_signature_and_description(
    shape: tuple[int, ...], dtype: Any, device: str
) -> None:
    """The threaded world compares tensors, the process world their pickled metadata: by one rule."""
    t = torch.empty(shape, dtype=dtype, device=device)
    meta = Meta.of(t)
    for strict in (False, True):
        assert matching.signature(t, strict) == matching.signature(meta, strict)
    assert matching.signature(t) == matching.signature(t, True) == (dtype, tuple(shape), device)  # strict by default
    assert matching.signature(t, False) == (dtype, _numel(shape), device)
    assert matching.describe_tensor(t) == matching.describe_tensor(meta)
    assert matching.describe_tensor(t) == f"{str(dtype).replace('torch.', '')}{list(shape)}@{device}"


# -- end to end: each world applies the same rule ------------------------------------------------------------
def _program(ctx: Any, kind: str) -> None:
    """A short training-like sequence; rank 1 perturbs its calls as ``kind`` says."""
    odd = ctx.rank == 1
    t = torch.ones(4)
    dist.all_reduce(t)
    if kind == "dtype":
        dist.broadcast(torch.ones(4, dtype=torch.float64 if odd else torch.float32), src=0)
    elif kind == "count":
        dist.all_gather_into_tensor(torch.empty(2 * (5 if odd else 4)), torch.ones(5 if odd else 4))
    elif kind == "root":
        dist.broadcast(t, src=1 if odd else 0)
    elif kind == "reduce_op":
        dist.all_reduce(t, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
    elif kind == "op":
        (dist.broadcast(t, src=0) if odd else dist.all_reduce(t))
    elif kind == "splits":
        out_splits, in_splits = ([1, 3], [2, 2]) if odd else ([2, 2], [2, 2])  # rank 0 sends 2 rows, 1 expects 1
        dist.all_to_all_single(torch.empty(sum(out_splits)), torch.ones(sum(in_splits)), out_splits, in_splits)
    elif kind == "swap":
        first, second = (lambda: dist.broadcast(t, src=0)), (lambda: dist.all_reduce(t))
        (second() if odd else first())
        (first() if odd else second())
    elif kind == "missing":
        if not odd:
            dist.all_reduce(t)
    elif kind == "extra":
        if odd:
            dist.all_reduce(t)
    elif kind == "peer":
        if ctx.rank == 0:
            dist.send(torch.ones(2), dst=1, tag=3)
        else:
            dist.recv(torch.empty(2), src=0, tag=4)
    dist.barrier()


def body(ctx: Any, kind: str) -> None:
    _program(ctx, kind)


E2E = ["dtype", "count", "root", "reduce_op", "op", "splits", "swap", "missing", "extra", "peer"]


@pytest.mark.parametrize("world", ["threaded", "process"])
@pytest.mark.parametrize("kind", E2E)
def test_each_world_refuses_the_perturbed_program_on_every_rank(world: str, kind: str) -> None:
    with pytest.raises(RankFailure) as info:
        dstest.run(body, 2, args=(kind,), world=world, timeout=30.0)
    errors = info.value.exceptions
    assert sorted(errors) == [0, 1], info.value
    assert all(isinstance(e, CollectiveMismatch) for e in errors.values()), {r: repr(e) for r, e in errors.items()}
    for e in errors.values():
        assert re.search(r"\brank 0\b", str(e)) and re.search(r"\brank 1\b", str(e)), e


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_each_world_passes_the_unperturbed_program(world: str) -> None:
    dstest.run(body, 2, args=("none",), world=world, timeout=30.0)


def pairing_on_a_subgroup(ctx: Any) -> None:
    """Ranks 0 and 2 of three all_to_all on their subgroup; rank 2 sends rank 0 three elements, not two."""
    group = dist.new_group([0, 2])
    if ctx.rank != 1:
        inputs = [torch.ones(3 if ctx.rank == 2 else 2), torch.ones(2)]
        dist.all_to_all([torch.empty(2), torch.empty(2)], inputs, group=group)


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_a_pairing_refusal_on_a_subgroup_names_the_global_ranks(world: str) -> None:
    """``check_all`` sees group ranks; the message must name the ranks the user knows (0 and 2, not 1)."""
    with pytest.raises(RankFailure) as info:
        dstest.run(pairing_on_a_subgroup, 3, world=world, timeout=30.0)
    errors = info.value.exceptions
    assert sorted(errors) == [0, 2], info.value
    for e in errors.values():
        assert isinstance(e, CollectiveMismatch)
        assert str(e).startswith(
            "collective mismatch on group 1 [0, 2] (seq 1): rank 2 sends float32[3]@cpu to rank 0, whose "
            "output[1] is float32[2]@cpu; calls: rank 0 called all_to_all("
        ), e
