"""crosscheck's details that mutation testing showed no fast test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/crosscheck.py`` runs mutmut over :mod:`dstest.crosscheck` with the comparison's
properties (tests/test_checker_properties_crosscheck.py) and this file. Each test here states what contract
E14 promises a user reads when the worlds differ (the text naming the call of the trace that differs, the
layout of two tensors, the values of two sets) and fails for at least one mutant that survived the
properties. Pure: the comparison and the trace's text are driven directly, no world is run.
"""

from __future__ import annotations

import functools
import math
import struct
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dstest.compare import _trace_difference
from dstest.context import RankContext
from dstest.crosscheck import crosscheck, difference
from dstest.errors import InvalidArgument, RankFailure, WorldsDiverge, WorldTimeout
from dstest.worlds.request import DEFAULT_SEED

pytestmark = pytest.mark.cpu

# trace signatures as trace_signature gives them: (op, group, seq, dtype, shapes, reduce_op, root, peer, tag)
Signature = tuple[Any, ...]
ALL_REDUCE: Signature = ("all_reduce", "world", 1, "torch.float32", ((2, 3),), "SUM", None, None, 0)
BROADCAST: Signature = ("broadcast", "world", 2, "torch.float32", ((4,),), None, 0, None, 0)
SEND: Signature = ("send", "group [0, 1]", None, "torch.int64", ((1,),), None, None, 1, 0)


def test_a_trace_difference_names_the_rank_the_call_and_each_worlds_call_in_full() -> None:
    """Every field a world may get wrong is shown: reduce op, root (rank 0 too), peer, and the sequence number
    only where the call has one."""
    traces = {"threaded": [[ALL_REDUCE, BROADCAST], [ALL_REDUCE]], "process": [[ALL_REDUCE, SEND], [ALL_REDUCE]]}
    assert _trace_difference(2, traces) == (
        "rank 0's call 2: threaded world broadcast(torch.float32[4], root=0) on world (seq 2), "
        "process world send(torch.int64[1], peer=1) on group [0, 1]"
    )
    traces = {"threaded": [[ALL_REDUCE], [BROADCAST]], "process": [[ALL_REDUCE], [ALL_REDUCE]]}
    assert _trace_difference(2, traces) == (
        "rank 1's call 1: threaded world broadcast(torch.float32[4], root=0) on world (seq 2), "
        "process world all_reduce(torch.float32[2, 3], op=SUM) on world (seq 1)"
    )


def test_a_call_made_on_one_world_only_is_named_against_no_call() -> None:
    traces = {"threaded": [[ALL_REDUCE], [ALL_REDUCE]], "process": [[ALL_REDUCE], [ALL_REDUCE, BROADCAST]]}
    assert _trace_difference(2, traces) == (
        "rank 1's call 2: threaded world no call, process world broadcast(torch.float32[4], root=0) on world (seq 2)"
    )
    traces = {"threaded": [[ALL_REDUCE, SEND]], "process": [[ALL_REDUCE]]}
    assert _trace_difference(1, traces) == (
        "rank 0's call 2: threaded world send(torch.int64[1], peer=1) on group [0, 1], process world no call"
    )
    assert _trace_difference(2, {"threaded": [[ALL_REDUCE], []], "process": [[ALL_REDUCE], []]}) is None


def test_tensors_of_another_layout_or_on_meta_are_named_by_it() -> None:
    dense = torch.zeros(2, 3)
    assert str(difference(dense, dense.to_sparse())) == "the value: strided vs sparse_coo tensors"
    meta = torch.empty(2, 3, device="meta")
    assert str(difference(meta, dense)) == "the value: meta vs strided tensors"
    assert difference(meta, torch.empty(2, 3, device="meta")) is None  # no data: dtype and shape are all


def test_sets_that_differ_name_what_only_each_side_holds() -> None:
    found = difference({1, 2}, {2, 3}, names=("threaded world", "process world"), where="rank 0's result")
    assert str(found) == "rank 0's result: only on the threaded world: {1}; only on the process world: {3}"
    assert difference(frozenset({1}), frozenset({1})) is None


def test_sequences_of_another_length_name_both_lengths() -> None:
    assert str(difference((1, 2), (1, 2, 3))) == "the value: tuple of 2 vs tuple of 3"
    assert str(difference([1], [])) == "the value: list of 1 vs list of 0"


