"""Allgather of truly uneven shards with counts fixed in advance (contract D5, D6).

Each rank r holds ``counts[r]`` elements; every rank wants their exact concatenation. The counts are
known to all ranks beforehand (fixed when a parameter is registered), so no size exchange happens per
call. One gather is:

1. pack: the local shard goes into a contiguous send buffer of ``P = max(counts)`` elements
   (the tail is padding and never read back);
2. one all-gather of ``W * P`` elements into a padded buffer, issued through impl's guarded, counted
   collectives (:func:`impl.comm.collectives.all_gather_into`; pass ``comm=Comm(stats)`` to count it);
3. one compaction (:mod:`impl.ops.compact`): rank r's first ``counts[r]`` elements of row r,
   concatenated. On CUDA that is one kernel launch, on CPU a C++ op.

Several tensors can share one gather (D6): every rank's send row is the tensors' padded shards side by
side (``P_t = max(counts_t)`` each, the same size formula as a single gather), still one collective
and one compaction launch for all of them.

Per rank, with W = 3 and ``counts = [2, 0, 3]``::

    rank 0: allgather_v(tensor([1, 2]), counts, g)    -> tensor([1, 2, 7, 8, 9])
    rank 1: allgather_v(tensor([]), counts, g)        -> tensor([1, 2, 7, 8, 9])
    rank 2: allgather_v(tensor([7, 8, 9]), counts, g) -> tensor([1, 2, 7, 8, 9])

``group=None`` means the parallel dimension is absent (contract A1), never "the world": the caller is the
only rank. A group of one rank issues no collective either. Input errors are ``ValueError`` naming
the argument, the value and what is allowed, raised before any collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from impl.comm.collectives import Comm
from impl.ops.compact import Impl, check_counts, check_impl, check_out, compact_layout, grouped_layout

__all__ = ["AllgatherV", "GroupedAllgatherV", "allgather_v", "allgather_v_many"]


# --------------------------------------------------------------------------------------------------
# The allgather


def _world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:  # contract A1: an absent dimension, the caller is the only rank
        return 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"group={group!r} was given but torch.distributed is not initialised; "
            "pass group=None for an absent dimension"
        )
    world = dist.get_world_size(group)
    if world < 1:  # torch reports -1 to a caller outside the group (contract A4)
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
        check_impl(impl)
        self.grouped_layout = grouped_layout(counts_list, None)
        self._world, self._rank = _world_and_rank(group)
        if self.grouped_layout.world != self._world:
            raise ValueError(
                f"counts have {self.grouped_layout.world} entries per tensor but group={group!r} has "
                f"{self._world} ranks: give one count per rank"
            )
        self._group = group
        self._impl: Impl = impl
        self._comm = comm if comm is not None else Comm(None)
        self._buffers: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self._allocations = 0

    @property
    def counts_list(self) -> tuple[tuple[int, ...], ...]:
        return self.grouped_layout.counts

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """``max(counts_list[t])`` per tensor: the padded shard each rank sends for tensor t."""
        return self.grouped_layout.shard_sizes

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def totals(self) -> tuple[int, ...]:
        """Elements of each gathered tensor: ``sum(counts_list[t])``."""
        return self.grouped_layout.totals

    @property
    def buffer_allocations(self) -> int:
        """How many padded send/receive buffer pairs this object has allocated so far."""
        return self._allocations

    def _buffers_for(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (dtype, device)
        pair = self._buffers.get(key)
        if pair is None:
            row = self.grouped_layout.row
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
        if len(checked) != len(self.grouped_layout.counts):
            raise ValueError(
                f"got {len(checked)} local tensors but counts_list describes {len(self.grouped_layout.counts)}"
            )
        for t, local in enumerate(checked):
            if not isinstance(local, Tensor):
                raise ValueError(f"locals[{t}] must be a Tensor, got {type(local).__name__}")
            want = self.grouped_layout.counts[t][self._rank]
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
        layout = self.grouped_layout
        total = sum(layout.totals)
        flat = torch.empty(total, dtype=dtype, device=device) if out is None else check_out(out, total, dtype, device)
        with torch.no_grad():
            if self._world == 1:
                # One rank: the concatenation is the local tensors themselves; no collective (contract A5).
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
            return compact_layout(padded, layout, flat, self._impl)


class AllgatherV:
    """Allgather-v of one tensor whose per-rank counts are fixed here (contract D5).

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
        checked = check_counts(counts, "counts")
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
