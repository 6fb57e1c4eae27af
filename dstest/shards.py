"""Shard layouts: how N elements are split across W ranks.

``padded(n, w)``: every rank holds P = ceil(N / W) elements, the tail of the last shards is zero padding
(ZeRO-3's layout, contract D1). ``uneven(counts)``: rank r holds exactly ``counts[r]`` elements, zero allowed
(an allgather-v, contract D5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dstest.errors import InvalidArgument

__all__ = ["ShardLayout", "padded", "uneven"]


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """Per-rank element counts of a flat tensor of ``numel`` elements split over ``len(counts)`` ranks."""

    numel: int
    counts: tuple[int, ...]
    shard_size: int  # P: what each rank's padded slot holds

    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for c in self.counts:
            out.append(acc)
            acc += c
        return tuple(out)

    @property
    def padded_numel(self) -> int:
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s real elements of ``flat`` (a view; no padding)."""
        self._check(flat)
        start = self.offsets[rank]
        return flat.reshape(-1)[start : start + self.counts[rank]]

    def padded_shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slot of P elements: its real elements followed by zeros."""
        out = flat.new_zeros(self.shard_size)
        real = self.shard(flat, rank)
        out[: real.numel()] = real
        return out

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The exact concatenation from a gathered buffer of W*P elements (the reference compaction)."""
        if gathered.numel() != self.padded_numel:
            raise InvalidArgument(
                f"gathered buffer has {gathered.numel()} elements, layout expects W*P = {self.padded_numel}"
            )
        slots = gathered.reshape(self.world_size, self.shard_size) if self.shard_size else gathered.reshape(self.world_size, 0)
        return torch.cat([slots[r, : c] for r, c in enumerate(self.counts)])

    def _check(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise InvalidArgument(f"tensor has {flat.numel()} elements, layout is for numel={self.numel}")


def padded(numel: int, world_size: int) -> ShardLayout:
    """P = ceil(N / W) per rank; rank r's real count is clamp(N - r*P, 0, P); no padding at W = 1."""
    if numel < 0:
        raise InvalidArgument(f"numel={numel!r} must be >= 0")
    if world_size < 1:
        raise InvalidArgument(f"world_size={world_size!r} must be >= 1")
    p = -(-numel // world_size)
    counts = tuple(max(0, min(p, numel - r * p)) for r in range(world_size))
    return ShardLayout(numel=numel, counts=counts, shard_size=p)


def uneven(counts: Sequence[int]) -> ShardLayout:
    """Exactly ``counts[r]`` elements on rank r (zeros allowed); the padded slot is max(counts)."""
    counts = tuple(int(c) for c in counts)
    if not counts:
        raise InvalidArgument("counts=() must name at least one rank")
    if any(c < 0 for c in counts):
        raise InvalidArgument(f"counts={list(counts)} must all be >= 0")
    return ShardLayout(numel=sum(counts), counts=counts, shard_size=max(counts))