def test_missing_and_extra_keys_are_named_with_the_side_that_holds_them() -> None:
    found = difference({"a": 1, "b": 2, "d": 0}, {"a": 1, "c": 3}, names=("threaded world", "process world"))
    assert str(found) == "the value: keys ['b', 'd'] only on the threaded world, ['c'] only on the process world"
    assert str(difference({"a": 1}, {"a": 1, "c": 3})) == "the value: keys ['c'] only on the second"


def test_the_bits_of_two_nans_are_shown_as_the_number_they_make() -> None:
    """Little-endian, as stored, and as wide as the element: 0x7fc00001 is float32's NaN with payload 1."""
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])
    a[1:].view(torch.int32).fill_(0x7FC00001)
    b[1:].view(torch.int32).fill_(0x7FC00002)
    assert str(difference(a, b)) == (
        "[1]: torch.float32 tensors differ: nan vs nan (bits 0x7fc00001 vs 0x7fc00002) (1 of 2 elements differ)"
    )


class _NoBool:
    def __eq__(self, other: object) -> list[int]:  # type: ignore[override]
        return [1]

    __hash__ = None  # type: ignore[assignment]


class _Raises:
    def __eq__(self, other: object) -> bool:
        raise ValueError("no")

    __hash__ = None  # type: ignore[assignment]


def test_a_value_whose_equality_gives_no_bool_or_raises_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgument) as info:
        difference(_NoBool(), _NoBool())
    assert str(info.value) == (
        "crosscheck cannot compare the value: _NoBool == _NoBool gave list, not True or False, so dstest cannot "
        "tell whether the worlds agree; return tensors, numpy arrays, containers of them, or values whose == "
        "gives a bool"
    )
    with pytest.raises(InvalidArgument) as info:
        difference([_Raises()], [_Raises()])
    assert str(info.value) == "crosscheck cannot compare [0]: _Raises == _Raises raised ValueError: no"
    import numpy as np

    assert difference(np.float64(1.0).item() == 1.0, True) is None
    assert difference(_Bool(), _Bool()) is None  # an == giving numpy's bool is taken


class _Bool:
    def __eq__(self, other: object) -> object:  # type: ignore[override]
        import numpy as np

        return np.bool_(True)

    __hash__ = None  # type: ignore[assignment]


# -- crosscheck() itself: driven on the threaded world against the fake world (both in this process, a few ms
# a run), so that its verdicts and texts are checked without the process world's workers. The fake world
# moves no data, so a result that a collective computes differs between the two, as a real divergence
# would (it runs ranks 0 and 1 only of a larger world: the world sizes here are 1 and 2).
WORLDS = ("threaded", "fake")


def _reduced(ctx: RankContext) -> torch.Tensor:
    x = torch.ones(2)
    dist.all_reduce(x)
    return x


def _passed(ctx: RankContext, *args: object, **kwargs: object) -> list[object]:
    dist.barrier()
    return [ctx.rank, ctx.seed, args, kwargs]


def test_crosscheck_returns_the_first_worlds_results_with_what_it_was_given() -> None:
    expected = [[r, 7, (1, "a"), {"k": 2}] for r in range(2)]
    assert crosscheck(_passed, 2, worlds=WORLDS, args=(1, "a"), kwargs={"k": 2}, seed=7) == expected
    assert crosscheck(_passed, 2, worlds=WORLDS) == [[0, DEFAULT_SEED, (), {}], [1, DEFAULT_SEED, (), {}]]
    first = crosscheck(_world_named, 2, worlds=WORLDS)
    assert [r.world for r in first] == ["threaded", "threaded"]
    first = crosscheck(_world_named, 2, worlds=("fake", "threaded"))
    assert [r.world for r in first] == ["fake", "fake"]


class _Named:
    """Equal to any _Named: which world made it is visible, but not to the comparison."""

    def __init__(self, world: str) -> None:
        self.world = world

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Named)

    __hash__ = None  # type: ignore[assignment]


def _world_named(ctx: RankContext) -> _Named:
    return _Named(ctx.world)


def test_crosscheck_names_the_rank_whose_result_differs_and_both_worlds() -> None:
    with pytest.raises(WorldsDiverge) as info:
        crosscheck(_reduced, 2, worlds=WORLDS)
    assert str(info.value) == (
        "_reduced at world size 2: rank 0's result[0]: torch.float32 tensors differ: 2.0 vs 1.0 "
        "(2 of 2 elements differ) (threaded world vs fake world)"
    )
    with pytest.raises(WorldsDiverge) as info:
        crosscheck(_keys_on_rank_1, 2, worlds=WORLDS)
    assert str(info.value) == (
        "_keys_on_rank_1 at world size 2: rank 1's result: keys ['threaded'] only on the threaded world, "
        "['fake'] only on the fake world (threaded world vs fake world)"
    )


