"""The global norm of tensors sharded over an optional model-parallel group.

Per rank, group {0, 1}, p = 2::

    rank 0: tensors [a]     rank 1: tensors [b]     ->  both: sqrt(|a|² + |b|²)
    group None:   rank 0: |a|      rank 1: |b|       (nothing issued)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from impl.comm.collectives import CommStats, all_reduce
from impl.comm.pg_utils import effective_rank

__all__ = ["global_norm", "grad_norm"]


def global_norm(
    tensors: Iterable[torch.Tensor], mp_group: Any = None, norm_type: float = 2.0, *, stats: CommStats | None = None
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors`` of all ranks of ``mp_group`` (fp32 scalar tensor).

    Each rank passes the tensors it holds that count (shards, and replicated tensors on one rank only);
    one all-reduce over the group when it is parallel.
    """
    tensors = [t.detach() for t in tensors]
    device = tensors[0].device if tensors else torch.device("cpu")
    if norm_type == math.inf:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for t in tensors:
            if t.numel():
                local = torch.maximum(local, t.float().abs().max())
        return all_reduce(local, mp_group, "max", stats=stats)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r}; allowed: a positive number or math.inf")
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        acc += t.float().abs().pow(norm_type).sum()
    all_reduce(acc, mp_group, stats=stats)
    return acc.pow(1.0 / norm_type)


def grad_norm(parameters: Iterable[torch.nn.Parameter], mp_group: Any = None, norm_type: float = 2.0) -> torch.Tensor:
    """The global norm of the ``.grad`` of ``parameters`` over ``mp_group``: parameters marked
    ``tensor_model_parallel`` count on every rank, replicated ones only on model-parallel rank 0."""
    rank = effective_rank(mp_group)
    grads = [
        p.grad for p in parameters if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or rank == 0)
    ]
    return global_norm(grads, mp_group, norm_type)
