"""The gathering and exchanging collectives: all_gather (list and tensor), gather, scatter, all_to_all
(list and single tensor), and barrier.

Each class is one rank's side of one collective (see :mod:`dstest.worlds.collectives`): what it checks
alone, what it must share with its peers, and how its result is formed and delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dstest.errors import InvalidArgument
from dstest.worlds.collectives.base import (
    Call,
    SingleTensorCall,
    bump_versions,
    check_root,
    copy_flat,
    copy_tensors,
    describe_tensor,
    flat_view,
    is_large,
    shapes_text,
    storage_of,
    storages_apart,
)
from dstest.worlds.core.matching import signature as _sig

_NUMEL = torch.Tensor.numel


class _IntoList(Call):
    """Every rank's input, copied into this rank's output list (all_gather; gather on the root)."""

    inp: torch.Tensor
    outs: list[torch.Tensor]
    version_bumps = 1  # gloo gathers into a staging buffer, then copies into each output

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        srcs = [c.inp.detach().clone() for c in calls]  # type: ignore[attr-defined]
        return [srcs] * len(calls)

    def finish(self, source: Any) -> None:
        copy_tensors(self.outs, source)

    def outputs(self) -> list[torch.Tensor]:
        return self.outs

    def bump_versions(self, calls: Sequence[Call]) -> None:
        # W outputs per rank, W^2 in all: each rank's in one call into torch where no two of them share a
        # storage (only tensors of one storage can share a version counter), else one at a time.
        for c in calls:
            outs = c.outputs()
            bump_versions(outs, self.version_bumps, apart=storages_apart(outs))


class AllGather(_IntoList):
    """all_gather into a list; ranks may contribute different shapes (NCCL and this world accept it)."""

    op = "all_gather"

    def __init__(self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inp = inp

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}, out={shapes_text(self.outs)}"

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
        # The input's dtype and device type (ranks may bring other sizes), and every rank's output size.
        if self.strict_shapes:
            return (*super().key(), self.sig(self.inp)[::2], tuple(self.sig(o)[1] for o in self.outs))
        try:  # the sizes of W tensors without a Python call per tensor (sig's [1] when not strict)
            sizes = tuple(map(_NUMEL, self.outs))
        except TypeError:  # the process world's metadata: not tensors
            sizes = tuple(self.sig(o)[1] for o in self.outs)
        return (*super().key(), self.sig(self.inp)[::2], sizes)

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, c in enumerate(calls):
            want, sent = self.outs[i], c.inp  # type: ignore[attr-defined]
            if self.sig(sent)[1] != self.sig(want)[1]:
                what = f"shape {list(want.shape)}" if self.strict_shapes else f"{want.numel()} elements"
                return f"rank {i} sends {describe_tensor(sent)} but output[{i}] expects {what}"
        return None


class AllGatherIntoTensor(SingleTensorCall):
    op = "all_gather_into_tensor"
    version_bumps = 1  # per chunk: gloo copies from a staging buffer into each rank's chunk of the output

    def _bumps(self) -> int:
        return self.group_size

    def check_local(self) -> None:
        self._check_scaled("output", self.out, "input", self.inp)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        flat = torch.cat([flat_view(c.inp) for c in calls])  # type: ignore[attr-defined]  # (in raw_writes: no graph)
        return [flat] * len(calls)

    def finish(self, source: Any) -> None:
        copy_flat(self.out, source)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        outs: list[torch.Tensor] = [c.out for c in calls]  # type: ignore[attr-defined]
        inps: list[torch.Tensor] = [c.inp.detach() for c in calls]  # type: ignore[attr-defined]
        inside = self._inputs_in_own_output(outs, inps) if is_large(self.inp) else None
        if inside is None:
            return super().deliver(calls)
        n = self.inp.numel()
        for k, out in enumerate(outs):  # every input read in place, every output written once
            flat = out.view(-1)
            if k not in inside:
                torch.cat([i.reshape(-1) for i in inps], out=flat)
                continue
            for i, inp in enumerate(inps):
                if i != k:
                    flat[i * n : (i + 1) * n].copy_(inp.reshape(-1))
        return {}

    @staticmethod
    def _inputs_in_own_output(outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]) -> set[int] | None:
        """The ranks whose input is their own output's chunk (FSDP's in-place all-gather), or None when
        reading inputs in place is unsafe (an input inside another rank's output, or outputs that share
        storage or are not contiguous)."""
        stores = [storage_of(o) for o in outs]
        if None in stores or len(set(stores)) != len(stores) or not all(o.is_contiguous() for o in outs):
            return None
        inside: set[int] = set()
        for i, inp in enumerate(inps):
            s = storage_of(inp)
            if s is None:
                return None
            if s in stores:
                chunk = outs[i].data_ptr() + i * inp.numel() * inp.element_size()
                if s != stores[i] or not inp.is_contiguous() or inp.data_ptr() != chunk:
                    return None
                inside.add(i)
        return inside


class AllToAll(Call):
    op = "all_to_all"
    version_bumps = 1  # gloo exchanges through staging buffers, then copies into each output

    def __init__(
        self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]
    ) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inps = list(inps)

    def details(self) -> str:
        return f"in={shapes_text(self.inps)}, out={shapes_text(self.outs)}"

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
                if self.sig(sent) != self.sig(slot):
                    return f"rank {i} sends {describe_tensor(sent)} to rank {j}, whose output[{i}] is {describe_tensor(slot)}"
        return None

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        copies = [[t.detach().clone() for t in c.inps] for c in calls]  # type: ignore[attr-defined]
        return [[copies[i][j] for i in range(len(calls))] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        copy_tensors(self.outs, source)

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
        return (*super().key(), self.sig(self.inp)[::2], tuple(self.inp.shape[1:]))  # (dtype, device type)

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
        return f"in={describe_tensor(self.inp)}" + (f", out={shapes_text(self.outs)}" if self.outs else "")

    def check_local(self) -> None:
        check_root(self)
        if self.group_rank == self.root and len(self.outs) != self.group_size:
            raise InvalidArgument(
                f"gather: gather_list on the root has {len(self.outs)} tensors, the group has {self.group_size} ranks"
            )
        if self.group_rank != self.root and self.outs:
            raise InvalidArgument("gather: gather_list must be None on ranks other than the root")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.inp))


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
        return f"out={describe_tensor(self.out)}" + (f", in={shapes_text(self.inps)}" if self.inps else "")

    def check_local(self) -> None:
        check_root(self)
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
        return (*super().key(), self.sig(self.out))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        return [t.detach().clone() for t in calls[self.root].inps]  # type: ignore[attr-defined]

    def finish(self, source: Any) -> None:
        copy_flat(self.out, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class Barrier(Call):
    op = "barrier"
