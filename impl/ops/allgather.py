"""Allgather of truly uneven shards with counts fixed in advance (SPEC D5, D6).

Each rank r holds ``counts[r]`` elements; every rank wants their exact concatenation. The counts are
known to all ranks beforehand (fixed when a parameter is registered), so no size exchange happens per
call. One gather is:

1. pack: the local shard goes into a contiguous send buffer of ``P = max(counts)`` elements
   (the tail is padding and never read back);
2. one all-gather of ``W * P`` elements into a padded buffer, issued through impl's guarded, counted
   collectives (:func:`impl.comm.collectives.all_gather_into`; pass ``comm=Comm(stats)`` to count it);
3. one compaction: rank r's first ``counts[r]`` elements of row r, concatenated. On CUDA that is one
   kernel launch (``csrc/allgather_compact.cu``), on CPU a C++ op (``csrc/allgather_compact_cpu.cpp``).

Several tensors can share one gather (D6): every rank's send row is the tensors' padded shards side by
side (``P_t = max(counts_t)`` each, the same size formula as a single gather), still one collective
and one compaction launch for all of them.

Per rank, with W = 3 and ``counts = [2, 0, 3]``::

    rank 0: allgather_v(tensor([1, 2]), counts, g)    -> tensor([1, 2, 7, 8, 9])
    rank 1: allgather_v(tensor([]), counts, g)        -> tensor([1, 2, 7, 8, 9])
    rank 2: allgather_v(tensor([7, 8, 9]), counts, g) -> tensor([1, 2, 7, 8, 9])

``group=None`` means the parallel dimension is absent (SPEC A1), never "the world": the caller is the
only rank. A group of one rank issues no collective either. Input errors are ``ValueError`` naming
the argument, the value and what is allowed, raised before any collective.

The pure-torch references (``compact_reference``, ``compact_grouped_reference``) define the results
that the native ops are tested against.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from impl.comm.collectives import Comm
from impl.ops import _build

__all__ = [
    "AllgatherV",
    "GroupedAllgatherV",
    "Impl",
    "allgather_v",
    "allgather_v_many",
    "compact",
    "compact_grouped",
    "compact_grouped_reference",
    "compact_reference",
    "shard_size",
]

#: Which compaction to run: the native op (C++ on CPU, the CUDA kernel on GPU) or the torch reference.
Impl = Literal["native", "reference"]
_IMPLS: tuple[str, ...] = ("native", "reference")


# --------------------------------------------------------------------------------------------------
# Layouts and validation


def _check_counts(counts: Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(counts, (str, bytes, Tensor)) or not isinstance(counts, Sequence):
        raise ValueError(f"{name}={counts!r} must be a sequence of element counts, one per rank")
    checked: list[int] = []
    for i, c in enumerate(counts):
        if isinstance(c, bool):
            raise ValueError(f"{name}[{i}]={c!r} must be an int >= 0, not a bool")
        try:
            value = operator.index(c)
        except TypeError:
            raise ValueError(f"{name}[{i}]={c!r} must be an int >= 0") from None
        if value < 0:
            raise ValueError(f"{name}[{i}]={value} must be >= 0 (an element count)")
        checked.append(value)
    if not checked:
        raise ValueError(f"{name}={counts!r} must have one entry per rank (at least one)")
    return tuple(checked)


def _check_impl(impl: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {list(_IMPLS)}")


def shard_size(counts: Sequence[int]) -> int:
    """The uniform shard size ``P`` one padded gather of ``counts`` uses: ``max(counts)`` (0 is fine)."""
    return max(_check_counts(counts, "counts"))


@dataclass(frozen=True)
class _Layout:
    """T tensors gathered over W ranks in one collective; ``counts[t][r]`` is tensor t on rank r."""

    counts: tuple[tuple[int, ...], ...]
    shard_sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.counts[0])

    @property
    def row(self) -> int:
        """Elements each rank sends: the tensors' padded shards side by side."""
        return sum(self.shard_sizes)

    @property
    def columns(self) -> tuple[int, ...]:
        """Offset of tensor t's shard within a rank's row."""
        offsets, at = [], 0
        for p in self.shard_sizes:
            offsets.append(at)
            at += p
        return tuple(offsets)

    @property
    def totals(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.counts)

    @property
    def flat_counts(self) -> list[int]:
        return [c for per_tensor in self.counts for c in per_tensor]


