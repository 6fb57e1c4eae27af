"""One small class per collective: what one rank brought, how ranks must agree, how the result is formed.

A ``Call`` is one rank's side of one collective. The world that hosts the ranks matches calls across ranks
by (group, sequence number) and then:

1. ``check_local()`` on each call as it arrives (sizes that one rank alone can get wrong);
2. ``check_peer(first)`` against the first call that arrived (op, dtype, shapes, root, counts);
3. ``combine(calls)`` once, by the last rank to arrive, which reads every rank's inputs while all of them
   are still waiting and returns per-rank sources that no rank can mutate afterwards;
4. ``finish(source)`` on each rank, which copies its source into that rank's output tensors.

Messages name the op, the group, the sequence number and each rank's shapes, as gloo and NCCL do not.

The module is longer than most (about 600 lines) on purpose: it is one table, a small class per c10d
collective with the same four steps, which both the threaded world's session and the process world's
referee read; splitting it would scatter one contract over several files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from dstest.errors import CollectiveMismatch, InvalidArgument

__all__ = ["CALLS", "Call", "describe_tensor", "reduce_tensors"]


def describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device.type}"


def _fold(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], torch.Tensor]:
    """Reduce in rank order into one fresh tensor, in place: no stacked copy of every rank's input."""

    def reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].detach().clone()
        for t in tensors[1:]:
            step(out, t.detach())
        return out

    return reduce


def _integral_only(name: str, reduce: Callable[[Sequence[torch.Tensor]], torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], torch.Tensor]:
    def checked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        dtype = tensors[0].dtype
        if dtype.is_floating_point or dtype.is_complex:
            raise InvalidArgument(f"reduce op {name!r} on dtype={dtype}: only integer and bool tensors allowed")
        return reduce(tensors)

    return checked


