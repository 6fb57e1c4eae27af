"""What the bundled specs need from a system under test.

A target is a small adapter object (see ``dstest/targets/impl.py``). Its :meth:`Target.initialize` returns
a :class:`TrainingEngine`: DeepSpeed 0.19.8's engine surface (``deepspeed.initialize(model=, optimizer=,
config=)`` returns ``(engine, optimizer, dataloader, lr_scheduler)``; ``engine(x)``, ``engine.backward``,
``engine.step``, ``engine.get_global_grad_norm``, ``engine.gradient_clipping``, ``engine.save_checkpoint``,
``engine.load_checkpoint``) plus observation accessors that an adapter may implement by wrapping the
engine (DeepSpeed: ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_grad``). A spec asks
``target.supports(feature)`` first and skips what the target lacks (:func:`require`).

A target whose ``third_party`` is True is not ours to fix: a failing spec there is reported as a
deviation from the contracts (docs/contracts.md) by the runner.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["FEATURES", "Target", "TrainingEngine", "require"]

#: Feature names a spec may ask :meth:`Target.supports` about.
FEATURES = frozenset(
    {
        # optional-group helpers (A1-A7)
        "is_parallel",  # target.is_parallel(group)
        "guarded_all_reduce",  # target.all_reduce(tensor, group, op)
        "tensor_parallel_linear",  # target.column_parallel_linear / row_parallel_linear
        "vocab_parallel_cross_entropy",  # target.vocab_parallel_cross_entropy
        "global_norm",  # target.global_norm
        "mp_group",  # initialize(..., mp_group=) honours a model-parallel group
        # engine
        "stage0", "stage1", "stage2", "stage3",
        "fp16", "bf16",
        "sparse_gradients",
        "reduce_scatter_path", "all_reduce_path", "non_contiguous_path", "overlap_comm",
        "compute_grad_norm",  # zero_optimization.compute_grad_norm (part C)
        "collective_counts",  # engine.collective_counts()
        "comm_buffer_bytes",  # engine.comm_buffer_bytes()
        "state_bytes",  # engine.state_bytes()
        "grad_multiplier",  # engine.last_grad_multiplier()
        "checkpoint",  # engine.save_checkpoint / load_checkpoint
        "config_check",  # target.check_config(config)
    }
)  # fmt: skip


@runtime_checkable
class TrainingEngine(Protocol):
    """The engine surface the specs drive. Methods marked *collective* must be called on every rank."""

    module: torch.nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate (divided by the accumulation steps); reduces gradients at the boundary."""
        ...

    def step(self) -> None:
        """Optimizer step at the accumulation boundary (skipped on overflow)."""
        ...

    def zero_grad(self) -> None: ...

    def get_global_grad_norm(self) -> float | None:
        """Norm of the last step's reduced, unscaled gradient; inf after an overflow; None when not computed."""
        ...

    def gradient_clipping(self) -> float:
        """The clipping threshold in effect."""
        ...

    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        ...

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """*Collective.* Every trainable parameter by name, full, fp32 master values."""
        ...

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """*Collective.* The reduced gradient the optimizer receives, full, fp32, unscaled, before clipping;
        valid between ``backward`` at the boundary and ``step``."""
        ...

    def collective_counts(self) -> Mapping[str, int]:
        """Collectives the last training step issued, by op name (feature "collective_counts")."""
        ...

    def comm_buffer_bytes(self) -> int:
        """Bytes of communication staging buffers held (feature "comm_buffer_bytes")."""
        ...

    def state_bytes(self) -> Mapping[str, int]:
        """Bytes this rank holds: "master_params", "optimizer_state", "gradients" (feature "state_bytes")."""
        ...

    def last_grad_multiplier(self) -> float | None:
        """What the last step multiplied gradients by; None if it did not multiply (feature "grad_multiplier")."""
        ...

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        """*Collective.*"""
        ...

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        """*Collective.*"""
        ...


@runtime_checkable
class Target(Protocol):
    """A system under test."""

    name: str
    third_party: bool
    #: Where the conformance run puts this target when no world is named ("threaded" or "process").
    default_world: str
    #: Exception types a rejected configuration raises (checked with ``pytest.raises``).
    config_errors: tuple[type[BaseException], ...]

    def supports(self, feature: str) -> bool:
        """Whether the target has ``feature`` (one of :data:`FEATURES`)."""
        ...

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Validate ``config`` without building an engine or issuing a collective; raise a config error."""
        ...

    def initialize(
        self, model: torch.nn.Module, config: Mapping[str, Any], dp_group: Any = None, mp_group: Any = None
    ) -> TrainingEngine:
        """*Collective.* An engine training ``model``; ``dp_group=None``: the world; ``mp_group=None``: none."""
        ...

    def is_parallel(self, group: Any) -> bool:
        """contract A1-A4."""
        ...

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        """A guarded in-place all-reduce (A5, A7): unchanged when the group is not parallel."""
        ...

    def column_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """The caller's shard (output rows) of a linear layer given its full weight and bias."""
        ...

    def row_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """The caller's shard (input columns) of a linear layer; output all-reduced over ``group``."""
        ...

    def vocab_parallel_cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int
    ) -> torch.Tensor:
        """Mean cross-entropy of vocabulary-sharded ``logits`` (entries from ``vocab_start``)."""
        ...

    def global_norm(self, tensors: Iterable[torch.Tensor], mp_group: Any) -> torch.Tensor:
        """2-norm of the tensors of every rank of ``mp_group`` (each rank passes what it counts)."""
        ...


def require(target: Target, *features: str) -> None:
    """``pytest.skip`` unless ``target`` supports every one of ``features``.

    A name outside :data:`FEATURES` is :class:`~dstest.errors.UnknownFeature` (a ValueError), raised
    before the target is asked: a misspelt feature must fail the spec, never skip it.
    """
    import pytest

    from dstest.errors import UnknownFeature

    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise UnknownFeature(f"unknown feature(s) {unknown}; allowed: {sorted(FEATURES)}")
    missing = [f for f in features if not target.supports(f)]
    if missing:
        pytest.skip(f"target {target.name!r} does not support {missing}")
