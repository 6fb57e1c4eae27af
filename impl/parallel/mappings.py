"""Autograd functions that move activations in and out of a tensor-parallel region (guarded, A5)."""

from __future__ import annotations

from typing import Any

import torch

from impl.comm.collectives import all_reduce


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the input gradient over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce the partial outputs over the group. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]
