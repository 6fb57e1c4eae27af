"""Element-wise optimizers over flat fp32 tensors (AdamW, SGD), with the state owned by the caller.

Each update is element-wise, so updating a partition of a flat parameter gives exactly the elements the
same update of the whole tensor would: ZeRO stages call :meth:`update` on the partition they own. The
arithmetic is torch's single-tensor (``foreach=False``) AdamW and SGD, so a stage-0 run matches
``torch.optim`` bit for bit.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from impl.config import AdamWParams, OptimizerConfig, SGDParams

__all__ = ["SGD", "AdamW", "FlatOptimizer", "build_optimizer"]


class FlatOptimizer(Protocol):
    name: str
    state_names: tuple[str, ...]

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        """Update ``param`` in place from ``grad``; ``step`` counts from 1; ``state`` holds ``state_names``."""
        ...


class AdamW:
    name = "AdamW"
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def __init__(self, hp: AdamWParams) -> None:
        self.lr = hp.lr
        self.beta1, self.beta2 = hp.betas
        self.eps = hp.eps
        self.weight_decay = hp.weight_decay

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        param.mul_(1 - self.lr * self.weight_decay)
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        step_size = self.lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class SGD:
    name = "SGD"

    def __init__(self, hp: SGDParams) -> None:
        self.lr = hp.lr
        self.momentum = hp.momentum
        self.dampening = hp.dampening
        self.weight_decay = hp.weight_decay
        self.nesterov = hp.nesterov
        self.state_names: tuple[str, ...] = ("momentum_buffer",) if hp.momentum != 0 else ()

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(grad, alpha=-self.lr)


def build_optimizer(config: OptimizerConfig) -> FlatOptimizer:
    hp = config.hyperparameters()
    if isinstance(hp, AdamWParams):
        return AdamW(hp)
    return SGD(hp)
