"""Stage-3 gathers: partitioned parameters into pooled padded buffers (contract D3, D4, D5, D6).

:class:`BufferPool` keeps gather buffers keyed by ``(dtype, device)`` and fitted by size: ``acquire`` hands out a
free buffer of that key large enough for the request or allocates one (counted in ``allocations``),
``release`` returns it. Released buffers stay in the pool, so gathering again allocates nothing (D4), and
a buffer is never handed out under another dtype or device. The pool holds no more buffers than were in
use at once (one module's parameters and the transient send and receive buffers, not the model's),
which is what keeps stage 3 partitioned (D8).

:class:`ParamGatherer` gathers the shards of :mod:`impl.zero.partition` over a data-parallel group:

single, padded layout (D3)
    one all-gather with uniform count P from the shard itself (contiguous, P elements) into a pooled
    buffer of W·P elements; the parameter is ``buffer[:N].view(shape)``, a view: no copy, and the
    padding (``buffer[N:]``) is never part of it.
single, uneven layout (D5)
    the impl.ops allgather-v: the shard is packed into a pooled send buffer of P = max(counts), one
    all-gather into a pooled W·P buffer, one compaction (``impl.ops.compact_grouped``: the C++ op on CPU,
    one CUDA kernel launch on GPU) into a pooled buffer of N elements. Counts are fixed at registration,
    so no size is exchanged per call.
grouped (D6)
    several parameters in one launch: every rank's send row is the shards side by side (P_t each, the
    same size formula as a single gather), one all-gather of W·ΣP_t, one compaction into one pooled
    buffer of ΣN_t elements; each parameter is a view of it.

A group that is not parallel (absent, one rank, non-member: W = 1, P = N) issues nothing: the
parameter is a view of the shard itself.

Per rank, W = 2, a parameter of shape (3,) = [1, 2, 3], P = 2::

    rank 0: shard [1, 2]  gather(0) -> tensor([1, 2, 3])   buffer [1, 2, 3, 0]
    rank 1: shard [3, 0]  gather(0) -> tensor([1, 2, 3])   buffer [1, 2, 3, 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from impl.comm.collectives import Comm
from impl.comm.pg_utils import effective_rank, effective_size
from impl.ops import Impl, compact_grouped
from impl.zero.partition import ParamShard

__all__ = ["BufferPool", "ParamGatherer", "PoolKey"]

PoolKey = tuple[torch.dtype, torch.device]


class BufferPool:
    """Reusable 1-D gather buffers, keyed by ``(dtype, device)`` and fitted by size.

    ``acquire(numel, dtype, device)`` returns the first ``numel`` elements of the smallest free buffer of
    that dtype and device holding at least ``numel``; when none is large enough it allocates one of exactly
    ``numel`` (counted in ``allocations``), dropping the largest free buffer of the key that was too small.
    So the pool never holds more buffers than were in use at once, none larger than the largest request,
    and a repeating sequence of gathers stops allocating after its first round (D4).
    """

    def __init__(self) -> None:
        self._free: dict[PoolKey, list[torch.Tensor]] = {}
        self._base: dict[int, torch.Tensor] = {}  # id(handed-out view) -> its buffer
        self._in_use: dict[int, torch.Tensor] = {}  # id(handed-out view) -> the view (keeps the id valid)
        self.allocations = 0
        """Buffers allocated since creation; acquiring a free buffer does not count."""
        self.acquires = 0

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``numel`` elements of ``dtype`` on ``device``, from a free buffer when one is large enough."""
        key = (dtype, torch.device(device))
        self.acquires += 1
        free = self._free.setdefault(key, [])
        fits = [j for j, b in enumerate(free) if b.numel() >= numel]
        if fits:
            buf = free.pop(min(fits, key=lambda j: free[j].numel()))
        else:
            if free:  # replace the largest buffer that is too small: the pool does not grow in count
                free.pop(max(range(len(free)), key=lambda j: free[j].numel()))
            buf = torch.empty(int(numel), dtype=dtype, device=key[1])
            self.allocations += 1
        view = buf[: int(numel)]
        self._base[id(view)] = buf
        self._in_use[id(view)] = view
        return view

    def release(self, view: torch.Tensor) -> None:
        """Give back a tensor that :meth:`acquire` returned (the same object), once."""
        buf = self._base.pop(id(view), None)
        if buf is None or self._in_use.pop(id(view), None) is not view:
            raise ValueError(
                f"release(view): a tensor of shape {tuple(view.shape)} that this pool did not hand out, "
                "or released twice"
            )
        self._free.setdefault((buf.dtype, buf.device), []).append(buf)

    def buffer_of(self, view: torch.Tensor) -> torch.Tensor:
        """The whole pooled buffer behind a tensor that :meth:`acquire` returned."""
        return self._base[id(view)]

    def nbytes(self) -> int:
        """Bytes of every buffer the pool holds, free or in use."""
        held = [*self._base.values(), *(b for f in self._free.values() for b in f)]
        return sum(b.numel() * b.element_size() for b in held)

    def in_use(self) -> int:
        """Buffers handed out and not yet released."""
        return len(self._base)

    def free_buffers(self) -> int:
        return sum(len(f) for f in self._free.values())

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the allocator); buffers in use are kept."""
        self._free = {}


@dataclass(eq=False)
class _Holding:
    """A pooled buffer that backs one or more gathered parameters; returned when the last is released."""

    buffer: torch.Tensor
    members: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Gathered:
    view: torch.Tensor
    holding: _Holding | None  # None: a view of the shard itself (group not parallel)
    start: int  # element offset of the parameter in the storage of ``view``


class ParamGatherer:
    """Gathers partitioned parameters (one :class:`ParamShard` each) over ``group``; see the module docstring.

    ``comm`` counts the collectives (``Comm(stats)``); ``pool`` may be shared; ``impl`` picks the
    compaction of uneven and grouped gathers ("native": the impl.ops C++/CUDA op, "reference": torch).
    Gathering an already gathered parameter returns its current view and issues nothing.
    """

    def __init__(
        self,
        shards: Sequence[ParamShard],
        group: Any,
        *,
        comm: Comm | None = None,
        pool: BufferPool | None = None,
        impl: Impl = "native",
    ) -> None:
        self.shards = list(shards)
        self.group = group
        self.comm = comm or Comm(None)
        self.pool = pool if pool is not None else BufferPool()
        self.impl: Impl = impl
        self.world_size = effective_size(group)
        self.rank = effective_rank(group)
        for s in self.shards:
            if s.layout.world_size != self.world_size:
                raise ValueError(
                    f"parameter {s.name!r} is laid out for {s.layout.world_size} ranks, the group has {self.world_size}"
                )
        self._gathered: dict[int, _Gathered] = {}
        self.launches = 0
        """Gather collectives issued (one per single gather, one per grouped gather)."""
        self.compactions = 0
        self.last_row: int | None = None
        """Elements each rank sent in the last gather collective (P, or ΣP_t for a grouped gather)."""

    # -- state ----------------------------------------------------------------------------------------
    def is_gathered(self, i: int) -> bool:
        return i in self._gathered

    def gathered(self) -> list[int]:
        """Indices of the parameters gathered now."""
        return sorted(self._gathered)

    def view(self, i: int) -> torch.Tensor:
        """The gathered parameter ``i`` (full shape); KeyError if it is not gathered."""
        return self._gathered[i].view

    def buffer(self, i: int) -> torch.Tensor:
        """The buffer parameter ``i``'s view lives in: the pooled padded buffer (W·P elements for a single
        padded gather), or the shard itself when the group is not parallel."""
        g = self._gathered[i]
        return g.holding.buffer if g.holding is not None else self.shards[i].tensor

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(i, offset)`` when ``t`` is a view into gathered parameter ``i`` (``offset`` elements after the
        parameter's first element), else None. Used to save references to gathered parameters by identity
        rather than by storage (see :class:`impl.zero.stage3.Stage3`)."""
        if t.numel() == 0 or t.layout != torch.strided:
            return None
        ptr = t.untyped_storage().data_ptr()
        off = int(t.storage_offset())
        for i, g in self._gathered.items():
            n = g.view.numel()
            if n and g.view.untyped_storage().data_ptr() == ptr and g.start <= off < g.start + n:
                return i, int(off) - g.start
        return None

    # -- gathers --------------------------------------------------------------------------------------
    def gather(self, i: int) -> torch.Tensor:
        """Parameter ``i`` in full (a view); D3 for padded layouts, D5 for uneven ones."""
        if i in self._gathered:
            return self._gathered[i].view
        s = self.shards[i]
        lay = s.layout
        with torch.no_grad():
            if self.world_size == 1:
                return self._adopt_shard(i)
            dtype, device = s.tensor.dtype, s.tensor.device
            if lay.shard_size == 0:  # an empty parameter on every rank: nothing to exchange
                holding = _Holding(self.pool.acquire(0, dtype, device))
                return self._record(i, holding, holding.buffer.view(lay.shape))
            if lay.padded:
                buf = self.pool.acquire(lay.padded_numel, dtype, device)
                self.comm.all_gather_into(buf, s.tensor, self.group)  # uniform count P, the shard as send buffer
                self.launches += 1
                self.last_row = lay.shard_size
                return self._record(i, _Holding(buf), buf[: lay.numel].view(lay.shape))
            out = self._allgather_v([i], dtype, device)
            return self._record(i, _Holding(out), out.view(lay.shape))

    def gather_many(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Parameters ``indices`` in full, those not yet gathered in one grouped launch (D6).

        One all-gather of W·ΣP_t elements and one compaction for all of them; each parameter is a view
        of one pooled buffer of ΣN_t elements. Shards must share a dtype and device.
        """
        todo = [i for i in dict.fromkeys(indices) if i not in self._gathered]
        if len(todo) == 1:
            self.gather(todo[0])
        elif todo:
            with torch.no_grad():
                if self.world_size == 1:
                    for i in todo:
                        self._adopt_shard(i)
                else:
                    first = self.shards[todo[0]].tensor
                    for i in todo:
                        t = self.shards[i].tensor
                        if (t.dtype, t.device) != (first.dtype, first.device):
                            raise ValueError(
                                f"gather_many: parameter {self.shards[i].name!r} is {t.dtype} on {t.device}, "
                                f"{self.shards[todo[0]].name!r} is {first.dtype} on {first.device}; "
                                "one grouped gather needs one dtype and device"
                            )
                    out = self._allgather_v(todo, first.dtype, first.device)
                    holding = _Holding(out)
                    at = 0
                    for i in todo:
                        lay = self.shards[i].layout
                        self._record(i, holding, out[at : at + lay.numel].view(lay.shape))
                        at += lay.numel
        return [self._gathered[i].view for i in indices]

    def _allgather_v(self, todo: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Pack, one padded all-gather, one compaction (the impl.ops allgather-v) into a pooled buffer."""
        layouts = [self.shards[i].layout for i in todo]
        sizes = [lay.shard_size for lay in layouts]  # P_t = max(counts_t): the single-gather formula
        row = sum(sizes)
        total = sum(lay.numel for lay in layouts)
        out = self.pool.acquire(total, dtype, device)
        if row == 0:
            return out
        send = self.pool.acquire(row, dtype, device)
        padded = self.pool.acquire(self.world_size * row, dtype, device)
        try:
            at = 0
            for i, p in zip(todo, sizes, strict=True):
                real = self.shards[i].real
                send[at : at + real.numel()].copy_(real)
                send[at + real.numel() : at + p].zero_()  # padding: never read back, but deterministic
                at += p
            self.comm.all_gather_into(padded, send, self.group)
            self.launches += 1
            self.last_row = row
            compact_grouped(padded, [lay.counts for lay in layouts], sizes, out=out, impl=self.impl)
            self.compactions += 1
        finally:
            self.pool.release(send)
            self.pool.release(padded)
        return out

    def _adopt_shard(self, i: int) -> torch.Tensor:
        s = self.shards[i]
        view = s.tensor[: s.layout.numel].view(s.layout.shape)
        return self._record(i, None, view)

    def _record(self, i: int, holding: _Holding | None, view: torch.Tensor) -> torch.Tensor:
        if holding is not None:
            holding.members.add(i)
        self._gathered[i] = _Gathered(view=view, holding=holding, start=int(view.storage_offset()))
        return view

    # -- release --------------------------------------------------------------------------------------
    def release(self, i: int) -> None:
        """Forget gathered parameter ``i``; its buffer goes back to the pool once no parameter uses it."""
        g = self._gathered.pop(i, None)
        if g is None or g.holding is None:
            return
        g.holding.members.discard(i)
        if not g.holding.members:
            self.pool.release(g.holding.buffer)

    def release_all(self) -> None:
        for i in list(self._gathered):
            self.release(i)