def _layout(counts_list: Sequence[Sequence[int]], shard_sizes: Sequence[int] | None) -> _Layout:
    if isinstance(counts_list, (str, bytes, Tensor)) or not isinstance(counts_list, Sequence):
        raise ValueError(f"counts_list={counts_list!r} must be a sequence of per-rank count lists")
    if len(counts_list) == 0:
        raise ValueError("counts_list=[] must hold one count list per tensor (at least one)")
    counts = tuple(_check_counts(c, f"counts_list[{t}]") for t, c in enumerate(counts_list))
    world = len(counts[0])
    for t, c in enumerate(counts):
        if len(c) != world:
            raise ValueError(
                f"counts_list[{t}] has {len(c)} entries but counts_list[0] has {world}: "
                "every tensor needs one count per rank"
            )
    if shard_sizes is None:
        sizes = tuple(max(c) for c in counts)  # the single-gather formula, per tensor (D6)
    else:
        sizes = _check_counts(shard_sizes, "shard_sizes")
        if len(sizes) != len(counts):
            raise ValueError(f"shard_sizes={list(sizes)!r} must have one entry per tensor ({len(counts)})")
        for t, (p, c) in enumerate(zip(sizes, counts, strict=True)):
            if max(c) > p:
                raise ValueError(f"shard_sizes[{t}]={p} is smaller than max(counts_list[{t}])={max(c)}")
    return _Layout(counts=counts, shard_sizes=sizes)


def _check_padded(padded: Tensor, layout: _Layout) -> None:
    expected = layout.world * layout.row
    if padded.numel() != expected:
        raise ValueError(
            f"padded.numel()={padded.numel()} must equal ranks * sum(shard sizes) = "
            f"{layout.world} * {layout.row} = {expected}"
        )


def _single_layout(padded: Tensor, counts: Sequence[int]) -> _Layout:
    checked = _check_counts(counts, "counts")
    world = len(checked)
    if padded.numel() % world != 0:
        raise ValueError(
            f"padded.numel()={padded.numel()} must be a multiple of len(counts)={world} (one equal-size shard per rank)"
        )
    p = padded.numel() // world
    for r, c in enumerate(checked):
        if c > p:
            raise ValueError(f"counts[{r}]={c} exceeds the shard size padded.numel() // len(counts) = {p}")
    return _Layout(counts=(checked,), shard_sizes=(p,))


