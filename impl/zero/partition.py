"""Stage-3 parameter partitioning: shard layouts, partitioning and the registration check (contract D1, D2, D5).

A parameter of N elements over W data-parallel ranks has a :class:`ParamLayout`: how many real elements
each rank holds (``counts``) and the uniform count ``P`` one gather sends per rank (``shard_size``).

``padded_layout`` (ZeRO-3's layout, D1)
    P = ceil(N / W); rank r holds elements [r·P, r·P + counts[r]) of the flattened parameter, and stores
    P elements: the tail of the last shards is zero padding. At W = 1, P = N: no padding.
``uneven_layout`` (D5)
    rank r holds exactly ``counts[r]`` elements (zero allowed), fixed here, at registration; P is
    ``max(counts)`` and a gather is an allgather-v (one padded allgather, one compaction).

Per rank, N = 5, W = 3 (P = 2), flattened parameter [a, b, c, d, e]::

    rank 0: shard [a, b]     rank 1: shard [c, d]     rank 2: shard [e, 0]   (one zero of padding)

:func:`check_registration` verifies, in one collective for all parameters, that every rank's real shard
size is what the layout says (P for a padded layout). A mismatch raises :class:`RegistrationError` on
every rank, naming the parameter, the rank and both sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from impl.comm.collectives import Comm
from impl.comm.pg_utils import effective_rank, effective_size

__all__ = [
    "ParamLayout",
    "ParamShard",
    "RegistrationError",
    "balanced_counts",
    "check_registration",
    "padded_layout",
    "padded_shard_size",
    "partition",
    "partition_parameters",
    "uneven_layout",
]


class RegistrationError(ValueError):
    """Partitioned parameters whose shards do not match their layout on some rank (contract D2).

    Raised by :func:`check_registration` on every rank of the group; the message names the parameter,
    the rank and both sizes (the real local shard size and the size the layout requires).
    """


def padded_shard_size(numel: int, world_size: int) -> int:
    """P = ceil(N / W): what every rank stores and sends for a parameter of ``numel`` elements (D1)."""
    if numel < 0:
        raise ValueError(f"numel={numel!r} must be >= 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    return math.ceil(numel / world_size)


def balanced_counts(numel: int, world_size: int) -> tuple[int, ...]:
    """An uneven split with no padding: N // W elements per rank, one more on the first N % W ranks."""
    base, extra = divmod(numel, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How one parameter is split over the ranks of a data-parallel group."""

    shape: tuple[int, ...]
    counts: tuple[int, ...]
    """Real elements rank r holds; their sum is the parameter's element count."""
    shard_size: int
    """P: the uniform count of one padded gather (``max(counts)``)."""
    padded: bool
    """True: every rank stores P elements, real ones first then zeros. False: exactly ``counts[r]``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def padded_numel(self) -> int:
        """W·P: the elements of the buffer a padded gather fills."""
        return self.world_size * self.shard_size

    def offset(self, rank: int) -> int:
        """Where rank ``rank``'s real elements start in the flattened parameter."""
        return sum(self.counts[:rank])

    def stored(self, rank: int) -> int:
        """The shard size rank ``rank`` must hold: P (padded) or ``counts[rank]`` (uneven)."""
        return self.shard_size if self.padded else self.counts[rank]


def padded_layout(shape: Sequence[int], world_size: int) -> ParamLayout:
    """D1: P = ceil(N / W) per rank, zero padding at the tail, none at W = 1."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    p = padded_shard_size(numel, world_size)
    counts = tuple(max(0, min(p, numel - r * p)) for r in range(world_size))
    return ParamLayout(shape=shape, counts=counts, shard_size=p, padded=True)


def uneven_layout(shape: Sequence[int], counts: Sequence[int]) -> ParamLayout:
    """D5: exactly ``counts[r]`` elements on rank r (zeros allowed), fixed at registration."""
    shape = tuple(int(s) for s in shape)
    checked = tuple(int(c) for c in counts)
    if not checked:
        raise ValueError("counts=() must have one entry per rank (at least one)")
    if any(c < 0 for c in checked):
        raise ValueError(f"counts={list(checked)} must all be >= 0")
    if sum(checked) != math.prod(shape):
        raise ValueError(
            f"counts={list(checked)} sum to {sum(checked)} but shape={shape} has {math.prod(shape)} elements"
        )
    return ParamLayout(shape=shape, counts=checked, shard_size=max(checked), padded=False)


@dataclass(kw_only=True, eq=False)
class ParamShard:
    """One parameter's shard on this rank: its layout and the tensor this rank stores."""

    name: str
    layout: ParamLayout
    rank: int
    tensor: torch.Tensor
    """1-D; ``layout.stored(rank)`` elements when registered correctly."""

    @property
    def count(self) -> int:
        """Real elements this rank holds."""
        return self.layout.counts[self.rank]

    @property
    def real(self) -> torch.Tensor:
        """This rank's real elements (no padding), a view of :attr:`tensor`."""
        return self.tensor[: self.count]


def partition(
    name: str, full: torch.Tensor, layout: ParamLayout, rank: int, *, out: torch.Tensor | None = None
) -> ParamShard:
    """Rank ``rank``'s shard of ``full``: its real elements, then zeros up to P for a padded layout.

    ``out`` (1-D, ``layout.stored(rank)`` elements) receives the shard; a new tensor otherwise.
    """
    if tuple(full.shape) != layout.shape:
        raise ValueError(f"parameter {name!r}: shape {tuple(full.shape)} does not match its layout {layout.shape}")
    n = layout.stored(rank)
    if out is None:
        out = torch.empty(n, dtype=full.dtype, device=full.device)
    elif out.numel() != n or out.dim() != 1:
        raise ValueError(f"parameter {name!r}: out has shape {tuple(out.shape)}, the shard needs ({n},)")
    c, lo = layout.counts[rank], layout.offset(rank)
    with torch.no_grad():
        out[:c].copy_(full.detach().reshape(-1)[lo : lo + c])
        out[c:].zero_()
    return ParamShard(name=name, layout=layout, rank=rank, tensor=out)


def partition_parameters(
    named: Sequence[tuple[str, torch.Tensor]],
    world_size: int,
    rank: int,
    *,
    layouts: Sequence[ParamLayout] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, list[ParamShard]]:
    """Partition several parameters into one flat tensor; returns it and the shards (contiguous views of it).

    ``layouts`` defaults to :func:`padded_layout` of each parameter; ``dtype`` to each tensor's own (all
    must then agree).
    """
    if layouts is None:
        layouts = [padded_layout(t.shape, world_size) for _, t in named]
    if len(layouts) != len(named):
        raise ValueError(f"layouts has {len(layouts)} entries for {len(named)} parameters")
    dtypes = {t.dtype for _, t in named}
    if dtype is None and len(dtypes) > 1:
        raise ValueError(f"parameters have dtypes {sorted(map(str, dtypes))}; pass dtype= for one flat shard tensor")
    dtype = dtype or (next(iter(dtypes)) if dtypes else torch.float32)
    device = named[0][1].device if named else torch.device("cpu")
    sizes = [lay.stored(rank) for lay in layouts]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    shards, at = [], 0
    for (name, t), lay, n in zip(named, layouts, sizes, strict=True):
        shards.append(partition(name, t.to(dtype), lay, rank, out=flat[at : at + n]))
        at += n
    return flat, shards


def _local_sizes(shards: Sequence[ParamShard]) -> list[int]:
    """What this rank really holds: the element count of each shard tensor (never the layout's P)."""
    return [int(s.tensor.numel()) for s in shards]


def check_registration(shards: Sequence[ParamShard], group: Any, *, comm: Comm | None = None) -> None:
    """D2: every rank's real shard size equals what its layout requires (P for padded layouts).

    One collective for all parameters: each rank contributes a row of ``[real shard sizes..., numels...]``
    (int64, two entries per parameter) to one all-gather over ``group``; every rank then checks the
    whole table, so a mismatch raises the same :class:`RegistrationError` on every rank (a rank that
    raised alone would leave the others waiting in their next collective). When the group is not
    parallel the local sizes are checked without a collective.

    Per rank, W = 2, one parameter ``w`` of 5 elements (P = 3), rank 1's shard corrupted to 2 elements::

        rank 0: check_registration([w: 3 elements], g) -> RegistrationError("... 'w' ... rank 1 ... 2 ... P = 3")
        rank 1: check_registration([w: 2 elements], g) -> the same RegistrationError
    """
    comm = comm or Comm(None)
    world = effective_size(group)
    me = effective_rank(group)
    t = len(shards)
    local = torch.tensor([*_local_sizes(shards), *(s.layout.numel for s in shards)], dtype=torch.int64)
    if world > 1 and t > 0:
        table = torch.empty(world * 2 * t, dtype=torch.int64)
        comm.all_gather_into(table, local, group)
        rows = table.view(world, 2 * t).tolist()
    else:
        rows = [local.tolist()]
    problems: list[str] = []
    for r, row in enumerate(rows):
        for i, s in enumerate(shards):
            size, numel = row[i], row[t + i]
            if numel != s.layout.numel:
                problems.append(
                    f"parameter {s.name!r}: rank {r} registered {numel} elements, rank {me} registered "
                    f"{s.layout.numel}; every rank must register the same parameter"
                )
                continue
            want = s.layout.stored(r)
            if size != want:
                what = (
                    f"P = ceil({s.layout.numel} / {len(s.layout.counts)}) = {want}"
                    if s.layout.padded
                    else (f"counts[{r}] = {want} (fixed at registration)")
                )
                problems.append(
                    f"parameter {s.name!r}: rank {r} holds a local shard of {size} elements, expected {what}"
                )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise RegistrationError("stage-3 registration check failed: " + "; ".join(problems[:3]) + more)
