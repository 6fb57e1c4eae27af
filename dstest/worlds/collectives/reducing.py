"""The reducing collectives and broadcast: all_reduce, reduce, broadcast, reduce_scatter (list and tensor).

Each class is one rank's side of one collective (see :mod:`dstest.worlds.collectives`): what it checks
alone, what it must share with its peers, and how its result is formed and delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dstest.errors import InvalidArgument
from dstest.worlds.collectives.base import (
    REDUCE_OPS,
    Call,
    SingleTensorCall,
    check_reduce,
    check_root,
    copy_flat,
    describe_tensor,
    flat_view,
    is_large,
    outputs_apart,
    premultiplied,
    raw,
    reduce_into,
    reduce_tensors,
    shapes_text,
    storages_apart,
)
from dstest.worlds.core.matching import signature as _sig


class AllReduce(Call):
    op = "all_reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str) -> None:
        self.group_rank = group_rank  # Call.__init__'s two fields set here directly: the hottest collective
        self.group_size = group_size
        self.tensor = tensor
        self.reduce_op = reduce_op

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise InvalidArgument(f"all_reduce op={self.reduce_op!r}; allowed: {sorted(REDUCE_OPS)}")

    def key(self) -> tuple[Any, ...]:
        # Call.key's fields and the tensor's signature in one tuple (Reduce adds its root through self.root)
        return (self.op, self.reduce_op, self.root, _sig(self.tensor, self.strict_shapes))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        result = reduce_tensors(self.reduce_op, [premultiplied(c.reduce_op, c.tensor) for c in calls])  # type: ignore[attr-defined]
        return [result] * len(calls)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        ts: list[torch.Tensor] = [c.tensor for c in calls]  # type: ignore[attr-defined]
        first = ts[0]
        if self.reduce_op == "premul_sum" or not (first.is_contiguous() and storages_apart(ts)):
            return super().deliver(calls)
        # In place at every size (the aliasing check costs less than the staging copy; a group of one
        # rank then moves nothing): fold into rank 0's tensor, whose own input is the first operand, then
        # copy it out. Tensors that share storage across ranks take the staged path.
        assert self.reduce_op is not None
        check_reduce(self.reduce_op, first.dtype)
        result = reduce_into(self.reduce_op, first, ts[1:], len(ts))
        if result is not first:
            copy_flat(first, result)
        src, shape = raw(first), first.shape
        for t in ts[1:]:  # copy_flat(t, first), its calls inline
            raw(t).copy_(src if t.shape == shape else src.reshape(t.shape))
        return {}

    def finish(self, source: Any) -> None:
        copy_flat(self.tensor, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class Reduce(AllReduce):
    op = "reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str, root: int) -> None:
        super().__init__(group_rank, group_size, tensor, reduce_op)
        self.root = root

    def check_local(self) -> None:
        super().check_local()
        check_root(self)

    # Only the root's tensor may change, and the fold starts from rank 0's input: staged.
    deliver = Call.deliver

    def finish(self, source: Any) -> None:
        if self.group_rank == self.root:
            copy_flat(self.tensor, source)


class Broadcast(Call):
    op = "broadcast"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, root: int) -> None:
        super().__init__(group_rank, group_size)
        self.tensor = tensor
        self.root = root

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        check_root(self)

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.tensor))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        src = calls[self.root].tensor.detach().clone()  # type: ignore[attr-defined]
        return [src] * len(calls)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        assert self.root is not None
        src: torch.Tensor = calls[self.root].tensor  # type: ignore[attr-defined]
        others = [c for c in calls if c.group_rank != self.root]
        if not outputs_apart([c.tensor for c in others], [src]):  # type: ignore[attr-defined]
            return super().deliver(calls)
        failed: dict[int, BaseException] = {}
        for c in others:  # straight from the root's tensor: no staging copy
            try:
                copy_flat(c.tensor, src)  # type: ignore[attr-defined]
            except Exception as exc:
                failed[c.group_rank] = exc
        return failed

    def finish(self, source: Any) -> None:
        if self.group_rank != self.root:
            copy_flat(self.tensor, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class ReduceScatter(Call):
    op = "reduce_scatter"
    version_bumps = 1  # gloo reduces into a staging buffer, then copies into the output

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inps: Sequence[torch.Tensor], reduce_op: str
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inps = list(inps)
        self.reduce_op = reduce_op

    def details(self) -> str:
        return f"in={shapes_text(self.inps)}, out={describe_tensor(self.out)}"

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
        return (*super().key(), tuple(self.sig(t) for t in self.inps))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        return [
            reduce_tensors(self.reduce_op, [premultiplied(c.reduce_op, c.inps[j]) for c in calls])  # type: ignore[attr-defined]
            for j in range(len(calls))
        ]

    def finish(self, source: Any) -> None:
        copy_flat(self.out, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class ReduceScatterTensor(SingleTensorCall):
    op = "reduce_scatter_tensor"
    version_bumps = 1  # as the list form

    def __init__(self, group_rank: int, group_size: int, out: torch.Tensor, inp: torch.Tensor, reduce_op: str) -> None:
        super().__init__(group_rank, group_size, out, inp)
        self.reduce_op = reduce_op

    def check_local(self) -> None:
        self._check_scaled("input", self.inp, "output", self.out)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        n = self.out.numel()
        flat = reduce_tensors(self.reduce_op, [premultiplied(c.reduce_op, flat_view(c.inp)) for c in calls])  # type: ignore[attr-defined]
        return [flat[j * n : (j + 1) * n] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        # gloo's reduce_scatter_tensor copies its result into the output through torch: a bool sum arrives
        # as 0 or 1, where all_reduce, reduce and the list reduce_scatter leave the summed bytes
        copy_flat(self.out, source, as_bytes=False)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        outs: list[torch.Tensor] = [c.out for c in calls]  # type: ignore[attr-defined]
        inps: list[torch.Tensor] = [c.inp for c in calls]  # type: ignore[attr-defined]
        if self.reduce_op == "premul_sum" or self.out.dtype == torch.bool or not (
            is_large(self.out) and all(o.is_contiguous() for o in outs) and outputs_apart(outs, inps)
        ):
            return super().deliver(calls)
        assert self.reduce_op is not None
        check_reduce(self.reduce_op, self.inp.dtype)
        n = self.out.numel()
        flats = [i.detach().reshape(-1) for i in inps]
        for j, out in enumerate(outs):  # rank j's chunk of every input, folded in rank order into its output
            o = out.view(-1)
            copy_flat(o, flats[0][j * n : (j + 1) * n])
            result = reduce_into(self.reduce_op, o, [f[j * n : (j + 1) * n] for f in flats[1:]], len(flats))
            if result is not o:
                copy_flat(o, result)
        return {}