def _sum_step(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.logical_or_(t) if out.dtype == torch.bool else out.add_(t)


def _product_step(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.logical_and_(t) if out.dtype == torch.bool else out.mul_(t)


def _avg(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = _fold(_sum_step)(tensors)
    if total.dtype.is_floating_point or total.dtype.is_complex:
        return total.div_(len(tensors))
    return torch.div(total, len(tensors), rounding_mode="trunc")


_REDUCERS: dict[str, Callable[[Sequence[torch.Tensor]], torch.Tensor]] = {
    "sum": _fold(_sum_step),
    "avg": _avg,
    "product": _fold(_product_step),
    "min": _fold(lambda out, t: torch.minimum(out, t, out=out)),
    "max": _fold(lambda out, t: torch.maximum(out, t, out=out)),
    "band": _integral_only("band", _fold(lambda out, t: out.bitwise_and_(t))),
    "bor": _integral_only("bor", _fold(lambda out, t: out.bitwise_or_(t))),
    "bxor": _integral_only("bxor", _fold(lambda out, t: out.bitwise_xor_(t))),
}


def reduce_tensors(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reduce same-shaped tensors, in rank order, with a c10d reduce op name ('sum', 'avg', 'min', ...)."""
    try:
        reducer = _REDUCERS[op]
    except KeyError:
        raise InvalidArgument(
            f"reduce op {op!r} is not supported by the threaded world; allowed: {sorted(_REDUCERS)}"
        ) from None
    return reducer(tensors)


class Call:
    """One rank's side of one collective."""

    op: ClassVar[str] = "?"
    reduce_op: str | None = None
    root: int | None = None

    def __init__(self, group_rank: int, group_size: int) -> None:
        self.group_rank = group_rank
        self.group_size = group_size

    # -- description -------------------------------------------------------------------------------
    def details(self) -> str:
        return ""

    def describe(self) -> str:
        extra = [self.details()]
        if self.reduce_op is not None:
            extra.append(f"op={self.reduce_op}")
        if self.root is not None:
            extra.append(f"root={self.root}")
        return f"{self.op}({', '.join(e for e in extra if e)})"

    # -- validation --------------------------------------------------------------------------------
    def check_local(self) -> None:
        """Raise InvalidArgument for sizes that are wrong on this rank alone."""

    def key(self) -> tuple[Any, ...]:
        """What every rank must agree on (compared against the first arrival)."""
        return (self.op, self.reduce_op, self.root)

    def check_peer(self, first: Call) -> str | None:
        """Return why this call cannot match ``first``, or None."""
        if type(self) is not type(first):
            return "different collectives"
        if self.key() != first.key():
            return "different arguments"
        return None

    def check_all(self, calls: Sequence[Call]) -> str | None:
        """Checks that need every rank's call (pairings of all_to_all, per-rank gather sizes)."""
        return None

    # -- data ----------------------------------------------------------------------------------------
    def combine(self, calls: Sequence[Call]) -> list[Any]:
        return [None] * len(calls)

    def finish(self, source: Any) -> None:
        """Copy this rank's result from ``source`` into its output tensors."""

    def outputs(self) -> list[torch.Tensor]:
        return []


def _shapes(ts: Sequence[torch.Tensor]) -> str:
    return "[" + ", ".join(describe_tensor(t) for t in ts) + "]"


def _sig(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.device.type)


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgument(f"{what}: expected exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


class AllReduce(Call):
    op = "all_reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str) -> None:
        super().__init__(group_rank, group_size)
        self.tensor = tensor
        self.reduce_op = reduce_op

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        if self.reduce_op not in _REDUCERS:
            raise InvalidArgument(f"all_reduce op={self.reduce_op!r}; allowed: {sorted(_REDUCERS)}")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), _sig(self.tensor))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        result = reduce_tensors(self.reduce_op, [c.tensor for c in calls])  # type: ignore[attr-defined]
        return [result] * len(calls)

    def finish(self, source: Any) -> None:
        self.tensor.copy_(source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class Reduce(AllReduce):
    op = "reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str, root: int) -> None:
        super().__init__(group_rank, group_size, tensor, reduce_op)
        self.root = root

    def check_local(self) -> None:
        super().check_local()
        _check_root(self)

    def finish(self, source: Any) -> None:
        if self.group_rank == self.root:
            self.tensor.copy_(source)


def _check_root(call: Call) -> None:
    assert call.root is not None
    if not 0 <= call.root < call.group_size:
        raise InvalidArgument(
            f"{call.op}: root={call.root} is not a rank of the group (group ranks 0..{call.group_size - 1})"
        )


class Broadcast(Call):
    op = "broadcast"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, root: int) -> None:
        super().__init__(group_rank, group_size)
        self.tensor = tensor
        self.root = root

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        _check_root(self)

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), _sig(self.tensor))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        src = calls[self.root].tensor.detach().clone()  # type: ignore[attr-defined]
        return [src] * len(calls)

    def finish(self, source: Any) -> None:
        if self.group_rank != self.root:
            self.tensor.copy_(source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class _IntoList(Call):
    """Every rank's input, copied into this rank's output list (all_gather; gather on the root)."""

    inp: torch.Tensor
    outs: list[torch.Tensor]

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        srcs = [c.inp.detach().clone() for c in calls]  # type: ignore[attr-defined]
        return [srcs] * len(calls)

    def finish(self, source: Any) -> None:
        for out, src in zip(self.outs, source):
            out.copy_(src)

    def outputs(self) -> list[torch.Tensor]:
        return self.outs


class AllGather(_IntoList):
    """all_gather into a list; ranks may contribute different shapes (NCCL and this world accept it)."""

    op = "all_gather"

    def __init__(self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inp = inp

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}, out={_shapes(self.outs)}"

    def check_local(self) -> None:
        if len(self.outs) != self.group_size:
            raise InvalidArgument(
                f"all_gather: output list has {len(self.outs)} tensors, the group has {self.group_size} ranks"
            )
        mine = self.outs[self.group_rank]
        if mine.shape != self.inp.shape or mine.dtype != self.inp.dtype:
            raise InvalidArgument(
                f"all_gather: output[{self.group_rank}] is {describe_tensor(mine)} but this rank's input "
                f"is {describe_tensor(self.inp)}"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inp.dtype, tuple(tuple(o.shape) for o in self.outs))

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, c in enumerate(calls):
            want = tuple(self.outs[i].shape)
            if tuple(c.inp.shape) != want:  # type: ignore[attr-defined]
                return f"rank {i} sends {describe_tensor(c.inp)} but output[{i}] expects shape {list(want)}"  # type: ignore[attr-defined]
        return None



class _SingleTensorCall(Call):
    """A collective over one input and one output tensor, one of them group-size times the other."""

    def __init__(self, group_rank: int, group_size: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inp = inp

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}, out={describe_tensor(self.out)}"

    def _check_scaled(self, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor) -> None:
        if big.numel() != small.numel() * self.group_size:
            raise InvalidArgument(
                f"{self.op}: {big_name} has {big.numel()} elements, expected group size {self.group_size} "
                f"x {small_name} {small.numel()} = {small.numel() * self.group_size}"
            )
        if self.out.dtype != self.inp.dtype:
            raise InvalidArgument(f"{self.op}: output dtype {self.out.dtype} != input dtype {self.inp.dtype}")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), _sig(self.inp), _sig(self.out))

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class AllGatherIntoTensor(_SingleTensorCall):
    op = "all_gather_into_tensor"

    def check_local(self) -> None:
        self._check_scaled("output", self.out, "input", self.inp)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        flat = torch.cat([c.inp.detach().reshape(-1) for c in calls])  # type: ignore[attr-defined]
        return [flat] * len(calls)

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))


