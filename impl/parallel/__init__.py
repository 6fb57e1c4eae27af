"""Call sites that take an optional model-parallel group (contract A6).

Each works on an absent (``None``), single-rank, non-member and multi-rank group; a rank for which the
group is not parallel holds the whole tensor and computes alone (size 1, rank 0: never torch's -1).
"""

from __future__ import annotations

from impl.parallel.cross_entropy import vocab_parallel_cross_entropy
from impl.parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_range, shard_sizes
from impl.parallel.norm import global_norm, grad_norm

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "global_norm",
    "grad_norm",
    "shard_range",
    "shard_sizes",
    "vocab_parallel_cross_entropy",
]
