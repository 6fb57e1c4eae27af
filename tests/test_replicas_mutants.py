"""assert_replicas' details that mutation testing showed no fast test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/replicas/*.py`` runs mutmut over :mod:`dstest.replicas` with the checker's
properties (tests/test_checker_properties_replicas.py), the threaded world's tests of tests/test_replicas.py
and this file. Each test here states what contract G4 promises (every rank of the group gets the same verdict,
the message names what differs, where and by how much; bad arguments are refused before any collective) and
fails for at least one mutant that survived the others. On the threaded world only (a few ms a run): the
process world runs the same module, and tests/test_replicas.py runs both.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.context import RankContext
from dstest.errors import InvalidArgument, ReplicasDiverge

pytestmark = pytest.mark.cpu


def _refusals(ctx: RankContext, settings: list[dict[str, Any]]) -> list[str]:
    """Each setting's refusal, every rank alone (no collective may start), then one barrier: still in step."""
    out = []
    for kwargs in settings:
        with pytest.raises(InvalidArgument) as info:
            dstest.assert_replicas([torch.zeros(2)], **kwargs)
        out.append(str(info.value))
    dist.barrier()
    return out


BAD_TOLERANCES: list[tuple[dict[str, Any], str]] = [
    ({"rtol": -1e-9}, "rtol=-1e-09: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": -1}, "atol=-1: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"rtol": math.inf}, "rtol=inf: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": math.nan}, "atol=nan: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"rtol": True}, "rtol=True: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": "0"}, "atol='0': must be a finite number >= 0 (0 compares bit for bit)"),
    ({"what": 3}, "what=3: must be a str naming what is compared, or None"),
]


def test_bad_tolerances_and_names_are_refused_in_full_on_every_rank() -> None:
    settings = [kwargs for kwargs, _ in BAD_TOLERANCES]
    expected = [text for _, text in BAD_TOLERANCES]
    assert dstest.run(_refusals, 2, args=(settings,)) == [expected, expected]


def _caught(obj: object, **kwargs: Any) -> str | None:
    try:
        dstest.assert_replicas(obj, **kwargs)
    except ReplicasDiverge as exc:
        return str(exc)
    return None


def _float32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


def _messages(ctx: RankContext) -> list[str | None]:
    r, t = ctx.rank, torch.zeros(2)
    keys = [f"k{i}" for i in range(7)]
    return [
        _caught({"w": torch.cat([torch.ones(1), _float32(0x7FC00001 + r)])}),  # NaNs of two payloads
        _caught({k: t for k in keys} if r == 0 else {"k0": t}),  # 7 names: 5 shown and 2 more
        _caught({k: t for k in keys[:6]} if r == 0 else {"k0": t}),  # 6 names: 5 lacking, shown all
        _caught({"u": torch.tensor([2**63 + r, 5], dtype=torch.uint64)}, atol=1),  # uint64: exact arithmetic
        _caught({"u": torch.tensor([2**63 + 3 * r, 5], dtype=torch.uint64)}, atol=1),
        _caught({f"d{i}": torch.full((2,), float(r * i)) for i in range(8)}),  # 7 differ: 1 named, 5 also, 1 more
        _caught({f"d{i}": torch.full((2,), float(r * i)) for i in range(7)}),
        _caught({"b": torch.tensor([True, r == 1])}),  # no arithmetic: the first difference
        _caught(torch.tensor([1.0, r])),
        _caught([torch.tensor([1.0, r])], what="the weights"),
    ]


HEAD = "replicas of tensors diverge over ranks [0, 1]: "
FIRST = "tensor 'k0', tensor 'k1', tensor 'k2', tensor 'k3', tensor 'k4'"
NAMES = "tensor 'k1', tensor 'k2', tensor 'k3', tensor 'k4', tensor 'k5'"
D1 = (
    "tensor 'd1' (float32[2]) differs bit for bit: ranks [0] vs ranks [1]; largest absolute difference 1 at index (0,) "
)
ALSO = "(rank 0: 0, rank 1: 1); also different: tensor 'd2', tensor 'd3', tensor 'd4', tensor 'd5', tensor 'd6'"


