"""Fake (meta) implementations of the native ops, so they work under FakeTensor and torch.compile (contract D5).

:func:`register_fakes` is called once, by :func:`impl.ops._build.load_extension`, right after the library
that defines the ops is loaded: a fake can only be registered for an op that exists. Each fake returns an
empty tensor of the result's size (``sum(counts)`` elements, the dtype and device of ``padded``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["register_fakes"]


def _compact_fake(padded: Tensor, counts: Sequence[int]) -> Tensor:
    return padded.new_empty((sum(counts),))


def _compact_grouped_fake(padded: Tensor, counts: Sequence[int], shard_sizes: Sequence[int]) -> Tensor:
    return padded.new_empty((sum(counts),))


def _compact_grouped_out_fake(padded: Tensor, counts: Sequence[int], shard_sizes: Sequence[int], out: Tensor) -> None:
    return None


def register_fakes() -> None:
    """Register the fakes of ``dstest_impl::compact``, ``compact_grouped`` and ``compact_grouped_out``."""
    torch.library.register_fake("dstest_impl::compact", _compact_fake)
    torch.library.register_fake("dstest_impl::compact_grouped", _compact_grouped_fake)
    torch.library.register_fake("dstest_impl::compact_grouped_out", _compact_grouped_out_fake)
