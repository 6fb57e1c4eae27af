"""Cross-entropy over logits whose vocabulary is sharded across a model-parallel group.

Each rank holds the logits of vocabulary entries [vocab_start, vocab_start + V_local); shards may be
uneven, even empty. The result equals ``torch.nn.functional.cross_entropy`` on the full logits (with its
``reduction`` and ``ignore_index``), and so does the gradient of each shard. Two all-reduces forward (max;
target logit and sum of exponentials together), none backward. Not parallel (absent, single-rank,
non-member group): the caller holds the whole vocabulary and nothing is issued.
"""

from __future__ import annotations

from typing import Any

import torch

from impl.comm.collectives import all_reduce

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int, ignore_index: int
    ) -> torch.Tensor:
        # At least fp32 for the softmax; fp64 logits stay fp64 (a downcast would lose their precision).
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local_v = x.shape[-1]
        if local_v:
            gmax = x.max(dim=-1).values
        else:
            gmax = torch.full(x.shape[:-1], -torch.inf, dtype=x.dtype, device=x.device)
        all_reduce(gmax, group, "max")
        shifted = x - gmax.unsqueeze(-1)
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < local_v) & (target != ignore_index)
        idx = local_t.clamp(0, max(local_v - 1, 0))
        exp = shifted.exp()
        both = torch.zeros((2, *x.shape[:-1]), dtype=x.dtype, device=x.device)
        if local_v:
            both[0] = torch.where(mine, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
            both[1] = exp.sum(dim=-1)
        all_reduce(both, group)
        target_logit, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target_logit
        valid = target != ignore_index
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), mine, idx, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, mine, idx, valid = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[-1]:
            hit = torch.zeros_like(grad).scatter_(-1, idx.unsqueeze(-1), mine.unsqueeze(-1).to(grad.dtype))
            grad -= hit
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Any,
    vocab_start: int = 0,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` [..., V_local] (entries vocab_start.. of the vocabulary) against ``target``
    [...] (global vocabulary ids), reduced over ``group``. ``reduction``: "mean" (over non-ignored
    targets, as F.cross_entropy), "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; allowed: ['mean', 'sum', 'none']")
    if vocab_start < 0:
        raise ValueError(f"vocab_start={vocab_start!r} must be >= 0")
    loss = _VocabParallelCE.apply(logits, target, group, vocab_start, ignore_index)  # type: ignore[no-untyped-call]
    if reduction == "none":
        return loss.to(logits.dtype)  # type: ignore[no-any-return]
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype)  # type: ignore[no-any-return]
    return (total / (target != ignore_index).sum()).to(logits.dtype)  # type: ignore[no-any-return]