def _keys_on_rank_1(ctx: RankContext) -> dict[str, int]:
    return {ctx.world if ctx.rank == 1 else "same": 1}


def _off_by_a_little(ctx: RankContext) -> list[float]:
    return [1.0 + (1e-9 if ctx.world == "threaded" else 0.0)]


def test_crosscheck_compares_within_the_tolerances_given() -> None:
    with pytest.raises(WorldsDiverge, match=r"rank 0's result\[0\]: 1.000000001 vs 1.0 \(threaded world vs"):
        crosscheck(_off_by_a_little, 1, worlds=WORLDS)
    assert crosscheck(_off_by_a_little, 1, worlds=WORLDS, rtol=1e-6) == [[1.000000001]]
    assert crosscheck(_off_by_a_little, 1, worlds=WORLDS, atol=1e-6) == [[1.000000001]]
    with pytest.raises(WorldsDiverge, match="beyond rtol=1e-12, atol=1e-12"):
        crosscheck(_off_by_a_little, 1, worlds=WORLDS, rtol=1e-12, atol=1e-12)


def _extra_broadcast(ctx: RankContext) -> None:
    x = torch.ones(2)
    if ctx.rank == 1 or ctx.world == "threaded":
        dist.all_reduce(x)
    if ctx.world == "fake":
        dist.broadcast(x, 1)


def test_crosscheck_names_the_first_call_where_the_traces_differ() -> None:
    with pytest.raises(WorldsDiverge) as info:
        crosscheck(_extra_broadcast, 2, worlds=WORLDS)
    assert str(info.value) == (
        "_extra_broadcast at world size 2: the collective traces differ at rank 0's call 1: threaded world "
        "all_reduce(float32[2], op=sum) on world (seq 1), fake world broadcast(float32[2], root=1) on world (seq 1)"
    )


def _fails_on(ctx: RankContext, worlds: tuple[str, ...]) -> None:
    if ctx.world in worlds:
        raise ValueError(f"planted on the {ctx.world} world")


def test_crosscheck_a_body_that_fails_on_one_world_diverges_with_that_failure() -> None:
    for bad, good in (("fake", "threaded"), ("threaded", "fake")):
        with pytest.raises(WorldsDiverge) as info:
            crosscheck(_fails_on, 2, worlds=WORLDS, args=((bad,),))
        text = str(info.value)
        assert text.startswith(
            f"_fails_on at world size 2 passes on the {good} world and fails on the {bad} world; "
            f"the {bad} world's failure:\n"
        ), text
        assert isinstance(info.value.__cause__, RankFailure)
        assert text.endswith(str(info.value.__cause__))
        assert f"planted on the {bad} world" in text


def test_crosscheck_a_body_that_fails_on_both_worlds_raises_the_first_worlds_failure() -> None:
    for worlds in (WORLDS, WORLDS[::-1]):
        with pytest.raises(RankFailure) as info:
            crosscheck(_fails_on, 2, worlds=worlds, args=(WORLDS,))
        assert not isinstance(info.value, WorldsDiverge)
        assert f"planted on the {worlds[0]} world" in str(info.value)
        assert f"planted on the {worlds[1]} world" not in str(info.value)


def _late(ctx: RankContext) -> None:
    if ctx.rank == 0:
        time.sleep(0.3)
    dist.barrier()


def test_crosscheck_runs_each_world_with_the_timeout_given() -> None:
    with pytest.raises(WorldTimeout, match=r"ran past its timeout of 0\.05 s"):
        crosscheck(_late, 2, worlds=WORLDS, timeout=0.05)
    assert crosscheck(_late, 2, worlds=WORLDS) == [None, None]