def test_every_rank_reads_the_same_message_naming_what_differs_where_and_by_how_much() -> None:
    expected = [
        HEAD + "tensor 'w' (float32[2]) differs bit for bit: ranks [0] vs ranks [1]; largest absolute difference 0 at "
        "index (1,) (rank 0: nan (0x7fc00001), rank 1: nan (0x7fc00002))",
        HEAD + "the ranks hold different tensors (rank 0 holds 7: " + FIRST + " and 2 more): "
        "ranks [1] lack " + NAMES + " and 1 more",
        HEAD + "the ranks hold different tensors (rank 0 holds 6: " + FIRST + " and 1 more): ranks [1] lack " + NAMES,
        None,
        HEAD + "tensor 'u' (uint64[2]) differs beyond rtol=0, atol=1: ranks [0] vs ranks [1]; largest absolute "
        "difference 3 at index (0,) (rank 0: 9223372036854775808, rank 1: 9223372036854775811)",
        HEAD + D1 + ALSO + " and 1 more",
        HEAD + D1 + ALSO,
        HEAD + "tensor 'b' (bool[2]) differs bit for bit: ranks [0] vs ranks [1]; first difference at index (1,) "
        "(rank 0: False, rank 1: True)",
        "replicas of tensor diverge over ranks [0, 1]: the tensor (float32[2]) differs bit for bit: ranks [0] vs "
        "ranks [1]; largest absolute difference 1 at index (1,) (rank 0: 0, rank 1: 1)",
        "replicas of the weights diverge over ranks [0, 1]: tensor [0] (float32[2]) differs bit for bit: ranks [0] "
        "vs ranks [1]; largest absolute difference 1 at index (1,) (rank 0: 0, rank 1: 1)",
    ]
    assert dstest.run(_messages, 2) == [expected, expected]


def bit_dtypes(ctx: RankContext) -> list[str | None]:
    """Tensors of dtypes without arithmetic (bits, packed float4), equal and then one element apart on rank 1."""
    out = []
    for dtype in (torch.bits8, torch.bits16, torch.float4_e2m1fn_x2):
        raw = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        out.append(_caught({"p": raw.view(dtype)}))
        raw[2] += ctx.rank
        out.append(_caught({"p": raw.view(dtype)}))
    return out


_FIRST = "differs bit for bit: ranks [0] vs ranks [1]; first difference at index"
BIT_DTYPES_EXPECTED = [
    None,
    HEAD + f"tensor 'p' (bits8[4]) {_FIRST} (2,) (rank 0: bits 0x03, rank 1: bits 0x04)",
    None,
    HEAD + f"tensor 'p' (bits16[2]) {_FIRST} (1,) (rank 0: bits 0x0403, rank 1: bits 0x0404)",
    None,
    HEAD + f"tensor 'p' (float4_e2m1fn_x2[4]) {_FIRST} (2,) (rank 0: bits 0x03, rank 1: bits 0x04)",
]


def test_tensors_of_dtypes_without_arithmetic_that_differ_are_named_by_their_bits() -> None:
    """G4 for every dtype: the first element whose bits differ, shown as bits (no Python value holds it). The
    process world: tests/test_checker_properties_replicas.py."""
    assert dstest.run(bit_dtypes, 2) == [BIT_DTYPES_EXPECTED, BIT_DTYPES_EXPECTED]


