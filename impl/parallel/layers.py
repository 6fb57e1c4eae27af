"""The tensor-parallel linear pair: a column-parallel layer feeding a row-parallel one (Megatron's MLP).

With a parallel group of size T, :class:`ColumnParallelLinear` holds rows [lo, hi) of the full weight
(output features, uneven when T does not divide them) and :class:`RowParallelLinear` the matching columns
of the next weight; the pair needs one all-reduce forward (after the row layer) and one backward (into
the column layer's input). For a rank that is not in a parallel group (absent, single-rank, non-member)
both hold the full weights and issue nothing.

Per rank, T = 2, hidden = 5 (shards of 3 and 2)::

    rank 0: h0 = act(x @ W1[0:3].T + b1[0:3]);  y = all_reduce(h0 @ W2[:, 0:3].T) + b2
    rank 1: h1 = act(x @ W1[3:5].T + b1[3:5]);  y = all_reduce(h1 @ W2[:, 3:5].T) + b2
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from impl.comm.pg_utils import effective_rank, effective_size
from impl.parallel.mappings import copy_to_region, reduce_from_region

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_range", "shard_sizes"]


def shard_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` contiguous shards, the first ``total % parts`` one larger."""
    if parts < 1:
        raise ValueError(f"parts={parts!r} must be >= 1")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(total: int, group: Any) -> tuple[int, int]:
    """[lo, hi) of the caller's shard of ``total`` along ``group`` (the whole range if not parallel)."""
    sizes = shard_sizes(total, effective_size(group))
    rank = effective_rank(group)
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def _mark(p: torch.nn.Parameter, sharded: bool) -> torch.nn.Parameter:
    p.tensor_model_parallel = sharded  # type: ignore[attr-defined]
    return p


class _ShardedLinear(torch.nn.Module):
    """A linear layer holding the caller's slice [lo, hi) of the full weight along ``dim`` (0: output rows,
    1: input columns); the bias is sliced with the rows, or kept whole (replicated) for a column split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, dim: int) -> None:
        """``weight``/``bias`` are the full tensors (same on every rank); the caller's slice is kept."""
        super().__init__()
        self.group = group
        self.lo, self.hi = shard_range(weight.shape[dim], group)
        self.out_features, self.in_features = weight.shape
        self.weight = _mark(torch.nn.Parameter(weight.detach().narrow(dim, self.lo, self.hi - self.lo).clone()), True)
        if bias is None:
            self.bias = None
        elif dim == 0:
            self.bias = _mark(torch.nn.Parameter(bias.detach()[self.lo : self.hi].clone()), True)
        else:
            self.bias = _mark(torch.nn.Parameter(bias.detach().clone()), False)


class ColumnParallelLinear(_ShardedLinear):
    """y_shard = x @ W[lo:hi].T + b[lo:hi]; the output stays sharded (feed a RowParallelLinear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        """``weight``/``bias`` are the full tensors (same on every rank); the caller's rows are kept."""
        super().__init__(weight, bias, group, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """y = all_reduce(x_shard @ W[:, lo:hi].T) + b; the bias is replicated (counted once in the norm)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        """``weight``/``bias`` are the full tensors (same on every rank); the caller's columns are kept."""
        super().__init__(weight, bias, group, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_region(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y