def test_crosscheck_names_a_callable_without_a_qualname_by_its_repr() -> None:
    body = functools.partial(_fails_on, worlds=("fake",))
    with pytest.raises(WorldsDiverge) as info:
        crosscheck(body, 1, worlds=WORLDS)
    assert str(info.value).startswith(f"{body!r} at world size 1 passes on the threaded world")


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"worlds": ["threaded"]}, "crosscheck: worlds=['threaded']: name two different worlds"),
        ({"worlds": ("fake", "fake")}, "crosscheck: worlds=['fake', 'fake']: name two different worlds"),
        ({"worlds": ("threaded", "fake", "process")}, "name two different worlds"),
        ({"rtol": -1e-9}, "crosscheck: rtol=-1e-09: must be a finite number >= 0"),
        ({"atol": -1}, "crosscheck: atol=-1: must be a finite number >= 0"),
        ({"rtol": math.inf}, "crosscheck: rtol=inf: must be a finite number >= 0"),
        ({"atol": math.nan}, "crosscheck: atol=nan: must be a finite number >= 0"),
        ({"rtol": True}, "crosscheck: rtol=True: must be a finite number >= 0"),
        ({"atol": "0.1"}, "crosscheck: atol='0.1': must be a finite number >= 0"),
    ],
)
def test_crosscheck_refuses_bad_arguments_before_any_world_runs(kwargs: dict[str, object], text: str) -> None:
    ran: list[int] = []
    with pytest.raises(InvalidArgument) as info:
        crosscheck(ran.append, 2, **{"worlds": WORLDS, **kwargs})  # type: ignore[arg-type]
    assert text in str(info.value)
    assert str(info.value).startswith("crosscheck: ")
    assert ran == []


def test_crosscheck_takes_any_finite_tolerance_from_zero() -> None:
    for tol in (0, 0.0, 1, 2.5):
        assert crosscheck(_passed, 1, worlds=WORLDS, rtol=tol, atol=tol) == [[0, DEFAULT_SEED, (), {}]]


def test_the_crosscheck_module_called_is_crosscheck() -> None:
    """``dstest.crosscheck`` may be the module (once imported as one): calling it runs the check."""
    import dstest.crosscheck as module

    results = module(_passed, 2, worlds=WORLDS, args=(3,), seed=1)  # type: ignore[operator]
    assert results == [[0, 1, (3,), {}], [1, 1, (3,), {}]]
    with pytest.raises(WorldsDiverge, match="_reduced at world size 2: rank 0's result"):
        module(_reduced, 2, worlds=WORLDS)  # type: ignore[operator]


# -- Python floats and complex numbers (E14: by bits, or within rtol/atol; any NaN equal to any NaN then) -------
def _float(bits: int) -> float:
    return float(struct.unpack("<d", bits.to_bytes(8, "little"))[0])


def test_python_floats_are_compared_bit_for_bit_and_named_by_value() -> None:
    assert str(difference(1.0, 2.0, where="x")) == "x: 1.0 vs 2.0"
    assert str(difference(0.0, -0.0)) == "the value: 0.0 vs -0.0"
    nan1, nan2 = _float(0x7FF8000000000001), _float(0x7FF8000000000002)
    assert difference(nan1, _float(0x7FF8000000000001)) is None
    assert str(difference(nan1, nan2)) == "the value: nan vs nan (bits 0x7ff8000000000001 vs 0x7ff8000000000002)"


def test_python_complex_numbers_are_compared_part_by_part_bit_for_bit() -> None:
    assert difference(complex(1, 2), complex(1, 2)) is None
    assert str(difference(complex(1, 2), complex(1, 3))) == "the value: (1+2j) vs (1+3j)"
    assert str(difference(complex(1, 2), complex(0, 2))) == "the value: (1+2j) vs 2j"
    nan1, nan2 = _float(0x7FF8000000000001), _float(0x7FF8000000000002)
    assert str(difference(complex(0.5, nan1), complex(0.5, nan2))) == (
        "the value: (0.5+nanj) vs (0.5+nanj) "
        "(bits 0x3fe0000000000000 0x7ff8000000000001 vs 0x3fe0000000000000 0x7ff8000000000002)"
    )
    assert str(difference(complex(nan1, 0.5), complex(nan2, 0.5))) == (
        "the value: (nan+0.5j) vs (nan+0.5j) "
        "(bits 0x7ff8000000000001 0x3fe0000000000000 vs 0x7ff8000000000002 0x3fe0000000000000)"
    )