class ReduceScatter(Call):
    op = "reduce_scatter"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inps: Sequence[torch.Tensor], reduce_op: str
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inps = list(inps)
        self.reduce_op = reduce_op

    def details(self) -> str:
        return f"in={_shapes(self.inps)}, out={describe_tensor(self.out)}"

    def check_local(self) -> None:
        if len(self.inps) != self.group_size:
            raise InvalidArgument(
                f"reduce_scatter: input list has {len(self.inps)} tensors, the group has {self.group_size} ranks"
            )
        mine = self.inps[self.group_rank]
        if _sig(mine) != _sig(self.out):
            raise InvalidArgument(
                f"reduce_scatter: output is {describe_tensor(self.out)} but input[{self.group_rank}] is "
                f"{describe_tensor(mine)}"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), tuple(_sig(t) for t in self.inps))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        return [
            reduce_tensors(self.reduce_op, [c.inps[j] for c in calls])  # type: ignore[attr-defined]
            for j in range(len(calls))
        ]

    def finish(self, source: Any) -> None:
        self.out.copy_(source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class ReduceScatterTensor(_SingleTensorCall):
    op = "reduce_scatter_tensor"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inp: torch.Tensor, reduce_op: str
    ) -> None:
        super().__init__(group_rank, group_size, out, inp)
        self.reduce_op = reduce_op

    def check_local(self) -> None:
        self._check_scaled("input", self.inp, "output", self.out)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        n = self.out.numel()
        flat = reduce_tensors(self.reduce_op, [c.inp.reshape(-1) for c in calls])  # type: ignore[attr-defined]
        return [flat[j * n : (j + 1) * n] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))


