"""crosscheck's details that mutation testing showed no fast test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/crosscheck.py`` runs mutmut over :mod:`dstest.crosscheck` with the comparison's
properties (tests/test_checker_properties_crosscheck.py) and this file. Each test here states what contract
E14 promises a user reads when the worlds differ (the text naming the call of the trace that differs, the
layout of two tensors, the values of two sets) and fails for at least one mutant that survived the
properties. Pure: the comparison and the trace's text are driven directly, no world is run.
"""

from __future__ import annotations

import pytest
import torch

from dstest.crosscheck import _trace_difference, difference

pytestmark = pytest.mark.cpu

# trace signatures as trace_signature gives them: (op, group, seq, dtype, shapes, reduce_op, root, peer, tag)
ALL_REDUCE = ("all_reduce", "world", 1, "torch.float32", ((2, 3),), "SUM", None, None, 0)
BROADCAST = ("broadcast", "world", 2, "torch.float32", ((4,),), None, 0, None, 0)
SEND = ("send", "group [0, 1]", None, "torch.int64", ((1,),), None, None, 1, 0)


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
    from dstest.errors import InvalidArgument

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
    def __eq__(self, other: object) -> object:
        import numpy as np

        return np.bool_(True)

    __hash__ = None  # type: ignore[assignment]
