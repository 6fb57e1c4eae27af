"""Guarded, counted collectives: the only place impl calls ``torch.distributed`` collectives.

Every other module of impl communicates through the functions below or a :class:`Comm` (the stages, the
partition check, the gatherer, and the uneven-shard allgather of :mod:`impl.ops.allgather`), so a
:class:`CommStats` sees every collective impl issues; ``tests/test_impl_comm.py`` checks that no other
module calls one.

Every function here:

* is guarded by :func:`~impl.comm.pg_utils.is_parallel` (A5): on an absent (``None``), single-rank or
  non-member group it issues nothing and leaves the tensor unchanged (or, for the reshaping collectives,
  copies the caller's own data, which is the result a one-rank group would produce);
* writes its result back into the caller's tensor when that tensor is not contiguous (A7): a contiguous
  staging copy goes over the wire and is copied back, so no collective result is ever discarded;
* counts what it issues in a :class:`CommStats` when one is passed (C6, A8 are counted, not assumed);
* works on torch 2.11-2.14: torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
  ``all_gather_single``/``reduce_scatter_single`` (the old names warn with a FutureWarning), so the new
  name is used when present.

Per rank, for a group of ranks {0, 1} and ``t`` = [1., 2.] on rank 0, [3., 4.] on rank 1::

    all_reduce(t, group)            rank 0: [4., 6.]     rank 1: [4., 6.]
    all_reduce(t, None)             rank 0: [1., 2.]     rank 1: [3., 4.]   (nothing issued)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from impl.comm.pg_utils import is_parallel

__all__ = [
    "Comm",
    "CommStats",
    "all_gather",
    "all_gather_into",
    "all_reduce",
    "barrier",
    "broadcast",
    "reduce_scatter",
]

_REDUCE_OPS = ("sum", "max", "min")


class CommStats:
    """Counts of collectives issued, by op name.

    ``total`` counts everything since creation; ``current`` counts since the last :meth:`begin_window`;
    ``last_window`` holds what ``current`` was at the last :meth:`end_window` (the engine opens a window at
    the first backward of a training step and closes it at the end of the optimizer step).
    """

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.current: Counter[str] = Counter()
        self.last_window: Counter[str] = Counter()

    def record(self, op: str) -> None:
        self.total[op] += 1
        self.current[op] += 1

    def begin_window(self) -> None:
        self.current = Counter()

    def end_window(self) -> None:
        self.last_window = Counter(self.current)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _reduce_op(op: str) -> Any:
    dist = _dist()
    if op not in _REDUCE_OPS:
        raise ValueError(f"op={op!r} is not a supported reduce op; allowed: {list(_REDUCE_OPS)}")
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


def _record(stats: CommStats | None, op: str) -> None:
    if stats is not None:
        stats.record(op)


def _with_contiguous(tensor: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run ``fn`` on ``tensor`` or on a contiguous copy that is written back (A7)."""
    if tensor.is_contiguous():
        fn(tensor)
        return tensor
    staging = tensor.contiguous()
    fn(staging)
    tensor.copy_(staging)
    return tensor


def _one_rank_result(output: torch.Tensor, input: torch.Tensor, op: str) -> torch.Tensor:
    """What a reshaping collective ``op`` gives on a one-rank group: ``output`` receives ``input``.

    The sizes must then be equal; a mismatch is a ValueError naming both, raised with nothing issued.
    """
    if output.numel() != input.numel():
        raise ValueError(
            f"{op} on a group that is not parallel: output has {output.numel()} elements, "
            f"input {input.numel()}; a one-rank {op} needs them equal"
        )
    output.copy_(input.reshape(output.shape))
    return output


def _renamed(new: str, old: str) -> Callable[..., Any]:
    """``torch.distributed.<new>`` (torch >= 2.13), else ``<old>`` (torch 2.11, 2.12)."""
    dist = _dist()
    fn = getattr(dist, new, None)
    return fn if fn is not None else getattr(dist, old)  # type: ignore[no-any-return]


def _reduce_scatter_fn() -> Callable[..., Any]:
    return _renamed("reduce_scatter_single", "reduce_scatter_tensor")


def _all_gather_fn() -> Callable[..., Any]:
    return _renamed("all_gather_single", "all_gather_into_tensor")


def all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum", *, stats: CommStats | None = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group``; returns ``tensor``.

    Not parallel (absent, single-rank, non-member): returns ``tensor`` unchanged, issues nothing.
    """
    if not is_parallel(group):
        return tensor
    red = _reduce_op(op)
    _record(stats, "all_reduce")
    return _with_contiguous(tensor, lambda t: _dist().all_reduce(t, op=red, group=group))


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: Any, op: str = "sum", *, stats: CommStats | None = None
) -> torch.Tensor:
    """Reduce ``input`` (W * m elements) over ``group``; group rank r receives elements [r*m, (r+1)*m).

    Not parallel: ``output`` receives ``input`` (the one-rank result); sizes must then be equal.
    """
    if not is_parallel(group):
        return _one_rank_result(output, input, "reduce_scatter")
    red = _reduce_op(op)
    _record(stats, "reduce_scatter")
    src = input if input.is_contiguous() else input.contiguous()
    return _with_contiguous(output, lambda out: _reduce_scatter_fn()(out, src, op=red, group=group))


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: Any, *, stats: CommStats | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``input`` (m elements each, in group-rank order) into ``output`` (W * m).

    Not parallel: ``output`` receives ``input``; sizes must then be equal.
    """
    if not is_parallel(group):
        return _one_rank_result(output, input, "all_gather")
    _record(stats, "all_gather")
    src = input if input.is_contiguous() else input.contiguous()
    return _with_contiguous(output, lambda out: _all_gather_fn()(out, src, group=group))


def all_gather(tensor: torch.Tensor, group: Any, *, stats: CommStats | None = None) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` (same shape on every rank), in group-rank order; ``[tensor]`` if not parallel."""
    if not is_parallel(group):
        return [tensor]
    dist = _dist()
    _record(stats, "all_gather")
    out = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def broadcast(tensor: torch.Tensor, src: int, group: Any, *, stats: CommStats | None = None) -> torch.Tensor:
    """Copy group rank ``src``'s ``tensor`` into every rank's ``tensor``; unchanged if not parallel."""
    if not is_parallel(group):
        return tensor
    dist = _dist()
    _record(stats, "broadcast")
    global_src = dist.get_global_rank(group, src)
    return _with_contiguous(tensor, lambda t: dist.broadcast(t, src=global_src, group=group))


def barrier(group: Any, *, stats: CommStats | None = None) -> None:
    """Wait for every rank of ``group``; nothing if not parallel."""
    if not is_parallel(group):
        return
    _record(stats, "barrier")
    _dist().barrier(group=group)


class Comm:
    """The collectives above bound to one :class:`CommStats` (``stats=None``: uncounted)."""

    def __init__(self, stats: CommStats | None = None) -> None:
        self.stats = stats

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        return all_reduce(tensor, group, op, stats=self.stats)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        return reduce_scatter(output, input, group, op, stats=self.stats)

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> torch.Tensor:
        return all_gather_into(output, input, group, stats=self.stats)

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        return all_gather(tensor, group, stats=self.stats)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        return broadcast(tensor, src, group, stats=self.stats)

    def barrier(self, group: Any) -> None:
        barrier(group, stats=self.stats)