def _check_out(out: Tensor, total: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Returns ``out`` as a 1-D view after checking that it can hold the result."""
    if out.numel() != total:
        raise ValueError(f"out.numel()={out.numel()} must equal the total count {total}")
    if out.dtype != dtype:
        raise ValueError(f"out.dtype={out.dtype} must equal the input dtype {dtype}")
    if out.device != device:
        raise ValueError(f"out.device={out.device} must equal the input device {device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got stride={out.stride()} for shape={tuple(out.shape)}")
    return out.view(-1)


# --------------------------------------------------------------------------------------------------
# Compaction: references and native ops


def compact_reference(padded: Tensor, counts: Sequence[int]) -> Tensor:
    """Pure-torch compaction: the first ``counts[r]`` elements of each of ``len(counts)`` equal shards.

    ``padded`` holds ``W * P`` elements, rank r's shard at offset ``r * P``; the result is 1-D with
    ``sum(counts)`` elements. This is the definition the native op is tested against (D5).
    """
    layout = _single_layout(padded, counts)
    p = layout.shard_sizes[0]
    flat = padded.reshape(-1)
    return torch.cat([flat[r * p : r * p + c] for r, c in enumerate(layout.counts[0])])


def compact(padded: Tensor, counts: Sequence[int], *, impl: Impl = "native") -> Tensor:
    """The exact concatenation of the valid prefixes of ``len(counts)`` equal shards of ``padded``.

    Same result as :func:`compact_reference`; ``impl="native"`` runs the C++ (CPU) or CUDA op, built
    on first use, ``impl="reference"`` the pure-torch reference.

    >>> compact(torch.tensor([1, 2, 0, 0, 0, 0, 7, 8, 9]), [2, 0, 3])
    tensor([1, 2, 7, 8, 9])
    """
    _check_impl(impl)
    _single_layout(padded, counts)  # ValueError before reaching the op's RuntimeError checks
    if impl == "reference":
        return compact_reference(padded, counts)
    _build.load_extension()
    result: Tensor = torch.ops.dstest_impl.compact(padded, [operator.index(c) for c in counts])
    return result


def compact_grouped_reference(
    padded: Tensor,
    counts_list: Sequence[Sequence[int]],
    shard_sizes: Sequence[int] | None = None,
) -> list[Tensor]:
    """Pure-torch grouped compaction (D6).

    ``padded`` is W rows (one per rank) of ``sum(shard_sizes)`` elements; tensor t's shard sits at
    column ``sum(shard_sizes[:t])`` of each row and ``counts_list[t][r]`` of it is valid. Returns, per
    tensor, the 1-D concatenation of its valid elements over the ranks. ``shard_sizes`` defaults to
    ``max(counts_list[t])`` per tensor, the size formula of a single gather.
    """
    layout = _layout(counts_list, shard_sizes)
    _check_padded(padded, layout)
    rows = padded.reshape(layout.world, layout.row)
    return [
        torch.cat([rows[r, col : col + c] for r, c in enumerate(counts)])
        for counts, col in zip(layout.counts, layout.columns, strict=True)
    ]


def compact_grouped(
    padded: Tensor,
    counts_list: Sequence[Sequence[int]],
    shard_sizes: Sequence[int] | None = None,
    *,
    out: Tensor | None = None,
    impl: Impl = "native",
) -> list[Tensor]:
    """Grouped compaction in one launch; same result as :func:`compact_grouped_reference`.

    The results are 1-D views into one tensor (``out`` when given: contiguous, ``sum`` of all counts
    elements, the dtype and device of ``padded``), tensor 0's elements first.
    """
    _check_impl(impl)
    layout = _layout(counts_list, shard_sizes)
    _check_padded(padded, layout)
    return _compact_layout(padded, layout, out, impl)


def _compact_layout(padded: Tensor, layout: _Layout, out: Tensor | None, impl: str) -> list[Tensor]:
    total = sum(layout.totals)
    if out is None:
        flat = torch.empty(total, dtype=padded.dtype, device=padded.device)
    else:
        flat = _check_out(out, total, padded.dtype, padded.device)
    if impl == "reference":
        parts = compact_grouped_reference(padded, layout.counts, layout.shard_sizes)
        torch.cat(parts, out=flat)
    elif total > 0:
        _build.load_extension()
        torch.ops.dstest_impl.compact_grouped_out(padded, layout.flat_counts, list(layout.shard_sizes), flat)
    return list(torch.split(flat, list(layout.totals)))


# --------------------------------------------------------------------------------------------------
# The allgather


def _world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:  # SPEC A1: an absent dimension, the caller is the only rank
        return 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"group={group!r} was given but torch.distributed is not initialised; "
            "pass group=None for an absent dimension"
        )
    world = dist.get_world_size(group)
    if world < 1:  # torch reports -1 to a caller outside the group (SPEC A4)
        raise ValueError(
            f"group={group!r}: this rank is not a member (group size {world}); "
            "only members of the group can take part in allgather_v"
        )
    return world, dist.get_rank(group)


class GroupedAllgatherV:
    """Gathers several uneven-shard tensors in one collective and one compaction launch (D5, D6).

    ``counts_list[t][r]`` is the element count of tensor t on rank r of ``group``, fixed here. The
    padded send and receive buffers are allocated once per (dtype, device) and reused by every call. The
    gather goes through ``comm`` (``Comm(stats)`` counts it as one "all_gather"; default: uncounted).

    Per rank, W = 2, ``counts_list = [[2, 1], [0, 3]]``::

        rank 0: g([tensor([1, 2]), tensor([])])           -> [tensor([1, 2, 5]), tensor([6, 7, 8])]
        rank 1: g([tensor([5]),    tensor([6, 7, 8])])    -> [tensor([1, 2, 5]), tensor([6, 7, 8])]
    """

    def __init__(
        self,
        counts_list: Sequence[Sequence[int]],
        group: dist.ProcessGroup | None = None,
        *,
        impl: Impl = "native",
        comm: Comm | None = None,
    ) -> None:
        _check_impl(impl)
        self._layout = _layout(counts_list, None)
        self._world, self._rank = _world_and_rank(group)
        if self._layout.world != self._world:
            raise ValueError(
                f"counts have {self._layout.world} entries per tensor but group={group!r} has "
                f"{self._world} ranks: give one count per rank"
            )
        self._group = group
        self._impl: Impl = impl
        self._comm = comm if comm is not None else Comm(None)
        self._buffers: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self._allocations = 0

    @property
    def counts_list(self) -> tuple[tuple[int, ...], ...]:
        return self._layout.counts

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """``max(counts_list[t])`` per tensor: the padded shard each rank sends for tensor t."""
        return self._layout.shard_sizes

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def totals(self) -> tuple[int, ...]:
        """Elements of each gathered tensor: ``sum(counts_list[t])``."""
        return self._layout.totals

    @property
    def buffer_allocations(self) -> int:
        """How many padded send/receive buffer pairs this object has allocated so far."""
        return self._allocations

    def _buffers_for(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (dtype, device)
        pair = self._buffers.get(key)
        if pair is None:
            row = self._layout.row
            send = torch.empty(row, dtype=dtype, device=device)
            padded = torch.empty(self._world * row, dtype=dtype, device=device)
            pair = (send, padded)
            self._buffers[key] = pair
            self._allocations += 1
        return pair

    def _check_locals(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
            raise ValueError(f"locals must be a sequence of tensors, got {type(tensors).__name__}")
        checked = list(tensors)
        if len(checked) != len(self._layout.counts):
            raise ValueError(f"got {len(checked)} local tensors but counts_list describes {len(self._layout.counts)}")
        for t, local in enumerate(checked):
            if not isinstance(local, Tensor):
                raise ValueError(f"locals[{t}] must be a Tensor, got {type(local).__name__}")
            want = self._layout.counts[t][self._rank]
            if local.numel() != want:
                raise ValueError(
                    f"locals[{t}].numel()={local.numel()} must equal counts_list[{t}][{self._rank}]={want}, "
                    f"the count fixed for rank {self._rank}"
                )
            if local.dtype != checked[0].dtype or local.device != checked[0].device:
                raise ValueError(
                    f"locals[{t}] is {local.dtype} on {local.device} but locals[0] is "
                    f"{checked[0].dtype} on {checked[0].device}: one gather needs one dtype and device"
                )
        return checked

    def __call__(self, locals: Sequence[Tensor], *, out: Tensor | None = None) -> list[Tensor]:
        """Gathers every tensor; returns their 1-D concatenations, views into one tensor (``out``).

        Not differentiable: the gather runs under ``torch.no_grad()`` (gathered parameters are data).
        """
        tensors = self._check_locals(locals)
        dtype, device = tensors[0].dtype, tensors[0].device
        layout = self._layout
        total = sum(layout.totals)
        flat = torch.empty(total, dtype=dtype, device=device) if out is None else _check_out(out, total, dtype, device)
        with torch.no_grad():
            if self._world == 1:
                # One rank: the concatenation is the local tensors themselves; no collective (SPEC A5).
                if total > 0:
                    torch.cat([t.reshape(-1) for t in tensors], out=flat)
                return list(torch.split(flat, list(layout.totals)))
            if layout.row == 0:
                return list(torch.split(flat, list(layout.totals)))  # every shard is empty on every rank
            send, padded = self._buffers_for(dtype, device)
            slots = [send[col : col + t.numel()].view(t.shape) for t, col in zip(tensors, layout.columns, strict=True)]
            if len(slots) == 1:
                slots[0].copy_(tensors[0])
            else:
                torch._foreach_copy_(slots, tensors)  # one multi-tensor launch on CUDA
            self._comm.all_gather_into(padded, send, self._group)
            return _compact_layout(padded, layout, flat, self._impl)


class AllgatherV:
    """Allgather-v of one tensor whose per-rank counts are fixed here (SPEC D5).

    ``counts[r]`` is rank r's element count. Each call packs the local shard into a reused padded send
    buffer of ``max(counts)`` elements, runs one all-gather (through ``comm``) into a reused buffer of
    ``W * max(counts)`` elements and one compaction into the exact concatenation (``sum(counts)``
    elements, 1-D).

    Per rank, W = 3, ``counts = [2, 0, 3]``::

        rank 0: AllgatherV(counts, g)(tensor([1, 2]))    -> tensor([1, 2, 7, 8, 9])
        rank 1: AllgatherV(counts, g)(tensor([]))        -> tensor([1, 2, 7, 8, 9])
        rank 2: AllgatherV(counts, g)(tensor([7, 8, 9])) -> tensor([1, 2, 7, 8, 9])
    """

    def __init__(
        self,
        counts: Sequence[int],
        group: dist.ProcessGroup | None = None,
        *,
        impl: Impl = "native",
        comm: Comm | None = None,
    ) -> None:
        checked = _check_counts(counts, "counts")
        self._grouped = GroupedAllgatherV([checked], group, impl=impl, comm=comm)

    @property
    def counts(self) -> tuple[int, ...]:
        return self._grouped.counts_list[0]

    @property
    def shard_size(self) -> int:
        """``max(counts)``: the padded shard every rank sends."""
        return self._grouped.shard_sizes[0]

    @property
    def world_size(self) -> int:
        return self._grouped.world_size

    @property
    def rank(self) -> int:
        return self._grouped.rank

    @property
    def total(self) -> int:
        return self._grouped.totals[0]

    @property
    def buffer_allocations(self) -> int:
        """How many padded send/receive buffer pairs this object has allocated so far."""
        return self._grouped.buffer_allocations

    def __call__(self, local: Tensor, *, out: Tensor | None = None) -> Tensor:
        """Gathers ``local`` (``counts[rank]`` elements) from every rank; returns the concatenation."""
        if not isinstance(local, Tensor):
            raise ValueError(f"local must be a Tensor, got {type(local).__name__}")
        if local.numel() != self.counts[self.rank]:
            raise ValueError(
                f"local.numel()={local.numel()} must equal counts[{self.rank}]={self.counts[self.rank]}, "
                f"the count fixed for rank {self.rank}"
            )
        return self._grouped([local], out=out)[0]


def allgather_v(
    local: Tensor,
    counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    out: Tensor | None = None,
    impl: Impl = "native",
    comm: Comm | None = None,
) -> Tensor:
    """One-shot :class:`AllgatherV`: gathers ``local`` (``counts[rank]`` elements) from every rank.

    Returns the 1-D concatenation of all ranks' shards (``sum(counts)`` elements), or writes it into
    ``out``. For repeated gathers keep an :class:`AllgatherV`, which reuses its buffers.
    """
    return AllgatherV(counts, group, impl=impl, comm=comm)(local, out=out)


def allgather_v_many(
    locals: Sequence[Tensor],
    counts_list: Sequence[Sequence[int]],
    group: dist.ProcessGroup | None = None,
    *,
    out: Tensor | None = None,
    impl: Impl = "native",
    comm: Comm | None = None,
) -> list[Tensor]:
    """One-shot :class:`GroupedAllgatherV`: one collective and one compaction for several tensors."""
    return GroupedAllgatherV(counts_list, group, impl=impl, comm=comm)(locals, out=out)