def test_python_floats_within_the_tolerances_are_equal_and_beyond_them_named() -> None:
    assert difference(1.0, 1.0 + 1e-7, rtol=1e-6) is None  # beyond math.isclose's own default of 1e-9
    assert difference(0.0, 1e-7, atol=1e-6) is None
    assert difference(_float(0x7FF8000000000001), _float(0x7FF8000000000002), rtol=1e-6) is None  # any NaN
    assert str(difference(1.0, math.nan, rtol=1e-6, where="r")) == "r: 1.0 vs nan (beyond rtol=1e-06, atol=0)"
    assert str(difference(math.nan, 1.0, atol=0.5)) == "the value: nan vs 1.0 (beyond rtol=0, atol=0.5)"
    assert str(difference(0.0, 1e-5, rtol=0.5, atol=1e-6)) == "the value: 0.0 vs 1e-05 (beyond rtol=0.5, atol=1e-06)"
    assert difference(complex(1, 1), complex(1 + 1e-7, 1 - 1e-7), rtol=1e-6) is None
    assert str(difference(complex(1, 1), complex(1, 2), rtol=1e-6)) == (
        "the value: (1+1j) vs (1+2j) (beyond rtol=1e-06, atol=0)"
    )
    assert difference(complex(1, 1), complex(2, 1), rtol=1e-6) is not None
    assert difference(complex(1, math.nan), complex(1, math.nan), atol=1e-6) is None


# -- numpy arrays: by dtype, shape and bytes; structured ones field by field, object ones element by element ----
def test_arrays_of_another_dtype_or_shape_are_named_by_both() -> None:
    assert str(difference(np.zeros(2, np.float32), np.zeros(2, np.float64), where="r")) == (
        "r: float32[2] vs float64[2] arrays"
    )
    assert str(difference(np.zeros((2, 1)), np.zeros((1, 2)))) == "the value: float64[2, 1] vs float64[1, 2] arrays"


def test_arrays_that_differ_are_named_at_their_first_element() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = a.copy()
    b[1, 0], b[1, 2] = 9, 8
    assert str(difference(a, b, where="w")) == "w[1, 0]: int32 arrays differ: 3 vs 9 (2 of 6 elements differ)"


def test_structured_arrays_are_compared_field_by_field_named_by_the_field() -> None:
    dt = np.dtype([("x", np.int16), ("y", np.float64)], align=True)
    a, b = np.zeros(3, dt), np.zeros(3, dt)
    a.view(np.uint8)[2:8] = 0xAB  # the padding between the fields: not compared
    assert difference(a, b) is None
    b["y"][2] = 1.5
    assert str(difference(a, b, where="r")) == "r['y'][2]: float64 arrays differ: 0.0 vs 1.5 (1 of 3 elements differ)"
    b["x"][1] = 4
    assert str(difference(a, b, where="r")) == "r['x'][1]: int16 arrays differ: 0 vs 4 (1 of 3 elements differ)"


def test_object_arrays_are_compared_element_by_element_as_the_objects() -> None:
    a = np.empty((2, 2), dtype=object)
    a[:] = [["a", 1.0], [[1, 2], None]]
    b = np.empty((2, 2), dtype=object)
    b[:] = [["a", 1.0], [[1, 2], None]]
    assert difference(a, b) is None
    b[1, 0] = [1, 3]
    assert str(difference(a, b, where="r")) == "r[1, 0][1]: 2 vs 3"
    b[0, 1] = 2.0
    assert str(difference(a, b, where="r")) == "r[0, 1]: 1.0 vs 2.0"


def test_float_arrays_within_the_tolerances_are_equal_and_beyond_them_named() -> None:
    a = np.array([1000.0, 0.0])
    assert difference(a, np.array([1000.0, 1e-7]), atol=1e-6) is None
    assert difference(a, np.array([1000.0 + 1e-4, 0.0]), rtol=1e-6) is None
    # beyond: numpy's own defaults (rtol=1e-05, atol=1e-08) would take both of these
    assert str(difference(a, np.array([1000.001, 0.0]), atol=1e-6)) == (
        "[0]: float64 arrays differ beyond rtol=0, atol=1e-06: 1000.0 vs 1000.001 (1 of 2 elements differ)"
    )
    assert str(difference(a, np.array([1000.0, 1e-9]), rtol=1e-6, where="r")) == (
        "r[1]: float64 arrays differ beyond rtol=1e-06, atol=0: 0.0 vs 1e-09 (1 of 2 elements differ)"
    )
    assert difference(np.array([np.nan]), np.array([-np.nan]), rtol=1e-6) is None  # any NaN


