"""Checking the checker: ``assert_replicas`` (G4) under hypothesis (issue 40, finding 1).

A replica check is worth what it catches. Random tensors of every dtype the check documents, in every layout
(contiguous, transposed, strided with other bytes in the gaps, conjugate and negative views, 0-d, empty) and of
up to 1 MB, get one random change on one rank: a bit flipped anywhere, the sign of a block flipped, two elements
swapped at any distance, a -0.0 for a 0.0, a NaN of another payload. The check must fail exactly when the bytes
of the values differ, on every rank alike, naming the ranks; with the change left out, it must pass. Dicts must
pass in any insertion order and report a renamed, missing or extra key by name.

The bulk runs on the threaded world (a run costs milliseconds); a fixed sample of the same recipes runs on the
process world. The pure parts (the digest, the comparison of gathered values, the matching of names) are
tested without a world against oracles written here.

``max_examples`` is left to the profile: 100 in ``pytest -m cpu``, 5,000 under ``--hypothesis-profile=soak``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import dstest
from dstest.errors import InvalidArgument, ReplicasDiverge
from dstest.replicas import layouts, structure
from dstest.replicas import values as replica_values

pytestmark = pytest.mark.cpu

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
#: The largest tensor of a recipe, in bytes.
MAX_BYTES = 1 << 20
#: The integer dtype of each floating dtype's bits, and its canonical quiet NaN.
NAN_BITS = {
    torch.float16: (torch.int16, 0x7E00),
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float32: (torch.int32, 0x7FC00000),
    torch.float64: (torch.int64, 0x7FF8000000000000),
}
#: Size classes the statistics (``--hypothesis-show-statistics``) count examples in.
SIZES = ((1024, "1 KiB"), (32 * 1024, "32 KiB"), (256 * 1024, "256 KiB"), (MAX_BYTES, "1 MiB"))
#: Distances and lengths with structure, drawn as often as any others: a checksum with a period, or a sum in
#: which equal changes cancel in pairs, misses changes at just these distances (a swap of two rows, a sign flipped
#: in a block of even length).
STRUCTURED = tuple(sorted({m << k for k in range(21) for m in (1, 3)}))
KINDS = ("none", "bit", "sign", "swap", "negzero", "nan")


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _kinds(dtype: torch.dtype) -> list[str]:
    return [k for k in KINDS if _floating(dtype) or k not in ("negzero", "nan")]


def _layouts(dtype: torch.dtype) -> list[str]:
    out = ["contiguous", "transposed", "strided", "0-d", "empty"]
    if dtype.is_complex:
        out.append("conj")
    if dtype in (torch.float32, torch.float64):
        out.append("neg")  # the imaginary part of a conjugate view of complex64/128
    return out


@st.composite
def recipes(draw: Any, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """A tensor and a change of it, as plain values (they travel to the process world's ranks)."""
    name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[name]
    layout = draw(st.sampled_from(_layouts(dtype)))
    most = max_bytes // dtype.itemsize
    if layout == "0-d":
        rows, cols = 1, 1
    else:
        rows = draw(st.integers(1 if layout != "empty" else 0, 64))
        cols = 0 if layout == "empty" else draw(st.integers(1, max(1, most // max(rows, 1))))
    return {
        "dtype": name,
        "layout": layout,
        "rows": rows,
        "cols": cols,
        "seed": draw(st.integers(0, 2**32 - 1)),
        "kind": draw(st.sampled_from(_kinds(dtype))),
        "a": draw(st.integers(0, 2**40)),
        "d": draw(st.integers(0, 2**40) | st.sampled_from(STRUCTURED)),
        "bit": draw(st.integers(0, 7)),
        "payload": draw(st.integers(1, 63)),
    }


def _values(recipe: dict[str, Any]) -> torch.Tensor:
    """The recipe's values, flat and contiguous, the same on every rank (random, from its seed); a copy of
    its own."""
    return _made(recipe["dtype"], recipe["rows"] * recipe["cols"], recipe["seed"]).clone()


@functools.lru_cache(maxsize=4)
def _made(name: str, numel: int, seed: int) -> torch.Tensor:
    """Random values, made once for all the ranks and changes of an example (up to a megabyte each time)."""
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.bool)
    if dtype.is_complex:
        return torch.randn(numel, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _bits_of_real_part(x: torch.Tensor) -> torch.Tensor:
    """A view of the bits of ``x``'s (real part's) elements as integers."""
    real = torch.view_as_real(x)[:, 0] if x.dtype.is_complex else x
    return real.view(NAN_BITS[real.dtype][0])


def _logical(recipe: dict[str, Any], changed: bool) -> torch.Tensor:
    """The values a rank holds: the recipe's, with its change where ``changed``."""
    x = _values(recipe)
    n, kind = x.numel(), recipe["kind"]
    if n == 0 or kind == "none":
        return x
    # an element i, a block [i, i + length), a partner j at distance d (cyclically)
    i, d = recipe["a"] % n, recipe["d"]
    block, j = slice(i, i + max(1, d % (n + 1))), (i + d) % n
    if kind == "bit" and changed:
        raw = x.view(torch.uint8)
        # A bool is one bit in a byte: another bit set makes a byte torch itself reads as True or copies as 1,
        # depending on the kernel (no valid tensor holds it).
        raw[recipe["a"] % raw.numel()] ^= 1 << (0 if x.dtype == torch.bool else recipe["bit"])
    elif kind == "sign" and changed:
        x[block] = ~x[block] if x.dtype == torch.bool else -x[block]
    elif kind == "swap" and changed:
        x[[i, j]] = x[[j, i]]
    elif kind == "negzero":  # 0.0 on every rank, -0.0 on the changed one, over the block
        x[block] = 0
        if changed:
            _bits_of_real_part(x)[block] = _bits_of_real_part(torch.tensor([-0.0], dtype=x.dtype))[0]
    elif kind == "nan":  # the canonical NaN on every rank, another payload on the changed one, over the block
        real = torch.view_as_real(x)[:, 0] if x.dtype.is_complex else x
        _bits_of_real_part(x)[block] = NAN_BITS[real.dtype][1] | (recipe["payload"] if changed else 0)
    return x


def _garbage(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Memory a view skips: other bytes on every rank."""
    return torch.full(shape, 7 + rank, dtype=dtype)


def _laid_out(x: torch.Tensor, recipe: dict[str, Any], rank: int) -> torch.Tensor:
    """``x`` (flat) in the recipe's layout: the same values, in memory laid out another way."""
    rows, cols, layout = recipe["rows"], recipe["cols"], recipe["layout"]
    if layout == "0-d":
        return x.reshape(())
    m = x.reshape(rows, cols)
    if layout == "transposed":
        return m.t().contiguous().t()
    if layout == "strided":
        phys = _garbage((rows, 2 * cols + 1), x.dtype, rank)
        view = phys[:, 1 : 2 * cols + 1 : 2]
        view.copy_(m)
        return view
    if layout == "conj":
        return m.conj_physical().conj()
    if layout == "neg":
        return torch.complex(_garbage((rows, cols), x.dtype, rank), -m).conj().imag
    return m


def _tensor(recipe: dict[str, Any], rank: int, who: int) -> torch.Tensor:
    return _laid_out(_logical(recipe, changed=rank == who), recipe, rank)


def _differ(recipe: dict[str, Any]) -> bool:
    """Whether the change changes the bytes of the values (a swap of equal elements, the sign of zeros of an
    integer, do not)."""
    return not torch.equal(_logical(recipe, False).view(torch.uint8), _logical(recipe, True).view(torch.uint8))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (a fresh contiguous copy: one element of a strided view keeps its stride through
    ``contiguous()``)."""
    return t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def check_recipes(ctx: Any, recipes: list[dict[str, Any]], who: int) -> list[str | None]:
    """Each recipe's tensor (changed on rank ``who``) checked; what was caught."""
    out: list[str | None] = []
    for recipe in recipes:
        x = _logical(recipe, ctx.rank == who)
        t = _laid_out(x, recipe, ctx.rank)
        assert torch.equal(_bytes(t), _bytes(x))  # the layout keeps the values
        try:
            ctx.assert_replicas({"t": t})
        except ReplicasDiverge as e:
            out.append(str(e))
        else:
            out.append(None)
    return out


def _verdict_is_right(recipe: dict[str, Any], caught: list[str | None], size: int, who: int, differ: bool) -> None:
    assert all(c == caught[0] for c in caught), f"the ranks disagree: {caught}"
    if not differ:
        assert caught[0] is None, f"identical replicas failed: {caught[0]}"
        return
    assert caught[0] is not None, "replicas that differ passed"
    others = [r for r in range(size) if r != who]
    shape = "[]" if recipe["layout"] == "0-d" else f"[{recipe['rows']}, {recipe['cols']}]"
    groups = f"ranks {others} vs ranks [{who}]" if who else f"ranks [0] vs ranks {others}"
    assert f"tensor 't' ({recipe['dtype']}{shape}) differs bit for bit: {groups}" in caught[0], caught[0]


def _every_kind(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe with each kind of change its dtype has, the unchanged one first."""
    return [recipe | {"kind": kind} for kind in _kinds(DTYPES[recipe["dtype"]])]


def check_every_kind(ctx: Any, recipe: dict[str, Any], who: int) -> str | None:
    """One check of a dict holding the recipe's tensor under each kind of change (changed on rank ``who``), named
    by the kind: each draw of dtype, layout, size and place is worth six comparisons, in one world run."""
    held = {}
    for change in _every_kind(recipe):
        x = _logical(change, ctx.rank == who)
        held[change["kind"]] = _laid_out(x, change, ctx.rank)
        assert torch.equal(_bytes(held[change["kind"]]), _bytes(x))  # the layout keeps the values
    try:
        ctx.assert_replicas(held)
    except ReplicasDiverge as e:
        return str(e)
    return None


@given(recipe=recipes(), size=st.integers(2, 3), data=st.data())
def test_a_change_of_bits_fails_and_nothing_else_does(recipe, size, data):
    """Threaded world: the check names exactly the tensors whose bytes differ (the first, then the others as
    "also different"), naming the changed rank against the others, and passes when none does."""
    who = data.draw(st.integers(0, size - 1))
    size_bytes = recipe["rows"] * recipe["cols"] * DTYPES[recipe["dtype"]].itemsize
    event(next(f"up to {label}" for limit, label in SIZES if size_bytes <= limit))
    differing = []
    for change in _every_kind(recipe):
        differ = _differ(change)
        event(f"{change['kind']}, {'differs' if differ else 'same bytes'}")
        if differ:
            differing.append(change["kind"])
    caught = dstest.run(check_every_kind, size, args=(recipe, who))
    assert all(c == caught[0] for c in caught), f"the ranks disagree: {caught}"
    if not differing:
        assert caught[0] is None, f"identical replicas failed: {caught[0]}"
        return
    assert caught[0] is not None, f"replicas that differ passed: {differing}"
    others = [r for r in range(size) if r != who]
    shape = "[]" if recipe["layout"] == "0-d" else f"[{recipe['rows']}, {recipe['cols']}]"
    groups = f"ranks {others} vs ranks [{who}]" if who else f"ranks [0] vs ranks {others}"
    first, *also = differing
    assert f": tensor '{first}' ({recipe['dtype']}{shape}) differs bit for bit: {groups}; " in caught[0], caught[0]
    tail = "; also different: " + ", ".join(f"tensor {k!r}" for k in also) if also else ")"
    assert caught[0].endswith(tail), caught[0]


def _fixed_sample() -> list[dict[str, Any]]:
    """Every dtype, each layout it has and each kind of change, in turn, at a few sizes: the process world's
    sample (one world run for all of them)."""
    out = []
    for i, name in enumerate(sorted(DTYPES)):
        dtype = DTYPES[name]
        layouts = _layouts(dtype)
        kinds = _kinds(dtype)
        for j in range(3):
            layout = layouts[(i + j) % len(layouts)]
            rows, cols = {"0-d": (1, 1), "empty": (3, 0)}.get(layout, (1 + j * 5, 1000 + 37 * i))
            kind = kinds[(i + j) % len(kinds)] if j < 2 else "sign"
            recipe = {"dtype": name, "layout": layout, "rows": rows, "cols": cols, "seed": i * 3 + j}
            change = {"kind": kind, "a": 5 + 97 * j, "d": STRUCTURED[i + 7 * j], "bit": (i + j) % 8, "payload": 1 + i}
            out.append(recipe | change)
    return out


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_a_fixed_sample_on_both_worlds(world):
    sample = _fixed_sample()
    assert sum(_differ(r) for r in sample) >= len(sample) // 2  # the sample mostly changes something
    results = dstest.run(check_recipes, 2, world=world, args=(sample, 1))
    for k, recipe in enumerate(sample):
        _verdict_is_right(recipe, [results[0][k], results[1][k]], 2, 1, _differ(recipe))


# -- dicts: matched by key ------------------------------------------------------------------------------------------
@st.composite
def dicts(draw: Any) -> dict[str, Any]:
    """Up to six named small tensors; rank 1's in another order, with one key changed (or none)."""
    names = draw(st.lists(st.text("abcxyz_", min_size=1, max_size=4), min_size=1, max_size=6, unique=True))
    items = [(name, draw(recipes(max_bytes=4096)) | {"kind": "none"}) for name in names]
    order = draw(st.permutations(range(len(items))))
    change = draw(st.sampled_from(["none", "renamed", "missing", "extra"]))
    key = draw(st.integers(0, len(items) - 1))
    return {"items": items, "order": list(order), "change": change, "key": key}


def check_dicts(ctx: Any, cases: list[dict[str, Any]]) -> list[str | None]:
    return [_check_dict(ctx, case) for case in cases]


def _check_dict(ctx: Any, case: dict[str, Any]) -> str | None:
    held = [(name, _tensor(recipe, ctx.rank, -1)) for name, recipe in case["items"]]
    if ctx.rank == 1:
        held = [held[k] for k in case["order"]]
        name, tensor = held[case["key"]]
        if case["change"] == "renamed":
            held[case["key"]] = (name + "!", tensor)
        elif case["change"] == "missing":
            del held[case["key"]]
        elif case["change"] == "extra":
            held.append(("extra!", tensor))
    try:
        ctx.assert_replicas(dict(held))
    except ReplicasDiverge as e:
        return str(e)
    return None


def _dict_verdict_is_right(case: dict[str, Any], caught: list[str | None]) -> None:
    assert caught[0] == caught[1], f"the ranks disagree: {caught}"
    change = case["change"]
    if change == "none":
        assert caught[0] is None, f"the same tensors in another order failed: {caught[0]}"
        return
    assert caught[0] is not None and "the ranks hold different tensors" in caught[0], caught[0]
    name = case["items"][case["order"][case["key"]]][0]
    if change in ("renamed", "missing"):
        assert f"ranks [1] lack tensor {name!r}" in caught[0]
    if change in ("renamed", "extra"):
        extra = name + "!" if change == "renamed" else "extra!"
        assert f"hold tensor {extra!r} extra" in caught[0]


@given(case=dicts())
def test_dicts_compare_by_key(case):
    _dict_verdict_is_right(case, [r[0] for r in dstest.run(check_dicts, 2, args=([case],))])


def test_dicts_on_the_process_world():
    cases = [
        {"items": [("a", r), ("b", r), ("c", r)], "order": [2, 0, 1], "change": change, "key": 1}
        for r in [_fixed_sample()[4] | {"kind": "none"}]
        for change in ("none", "renamed", "missing", "extra")
    ]
    results = dstest.run(check_dicts, 2, world="process", args=(cases,))
    for k, case in enumerate(cases):
        _dict_verdict_is_right(case, [results[0][k], results[1][k]])


# -- the pure parts, without a world -------------------------------------------------------------------------------
@given(recipe=recipes())
def test_the_digest_tells_bytes_apart(recipe):
    """Equal digests exactly for equal bytes of the values, whatever the layout and whatever is in its gaps."""
    digest = replica_values._digest
    for change in _every_kind(recipe):
        before, after = _tensor(change, 0, -1), _tensor(change, 1, 1)
        assert digest(before) == digest(_logical(change, False))
        assert (digest(before) == digest(after)) == (not _differ(change)), change["kind"]


finite_or_not = st.floats(allow_nan=True, allow_infinity=True, width=64) | st.sampled_from(
    [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-300, 2.0**60]
)
tolerances = st.sampled_from([0.0, 1e-6, 0.5, 1.0]) | st.floats(0, 10)


def _entry(values: torch.Tensor) -> Any:
    return layouts.Entry("tensor 'x'", "tensor", None, (0, 1), tuple(values.shape), values.dtype, tensor=values)


def _float_close(g: float, w: float, rtol: float, atol: float) -> bool:
    """The documented rule, element by element, in Python floats."""
    if math.isfinite(g) and math.isfinite(w):
        return abs(g - w) <= atol + rtol * abs(w)
    return g == w or (math.isnan(g) and math.isnan(w))


@given(
    pairs=st.lists(st.tuples(finite_or_not, finite_or_not), min_size=1, max_size=20),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    rtol=tolerances,
    atol=tolerances,
)
def test_comparison_of_floats_follows_the_documented_rule(pairs, dtype, rtol, atol):
    want = torch.tensor([w for w, _ in pairs], dtype=torch.float64).to(dtype)
    got = torch.tensor([g for _, g in pairs], dtype=torch.float64).to(dtype)
    text = replica_values.compare(_entry(want), [want, got], rtol, atol)
    same_bits = torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    if rtol == 0 and atol == 0:
        assert (text is None) == same_bits
        return
    rounded = zip(want.double().tolist(), got.double().tolist())
    assert (text is None) == (same_bits or all(_float_close(g, w, rtol, atol) for w, g in rounded)), text


int64s = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, 1, -1, 2**60, 2**60 + 1, 2**63 - 1, -(2**63)])


@given(pairs=st.lists(st.tuples(int64s, int64s), min_size=1, max_size=20), rtol=tolerances, atol=tolerances)
def test_comparison_of_int64_is_exact(pairs, rtol, atol):
    """Integers: the exact difference (rounded once to float64), never the difference of rounded values."""
    want = torch.tensor([w for w, _ in pairs], dtype=torch.int64)
    got = torch.tensor([g for _, g in pairs], dtype=torch.int64)
    text = replica_values.compare(_entry(want), [want, got], rtol, atol)
    if rtol == 0 and atol == 0:
        assert (text is None) == (want.tolist() == got.tolist())
        return
    close = all(float(abs(g - w)) <= atol + rtol * float(abs(w)) for w, g in pairs)
    assert (text is None) == close, text


def _described(names: list[str]) -> list[Any]:
    return [(f"tensor {n!r}", "tensor", (0, 1), (2,), "torch.float32") for n in names]


@given(
    names=st.lists(st.text("abc", min_size=1, max_size=3), min_size=0, max_size=8, unique=True),
    data=st.data(),
)
def test_names_are_matched_whatever_their_order(names, data):
    shuffled = data.draw(st.permutations(names))
    order, finding = structure._match_structure([_described(names), _described(shuffled)], (0, 1))
    assert finding is None
    assert [name for name, _ in order] == [f"tensor {n!r}" for n in names]
    dropped = data.draw(st.sets(st.sampled_from(names))) if names else set()
    added = data.draw(st.sets(st.text("xyz", min_size=1, max_size=3), max_size=3))
    theirs = [n for n in shuffled if n not in dropped] + sorted(added)
    _, finding = structure._match_structure([_described(names), _described(theirs)], (0, 1))
    assert (finding is None) == (not dropped and not added)
    if finding is not None:
        listed = [f"tensor {n!r}" for n in names if n in dropped][:5]
        assert all(name in finding.text for name in listed)
        if dropped:
            assert "ranks [1] lack " + ", ".join(listed) in finding.text


def test_names_a_rank_cannot_tell_apart_are_an_invalid_argument():
    """Two dict keys with the same repr (two objects that print alike) cannot be matched across ranks: every rank
    raises the same InvalidArgument, from the same gathered lists."""
    with pytest.raises(InvalidArgument, match=r"rank 1 holds two tensors named tensor 'a'"):
        structure._match_structure([_described(["a"]), _described(["a", "a"])], (0, 1))


# -- dtypes without arithmetic (bits8, bits16, packed float4) --------------------------------------------------------
@pytest.mark.parametrize("world", ["threaded", "process"])
def test_dtypes_without_arithmetic_that_differ_are_named_by_their_bits_on_both_worlds(world):
    """A tensor of a dtype torch cannot index that differs was an error (NotImplementedError: "index_cpu" not
    implemented for 'Bits8') instead of a ReplicasDiverge; found by a mutant of the bits shown for them."""
    from test_replicas_mutants import BIT_DTYPES_EXPECTED, bit_dtypes

    assert dstest.run(bit_dtypes, 2, world=world) == [BIT_DTYPES_EXPECTED, BIT_DTYPES_EXPECTED]