_DTYPES = [torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
_DTYPES += [torch.complex128, torch.int64]


def _one_element_apart(ctx: RankContext) -> list[str | None]:
    """For each dtype (elements of 1, 2, 4, 8 and 16 bytes), three elements, the last one's bits changed on rank 1
    (for complex dtypes, its imaginary part only)."""
    out = []
    for dtype in _DTYPES:
        t = torch.zeros(3, dtype=dtype)
        if ctx.rank == 1:
            value: Any = True if dtype == torch.bool else (1j if dtype.is_complex else 1)
            t[2] = value
        out.append(_caught({"t": t}))
    return out


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_the_element_that_differs_is_found_for_every_element_size_with_or_without_numpy(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    from dstest.replicas import values

    if path == "torch":  # torch runs without numpy: the elements are then compared with torch alone
        monkeypatch.setattr(values, "_numpy", lambda: None)
    results = dstest.run(_one_element_apart, 2)
    assert results[0] == results[1]
    for dtype, text in zip(_DTYPES, results[0]):
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.bool:
            shown = "first difference at index (2,) (rank 0: False, rank 1: True)"
        elif dtype.is_complex:
            shown = "largest absolute difference 1 at index (2,) (rank 0: 0j, rank 1: 1j)"
        else:
            shown = "largest absolute difference 1 at index (2,) (rank 0: 0, rank 1: 1)"
        assert text == HEAD + f"tensor 't' ({name}[3]) differs bit for bit: ranks [0] vs ranks [1]; {shown}", dtype


def _signs_apart(ctx: RankContext) -> list[str | None]:
    """-100 on rank 0, 100 on rank 1: 200 apart, in every integer dtype that holds both (int8's own arithmetic
    would wrap)."""
    out = []
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        t = torch.tensor([3, 100 if ctx.rank else -100], dtype=dtype)
        out += [_caught({"i": t}, atol=200), _caught({"i": t}, atol=199), _caught({"i": t}, rtol=1.99)]
    return out


def test_integers_are_compared_under_a_tolerance_by_their_exact_difference() -> None:
    results = dstest.run(_signs_apart, 2)
    assert results[0] == results[1]
    for k, name in enumerate(("int8", "int16", "int32", "int64")):
        within, beyond, relative = results[0][3 * k : 3 * k + 3]
        assert within is None, name
        tail = "ranks [0] vs ranks [1]; largest absolute difference 200 at index (1,) (rank 0: -100, rank 1: 100)"
        assert beyond == HEAD + f"tensor 'i' ({name}[2]) differs beyond rtol=0, atol=199: {tail}"
        assert relative == HEAD + f"tensor 'i' ({name}[2]) differs beyond rtol=1.99, atol=0: {tail}"


def _checked_after_a_step(ctx: RankContext) -> list[str | None]:
    """replicas_checked: bit for bit by default (a weight 1e-3 apart on rank 1 fails), over the group given (two
    pairs of ranks, equal within a pair, not across: passes), and a bad group refused when it is called."""
    import torch.nn as nn

    from dstest.replicas import replicas_checked

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out: list[str | None] = []
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0 + (1e-3 if ctx.rank == 1 else 0.0))  # within any default tolerance but 0
        model.bias.fill_(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        with replicas_checked(model):  # the module's own function: ctx's passes its own defaults
            opt.step()
        out.append(None)
    except ReplicasDiverge as exc:
        out.append(str(exc).split(":")[0])
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(float(ctx.rank // 2))
    with ctx.replicas_checked(model, group=pairs[ctx.rank // 2]):
        opt.step()  # raises if the check is made over the world
    with pytest.raises(InvalidArgument) as info:
        ctx.replicas_checked(model, group=3)
    out.append(str(info.value))
    return out


def test_replicas_checked_compares_bit_for_bit_by_default_over_the_group_given() -> None:
    expected = [
        "replicas of Linear after optimizer step 1 (SGD) diverge over ranks [0, 1, 2, 3]",
        "group=3: must be a torch.distributed ProcessGroup (or None for the world), got int",
    ]
    assert dstest.run(_checked_after_a_step, 4) == [expected] * 4


def _three_ranks(ctx: RankContext) -> list[str | None]:
    """Ranks 1 and 2 each differ from rank 0, at other elements: the message names rank 1's difference, the first
    of the largest (a tie) or the first of a dtype without arithmetic."""
    r = ctx.rank
    floats = torch.zeros(3)
    bools = torch.zeros(3, dtype=torch.bool)
    if r:
        floats[r - 1] = 1.0
        bools[r - 1] = True
    return [_caught({"f": floats}), _caught({"b": bools})]


def test_of_several_ranks_that_differ_the_lowest_ones_difference_is_named() -> None:
    head = "replicas of tensors diverge over ranks [0, 1, 2]: "
    expected = [
        head + "tensor 'f' (float32[3]) differs bit for bit: ranks [0] vs ranks [1] vs ranks [2]; largest absolute "
        "difference 1 at index (0,) (rank 0: 0, rank 1: 1)",
        head + "tensor 'b' (bool[3]) differs bit for bit: ranks [0] vs ranks [1] vs ranks [2]; first difference at "
        "index (0,) (rank 0: False, rank 1: True)",
    ]
    assert dstest.run(_three_ranks, 3) == [expected] * 3


def _floats_at_the_edges(ctx: RankContext) -> list[str | None]:
    r = ctx.rank
    nan = _float32(0x7FC00001 + r)
    return [
        _caught({"n": torch.cat([torch.ones(1), nan])}, rtol=0.1),  # NaNs of two payloads: within any tolerance
        _caught({"z": torch.tensor([0.0 if r else -0.0])}, atol=1e-9),  # -0.0 and 0.0: 0 apart
        _caught({"e": torch.tensor([1.0 + 0.5 * r])}, atol=0.5),  # exactly atol apart: within
        _caught({"e": torch.tensor([1.0 + 0.5 * r])}, atol=0.25, rtol=0.25),  # exactly atol + rtol * |x0|: within
        _caught({"big": torch.tensor([3e38 if r else -3e38])}, atol=1),  # 6e38 apart: float32 would say inf
        _caught({"i": torch.tensor([math.inf if r else -math.inf])}, rtol=1),  # inf and -inf: inf apart
    ]


def test_floats_are_compared_in_float64_with_nans_alike_and_the_bounds_within() -> None:
    results = dstest.run(_floats_at_the_edges, 2)
    assert results[0] == results[1]
    vs = "ranks [0] vs ranks [1]; largest absolute difference"
    assert results[0] == [
        None,
        None,
        None,
        None,
        HEAD + f"tensor 'big' (float32[1]) differs beyond rtol=0, atol=1: {vs} 6e+38 at index (0,) (rank 0: "
        "-3.00000001e+38, rank 1: 3.00000001e+38)",
        HEAD + f"tensor 'i' (float32[1]) differs beyond rtol=1, atol=0: {vs} inf at index (0,) (rank 0: -inf, "
        "rank 1: inf)",
    ]


def _mesh_groups(ctx: RankContext) -> list[str | None]:
    """A DTensor replicated on both dimensions of a 2 x 2 mesh, whose local tensor differs on rank 3: it differs
    over two groups (mesh dim 0's [1, 3], dim 1's [2, 3]); every rank names the same, the first entry's. Then two
    tensors beyond a tolerance: the first is named."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    local = torch.zeros(2)
    if ctx.rank == 3:
        local[1] = 1.0
    w = DTensor.from_local(local, mesh, [Replicate(), Replicate()], run_check=False)
    s = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=False)  # dim 1 compared, not dim 0
    r = ctx.rank
    return [
        _caught({"w": w}),
        _caught({"a": torch.tensor([1.0 + r]), "b": torch.tensor([2.0 + r])}, atol=0.5),
        _caught({"s": s}),
        _caught({"s": s, "x": torch.zeros(1)} if r == 0 else {"s": s}),  # the mesh covers the group: no full tensor
    ]


def test_differences_over_several_groups_give_every_rank_the_first_one() -> None:
    head = "replicas of tensors diverge over ranks [0, 1, 2, 3]: "
    expected = [
        head + "tensor 'w' (local, Replicate on mesh dim 0 'dp') (float32[2]) differs bit for bit: ranks [1] vs "
        "ranks [3]; largest absolute difference 1 at index (1,) (rank 1: 0, rank 3: 1)",
        head + "tensor 'a' (float32[1]) differs beyond rtol=0, atol=0.5: ranks [0] vs ranks [1] vs ranks [2] vs "
        "ranks [3]; largest absolute difference 3 at index (0,) (rank 0: 1, rank 3: 4)",
        head + "tensor 's' (local, Replicate on mesh dim 1 'tp') (float32[2]) differs bit for bit: ranks [2] vs "
        "ranks [3]; largest absolute difference 1 at index (1,) (rank 2: 0, rank 3: 1)",
        head + "the ranks hold different tensors (rank 0 holds 2: tensor 's' (local, Replicate on mesh dim 1 'tp'), "
        "tensor 'x'): ranks [1, 2, 3] lack tensor 'x'",
    ]
    assert dstest.run(_mesh_groups, 4) == [expected] * 4


def _plain(ctx: RankContext) -> str | None:
    return _caught({"t": torch.tensor([float(ctx.rank)])})


def test_a_body_that_never_loaded_dtensor_is_checked_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """assert_replicas does not import DTensor for a body that has none (G4's checks stay cheap): as in a process
    that never loaded ``torch.distributed.tensor`` (None in sys.modules: importing it would raise)."""
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)
    results = dstest.run(_plain, 2)
    assert results[0] == results[1] and results[0] is not None
    assert results[0].startswith(HEAD + "tensor 't' (float32[1]) differs bit for bit")


def _refused(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(InvalidArgument) as info:
        dstest.assert_replicas(*args, **kwargs)
    return str(info.value)


def _bad_arguments(ctx: RankContext) -> list[str | None]:
    """Each refusal in full, every rank alone (nothing was sent), then a module's own check: named by its class."""
    import torch.nn as nn

    t = torch.zeros(2)
    alone = dist.new_group([1])  # rank 0 is not a member
    out: list[str | None] = [
        _refused([t], group=alone) if ctx.rank == 0 else None,
        _refused([t], group=3),
        _refused("model"),
        _refused({"a": t, "b": 3}),
        _refused({"a": t.to_sparse()}),
        _refused([torch.empty(2, device="meta")]),
    ]
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(float(ctx.rank))
    out.append(_caught(model))
    return out


def test_bad_arguments_are_refused_in_full_and_a_module_is_named_by_its_class() -> None:
    dense = "it compares dense (strided) tensors with data (for a sparse one, pass its .to_dense(); meta tensors hold no values)"
    common = [
        "group=3: must be a torch.distributed ProcessGroup (or None for the world), got int",
        "assert_replicas got a str: it compares an nn.Module (its parameters and buffers), a tensor, or a dict or list "
        "of tensors",
        "assert_replicas: tensor 'b' is a int, not a tensor; a dict or list passed to assert_replicas holds tensors only",
        f"assert_replicas: tensor 'a' is a torch.sparse_coo tensor on cpu; {dense}",
        f"assert_replicas: tensor [0] is a torch.strided tensor on meta; {dense}",
        "replicas of Linear diverge over ranks [0, 1]: parameter 'bias' (float32[1]) differs bit for bit: ranks [0] vs "
        "ranks [1]; largest absolute difference 1 at index (0,) (rank 0: 0, rank 1: 1)",
    ]
    not_member = (
        "group=-100: rank 0 is not a member (dist.new_group gives non-members GroupMember.NON_GROUP_MEMBER); only the "
        "ranks of the group call assert_replicas (a collective over it)"
    )
    assert dstest.run(_bad_arguments, 2) == [[not_member, *common], [None, *common]]
    assert _refused([torch.zeros(1)]) == (
        "assert_replicas: torch.distributed is not initialized; call it inside a rank body"
    )


class _Alike:
    """A dict key that prints as the string 'a' does: a name assert_replicas cannot tell from 'a'."""

    def __repr__(self) -> str:
        return "'a'"


def _structures(ctx: RankContext) -> list[str | None]:
    """A list (named "tensors"), two kinds of structure change at once, and two names a rank cannot tell apart."""
    r, t = ctx.rank, torch.zeros(1)
    out = [_caught([torch.tensor([float(r)])])]
    out.append(_caught({"a": t, "b": t} if r == 0 else ({"a": t} if r == 1 else {"a": t, "b": t, "c": t})))
    with pytest.raises(InvalidArgument) as info:
        dstest.assert_replicas({"a": t} if r == 0 else {"a": t, _Alike(): t})
    out.append(str(info.value))
    return out


def test_lists_two_structure_changes_and_names_alike_are_named_in_full() -> None:
    head = "replicas of tensors diverge over ranks [0, 1, 2]: "
    expected = [
        head + "tensor [0] (float32[1]) differs bit for bit: ranks [0] vs ranks [1] vs ranks [2]; largest absolute "
        "difference 2 at index (0,) (rank 0: 0, rank 2: 2)",
        head + "the ranks hold different tensors (rank 0 holds 2: tensor 'a', tensor 'b'): ranks [1] lack tensor 'b'; "
        "ranks [2] hold tensor 'c' extra",
        "assert_replicas: rank 1 holds two tensors named tensor 'a' (dict keys whose repr() is the same); replicas are "
        "matched by name across ranks: give them names that differ",
    ]
    assert dstest.run(_structures, 3) == [expected] * 3


def _one_complex_element(ctx: RankContext) -> list[str | None]:
    """complex128 tensors of one element, apart in the imaginary part on rank 1 (a 0-d one and one of shape [1])."""
    value = 1j if ctx.rank == 1 else 0j
    z = torch.tensor(value, dtype=torch.complex128)
    return [_caught({"z": z}), _caught({"z": z.reshape(1)})]


def test_the_element_that_differs_in_a_one_element_complex128_tensor_is_found_without_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """G4 without numpy: a 16-byte element is two int64 words, and the element that differs is found by element,
    not by word (its imaginary word is no element of its own)."""
    from dstest.replicas import values

    monkeypatch.setattr(values, "_numpy", lambda: None)
    tail = "differs bit for bit: ranks [0] vs ranks [1]; largest absolute difference 1 at index"
    expected = [
        HEAD + f"tensor 'z' (complex128[]) {tail} () (rank 0: 0j, rank 1: 1j)",
        HEAD + f"tensor 'z' (complex128[1]) {tail} (0,) (rank 0: 0j, rank 1: 1j)",
    ]
    assert dstest.run(_one_complex_element, 2) == [expected, expected]


def _mesh_subgroups(ctx: RankContext) -> list[str | None]:
    """On a 2 x 2 mesh (dp, tp) of 4 ranks: a check over each rank's tp group of a DTensor replicated on both
    dimensions (dp's group is not within it, tp's is), two DTensors that differ over other groups (the first in
    order is named, whatever its group), a DTensor sharded unevenly on dp (a different local shape on each tp
    group, the same within it), and on a 1 x 4 mesh a dimension of one rank (nothing to compare on it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    r = ctx.rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    apart = torch.tensor([0.0, 1.0 if r == 3 else 0.0])
    w = DTensor.from_local(apart, mesh, [Replicate(), Replicate()], run_check=False)
    a = DTensor.from_local(apart, mesh, [Shard(0), Replicate()], run_check=False)  # compared on tp: [2, 3]
    b = DTensor.from_local(apart, mesh, [Replicate(), Shard(0)], run_check=False)  # compared on dp: [1, 3]
    uneven = distribute_tensor(torch.arange(5.0), mesh, [Shard(0), Replicate()])  # 3 rows on dp 0, 2 on dp 1
    flat = init_device_mesh("cpu", (1, 4), mesh_dim_names=("solo", "all"))
    v = DTensor.from_local(torch.zeros(2), flat, [Replicate(), Replicate()], run_check=False)
    out = [_caught({"w": w}, group=mesh.get_group("tp")), _caught({"a": a, "b": b}), _caught({"u": uneven})]
    if r == 3:
        uneven.to_local()[1] += 1.0
    out.append(_caught({"u": uneven}))
    out.append(_caught({"v": v, "x": torch.zeros(1)} if r == 0 else {"v": v}))
    return out


def test_dtensors_are_compared_over_their_replicated_dimensions_groups_within_the_group() -> None:
    """G4's layouts: a Replicate dimension whose group lies within ``group`` is compared even after one whose group
    does not; the message names the first tensor that differs; local shapes are compared within each group (an
    uneven Shard differs across groups by design); a dimension of one rank compares nothing and adds no name."""
    tp = [None, None] + [
        "replicas of tensors diverge over ranks [2, 3]: tensor 'w' (local, Replicate on mesh dim 1 'tp') (float32[2]) "
        "differs bit for bit: ranks [2] vs ranks [3]; largest absolute difference 1 at index (1,) (rank 2: 0, rank 3: 1)"
    ] * 2
    head = "replicas of tensors diverge over ranks [0, 1, 2, 3]: "
    common = [
        head + "tensor 'a' (local, Replicate on mesh dim 1 'tp') (float32[2]) differs bit for bit: ranks [2] vs ranks "
        "[3]; largest absolute difference 1 at index (1,) (rank 2: 0, rank 3: 1)",
        None,
        head + "tensor 'u' (local, Replicate on mesh dim 1 'tp') (float32[2]) differs bit for bit: ranks [2] vs ranks "
        "[3]; largest absolute difference 1 at index (1,) (rank 2: 4, rank 3: 5)",
        head + "the ranks hold different tensors (rank 0 holds 2: tensor 'v' (local, Replicate on mesh dim 1 'all'), "
        "tensor 'x'): ranks [1, 2, 3] lack tensor 'x'",
    ]
    assert dstest.run(_mesh_subgroups, 4) == [[tp[r], *common] for r in range(4)]


def _halves(ctx: RankContext) -> list[str | None]:
    """8 ranks on a 2 x 2 x 2 mesh (rep, dp, tp), checked over each half of the world ([0..3] and [4..7], a rep
    slice each: rep's groups are not within it, dp's and tp's are): a DTensor apart on rank 3 and on rank 6, then on
    rank 3 alone; then DTensors on each rank's tp mesh, a strict part of its half (also compared as full tensors):
    zeros on tp groups [0, 1] and [4, 5], ones on [2, 3] and [6, 7], then float32 on the first, float64 on the
    second."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    r = ctx.rank
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "dp", "tp"))
    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    half = halves[r // 4]
    both = DTensor.from_local(torch.tensor([0.0, float(r in (3, 6))]), mesh, [Replicate()] * 3, run_check=False)
    one = DTensor.from_local(torch.tensor([0.0, float(r == 3)]), mesh, [Replicate()] * 3, run_check=False)
    second = r // 2 % 2  # the second tp group of its half
    ones = DTensor.from_local(torch.full((2,), float(second)), mesh["tp"], [Replicate()], run_check=False)
    wide = torch.float64 if second else torch.float32
    wider = DTensor.from_local(torch.zeros(2, dtype=wide), mesh["tp"], [Replicate()], run_check=False)
    return [_caught({"w": t}, group=half) for t in (both, one)] + [_caught({"f": t}, group=half) for t in (ones, wider)]


def test_a_check_over_part_of_the_world_agrees_over_that_part_and_compares_full_tensors_over_it() -> None:
    """G4 over a group that is not the world: the verdict is agreed over the group only (each half its own, a half
    without a difference passes), and the full tensors of a mesh that is a strict part of the group are compared,
    by value and by dtype, over the group."""

    def local(low: int, high: int) -> str:
        return (
            f"tensor 'w' (local, Replicate on mesh dim 1 'dp') (float32[2]) differs bit for bit: ranks [{low}] vs "
            f"ranks [{high}]; largest absolute difference 1 at index (1,) (rank {low}: 0, rank {high}: 1)"
        )

    def expected(first: int) -> list[str | None]:
        ranks = list(range(first, first + 4))
        head = f"replicas of tensors diverge over ranks {ranks}: "
        pairs = f"ranks {ranks[:2]} vs ranks {ranks[2:]}"
        return [
            head + (local(1, 3) if first == 0 else local(4, 6)),
            head + local(1, 3) if first == 0 else None,
            head + f"tensor 'f' (full tensor) (float32[2]) differs bit for bit: {pairs}; largest absolute difference "
            f"1 at index (0,) (rank {first}: 0, rank {first + 2}: 1)",
            head + f"tensor 'f' (full tensor) has different shapes or dtypes: ranks {ranks[:2]} float32[2] vs ranks "
            f"{ranks[2:]} float64[2]",
        ]

    assert dstest.run(_halves, 8) == [expected(0)] * 4 + [expected(4)] * 4