class AllToAll(Call):
    op = "all_to_all"

    def __init__(
        self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]
    ) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inps = list(inps)

    def details(self) -> str:
        return f"in={_shapes(self.inps)}, out={_shapes(self.outs)}"

    def check_local(self) -> None:
        if len(self.outs) != self.group_size or len(self.inps) != self.group_size:
            raise InvalidArgument(
                f"all_to_all: {len(self.inps)} inputs and {len(self.outs)} outputs, the group has "
                f"{self.group_size} ranks (one of each per rank)"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inps[0].dtype if self.inps else None)

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, src in enumerate(calls):
            for j, dst in enumerate(calls):
                sent, slot = src.inps[j], dst.outs[i]  # type: ignore[attr-defined]
                if _sig(sent) != _sig(slot):
                    return f"rank {i} sends {describe_tensor(sent)} to rank {j}, whose output[{i}] is {describe_tensor(slot)}"
        return None

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        copies = [[t.detach().clone() for t in c.inps] for c in calls]  # type: ignore[attr-defined]
        return [[copies[i][j] for i in range(len(calls))] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        for out, src in zip(self.outs, source):
            out.copy_(src)

    def outputs(self) -> list[torch.Tensor]:
        return self.outs


class AllToAllSingle(Call):
    op = "all_to_all_single"

    def __init__(
        self,
        group_rank: int,
        group_size: int,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inp = inp
        self.out_splits = self._splits(list(out_splits), out, "output")
        self.in_splits = self._splits(list(in_splits), inp, "input")

    def _splits(self, splits: list[int], t: torch.Tensor, what: str) -> list[int]:
        if not splits:
            rows = t.shape[0] if t.dim() else 0
            if rows % self.group_size:
                raise InvalidArgument(
                    f"all_to_all_single: {what} dim 0 is {rows}, not divisible by the group size "
                    f"{self.group_size}; pass {what}_split_sizes"
                )
            return [rows // self.group_size] * self.group_size
        if len(splits) != self.group_size:
            raise InvalidArgument(
                f"all_to_all_single: {what}_split_sizes has {len(splits)} entries, the group has {self.group_size} ranks"
            )
        if sum(splits) != (t.shape[0] if t.dim() else 0):
            raise InvalidArgument(
                f"all_to_all_single: {what}_split_sizes={splits} sum to {sum(splits)}, but the {what} "
                f"has {t.shape[0] if t.dim() else 0} rows"
            )
        return splits

    def details(self) -> str:
        return (
            f"in={describe_tensor(self.inp)} splits={self.in_splits}, "
            f"out={describe_tensor(self.out)} splits={self.out_splits}"
        )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inp.dtype, tuple(self.inp.shape[1:]))

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, src in enumerate(calls):
            for j, dst in enumerate(calls):
                if src.in_splits[j] != dst.out_splits[i]:  # type: ignore[attr-defined]
                    return (
                        f"rank {i} sends {src.in_splits[j]} rows to rank {j}, "  # type: ignore[attr-defined]
                        f"which expects {dst.out_splits[i]}"  # type: ignore[attr-defined]
                    )
        return None

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        pieces = [list(torch.split(c.inp.detach().clone(), c.in_splits)) for c in calls]  # type: ignore[attr-defined]
        return [torch.cat([pieces[i][j] for i in range(len(calls))]) for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class Gather(_IntoList):
    op = "gather"

    def __init__(
        self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int
    ) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inp = inp
        self.root = root

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}" + (f", out={_shapes(self.outs)}" if self.outs else "")

    def check_local(self) -> None:
        _check_root(self)
        if self.group_rank == self.root and len(self.outs) != self.group_size:
            raise InvalidArgument(
                f"gather: gather_list on the root has {len(self.outs)} tensors, the group has {self.group_size} ranks"
            )
        if self.group_rank != self.root and self.outs:
            raise InvalidArgument("gather: gather_list must be None on ranks other than the root")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), _sig(self.inp))



class Scatter(Call):
    op = "scatter"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inps: Sequence[torch.Tensor], root: int
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inps = list(inps)
        self.root = root

    def details(self) -> str:
        return f"out={describe_tensor(self.out)}" + (f", in={_shapes(self.inps)}" if self.inps else "")

    def check_local(self) -> None:
        _check_root(self)
        if self.group_rank == self.root:
            if len(self.inps) != self.group_size:
                raise InvalidArgument(
                    f"scatter: scatter_list on the root has {len(self.inps)} tensors, the group has "
                    f"{self.group_size} ranks"
                )
            bad = [i for i, t in enumerate(self.inps) if _sig(t) != _sig(self.out)]
            if bad:
                raise InvalidArgument(
                    f"scatter: scatter_list[{bad[0]}] is {describe_tensor(self.inps[bad[0]])}, the output is "
                    f"{describe_tensor(self.out)}"
                )
        elif self.inps:
            raise InvalidArgument("scatter: scatter_list must be None on ranks other than the root")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), _sig(self.out))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        return [t.detach().clone() for t in calls[self.root].inps]  # type: ignore[attr-defined]

    def finish(self, source: Any) -> None:
        self.out.copy_(source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class Barrier(Call):
    op = "barrier"


CALLS: dict[str, type[Call]] = {
    cls.op: cls
    for cls in (
        AllReduce,
        Reduce,
        Broadcast,
        AllGather,
        AllGatherIntoTensor,
        ReduceScatter,
        ReduceScatterTensor,
        AllToAll,
        AllToAllSingle,
        Gather,
        Scatter,
        Barrier,
    )
}


def mismatch(op_desc: str, a_rank: int, a: Call, b_rank: int, b: Call, why: str) -> CollectiveMismatch:
    return CollectiveMismatch(
        f"{op_desc}: rank {a_rank} called {a.describe()} but rank {b_rank} called {b.describe()} ({why})"
    )