def _long_double(values: list[complex], dtype: Any, fill: int) -> Any:
    """An array of ``dtype`` with ``values`` whose padding bytes (x87's 10 bytes of value in 16) hold ``fill``."""
    out = np.array(values, dtype=dtype)
    parts = out.view(np.uint8).reshape(-1, 16)  # a part (a value, or a real or imaginary part) a row
    parts[:, 10:] = fill
    return out


@pytest.mark.skipif(np.finfo(np.longdouble).nmant != 63, reason="long double is x87 extended precision here only")
def test_long_doubles_are_compared_by_value_whatever_their_padding() -> None:
    for dtype in (np.longdouble, np.clongdouble):
        assert difference(_long_double([1, 2], dtype, 0x00), _long_double([1, 2], dtype, 0xFF)) is None
        nans = _long_double([np.nan, 0], dtype, 0x00)
        assert difference(nans, _long_double([np.nan, 0], dtype, 0x55)) is None
        found = difference(_long_double([1, 0.0], dtype, 0), _long_double([1, -0.0], dtype, 0xFF))
        assert found is not None and found.path == "[1]" and "(1 of 2 elements differ)" in found.why
        found = difference(_long_double([3, 2], dtype, 0), _long_double([1, 2], dtype, 0))
        assert found is not None and found.path == "[0]"
        found = difference(_long_double([1, np.nan], dtype, 0), _long_double([1, 1], dtype, 0))
        assert found is not None and found.path == "[1]"  # a NaN on one side only
    a = _long_double([1 + 2j, 3 + 4j], np.clongdouble, 0)
    assert str(difference(a, _long_double([1 + 2j, 5 + 4j], np.clongdouble, 0xFF))).startswith(
        "[1]: complex256 arrays differ: np.clongdouble('3+4j') vs np.clongdouble('5+4j') (1 of 2"
    )  # the real part alone differs
    assert str(difference(a, _long_double([1 + 2j, 3 + 5j], np.clongdouble, 0xFF))).startswith(
        "[1]: complex256 arrays differ: np.clongdouble('3+4j') vs np.clongdouble('3+5j') (1 of 2"
    )  # the imaginary part alone
    real = _long_double([1, 2, 3], np.longdouble, 0)
    assert str(difference(real, _long_double([1, 4, 3], np.longdouble, 0xFF))).startswith(
        "[1]: float128 arrays differ: np.longdouble('2.0') vs np.longdouble('4.0') (1 of 3"
    )


def test_tensor_elements_that_print_differently_show_no_bits() -> None:
    assert str(difference(torch.tensor([7.0]), torch.tensor([3.0]))) == (
        "[0]: torch.float32 tensors differ: 7.0 vs 3.0 (1 of 1 elements differ)"
    )


def test_array_elements_that_print_alike_show_their_own_bits() -> None:
    a = np.array([0x7FF8000000000001, 0x7FF8000000000003, 7], dtype=np.int64).view(np.float64)
    b = np.array([0x7FF8000000000002, 0x7FF8000000000003, 7], dtype=np.int64).view(np.float64)
    assert str(difference(a, b)) == (
        "[0]: float64 arrays differ: nan vs nan (bits 0x7ff8000000000001 vs 0x7ff8000000000002) (1 of 3 elements differ)"
    )
    assert difference(a[1:], b[1:]) is None
    assert str(difference(b[:2], a[[1, 1]].copy())) == (
        "[0]: float64 arrays differ: nan vs nan (bits 0x7ff8000000000002 vs 0x7ff8000000000003) (1 of 2 elements differ)"
    )


def test_sparse_tensors_are_compared_as_the_dense_values_they_hold() -> None:
    a = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    assert difference(a.to_sparse(), a.clone().to_sparse()) is None
    b = a.clone()
    b[1, 1] = 5.0
    assert str(difference(a.to_sparse(), b.to_sparse())) == (
        "[1, 1]: torch.float32 tensors differ: 0.0 vs 5.0 (1 of 4 elements differ)"
    )


def test_negative_and_conjugate_views_are_compared_as_the_values_they_stand_for() -> None:
    ints = torch.tensor([1, -2, 3])
    assert difference(torch._neg_view(ints), torch.tensor([-1, 2, -3])) is None
    assert str(difference(torch._neg_view(ints), ints)) == (
        "[0]: torch.int64 tensors differ: -1 vs 1 (3 of 3 elements differ)"
    )
    floats = torch.tensor([1.5, -0.0, 2.0])
    assert difference(torch._neg_view(floats), torch.tensor([-1.5, 0.0, -2.0])) is None
    z = torch.tensor([1 + 2j, -3 - 4j])
    assert difference(z.conj(), torch.tensor([1 - 2j, -3 + 4j])) is None
    assert difference(torch._neg_view(z), torch.tensor([-1 - 2j, 3 + 4j])) is None
    assert difference(torch._neg_view(z.conj()), torch.tensor([-1 + 2j, 3 - 4j])) is None
    assert str(difference(z.conj(), z)) == (
        "[0]: torch.complex64 tensors differ: (1-2j) vs (1+2j) (2 of 2 elements differ)"
    )


def test_tensors_of_another_dtype_shape_or_layout_are_named_at_their_path() -> None:
    assert str(difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64), where="r[0]")) == (
        "r[0]: torch.float32[2] vs torch.float64[2]"
    )
    assert (
        str(difference(torch.zeros(2, 1), torch.zeros(1, 2))) == "the value: torch.float32[2, 1] vs torch.float32[1, 2]"
    )
    assert str(difference(torch.zeros(2), torch.zeros(2).to_sparse(), where="r")) == "r: strided vs sparse_coo tensors"


def test_values_of_other_types_are_named_by_both_types() -> None:
    assert str(difference(1, 1.0)) == "the value: int vs float"
    assert str(difference([1], (1,), where="r")) == "r: list vs tuple"
    assert str(difference({"x": complex(1, 2)}, {"x": complex(1, 3)}, where="r")) == "r['x']: (1+2j) vs (1+3j)"


def test_cyclic_containers_compare_once_around_the_cycle() -> None:
    a: list[Any] = [1]
    a.append(a)
    b: list[Any] = [1]
    b.append(b)
    assert difference(a, b) is None
    deep: list[Any] = [1, [1, [1, [2, []]]]]
    assert str(difference(deep, b)) == "[1][1][1][0]: 2 vs 1"
    assert str(difference(b, deep)) == "[1][1][1][0]: 1 vs 2"


def test_a_value_whose_equality_raises_is_refused_as_the_value_without_a_path() -> None:
    with pytest.raises(InvalidArgument) as info:
        difference(_Raises(), _Raises())
    assert str(info.value) == "crosscheck cannot compare the value: _Raises == _Raises raised ValueError: no"


def test_a_tensor_with_no_bytes_to_compare_is_refused_naming_its_layout_and_dtype() -> None:
    jagged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    tail = (
        "a jagged torch.float32 tensor has no bytes to compare (RuntimeError: to_dense does not support layout Jagged)"
    )
    with pytest.raises(InvalidArgument) as info:
        difference(jagged, jagged)
    assert str(info.value) == f"crosscheck cannot compare the value: {tail}"
    with pytest.raises(InvalidArgument) as info:
        difference([jagged], [jagged], where="r")
    assert str(info.value) == f"crosscheck cannot compare r[0]: {tail}"


def test_float_tensors_within_the_tolerances_are_equal_and_beyond_them_named() -> None:
    a = torch.tensor([1000.0, 0.0], dtype=torch.float64)
    assert difference(a, torch.tensor([1000.0, 1e-7], dtype=torch.float64), atol=1e-6) is None
    assert difference(a, torch.tensor([1000.0 + 1e-4, 0.0], dtype=torch.float64), rtol=1e-6) is None
    # beyond: torch's own defaults (rtol=1e-05, atol=1e-08) would take both of these
    assert str(difference(a, torch.tensor([1000.001, 0.0], dtype=torch.float64), atol=1e-6)) == (
        "[0]: torch.float64 tensors differ beyond rtol=0, atol=1e-06: 1000.0 vs 1000.001 (1 of 2 elements differ)"
    )
    assert str(difference(a, torch.tensor([1000.0, 1e-9], dtype=torch.float64), rtol=1e-6, where="r")) == (
        "r[1]: torch.float64 tensors differ beyond rtol=1e-06, atol=0: 0.0 vs 1e-09 (1 of 2 elements differ)"
    )
    # compared in float64: in bfloat16 itself, atol=0.0078 would round up to the 0.0078125 between the two
    one, next_up = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0078125], dtype=torch.bfloat16)
    assert str(difference(one, next_up, atol=0.0078)) == (
        "[0]: torch.bfloat16 tensors differ beyond rtol=0, atol=0.0078: 1.0 vs 1.0078125 (1 of 1 elements differ)"
    )
    assert difference(one, next_up, atol=0.0079) is None
