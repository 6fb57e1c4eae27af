"""Builders for the group topologies that break distributed code: absent, single-rank, non-member, subgroups.

Every builder call is collective, like ``torch.distributed.new_group``: all ranks of the world make the
same calls in the same order. A rank outside a group gets ``dist.GroupMember.NON_GROUP_MEMBER`` (torch
reports its size as -1); an absent group is ``None`` ("this parallel dimension does not exist").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dstest.errors import InvalidArgument

__all__ = ["TOPOLOGIES", "GroupBuilder", "topologies_for"]

#: The four cases every optional-group call site must handle (contract A1-A4).
TOPOLOGIES = ("absent", "single", "non_member", "multi")


def topologies_for(world_size: int) -> tuple[str, ...]:
    """The topologies a world of ``world_size`` ranks can build ("non_member" and "multi" need 2 ranks)."""
    if world_size < 1:
        raise InvalidArgument(f"world_size={world_size!r} must be >= 1")
    return TOPOLOGIES if world_size >= 2 else ("absent", "single")


class GroupBuilder:
    """Builds groups for one rank; see the module docstring for the calling rule."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._singles: list[Any] | None = None

    def _new(self, ranks: Sequence[int]) -> Any:
        import torch.distributed as dist

        ranks = sorted(set(int(r) for r in ranks))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise InvalidArgument(f"ranks {bad} are not in a world of {self.world_size} ranks (0..{self.world_size - 1})")
        if not ranks:
            raise InvalidArgument("a group needs at least one rank; use absent() for no group")
        return dist.new_group(ranks)

    def absent(self) -> None:
        """No group: the parallel dimension does not exist (contract A1)."""
        return None

    def world(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD

    def of(self, ranks: Sequence[int]) -> Any:
        """A group of ``ranks``; ranks outside it get NON_GROUP_MEMBER."""
        return self._new(ranks)

    def excluding(self, *ranks: int) -> Any:
        """A group of every rank except ``ranks``; the excluded ranks are non-members (contract A4)."""
        keep = [r for r in range(self.world_size) if r not in set(ranks)]
        if not keep:
            raise InvalidArgument(
                f"excluding({', '.join(map(str, ranks))}) leaves no rank in a world of {self.world_size}"
            )
        return self._new(keep)

    def single(self) -> Any:
        """A one-rank group holding only the caller (contract A3). Creates one such group per rank, once."""
        if self._singles is None:
            self._singles = [self._new([r]) for r in range(self.world_size)]
        return self._singles[self.rank]

    def subgroups(self, size: int) -> Any:
        """Split the world into consecutive blocks of ``size`` ranks (the last may be smaller); returns the caller's."""
        if size < 1:
            raise InvalidArgument(f"subgroups(size={size!r}): size must be >= 1")
        mine = None
        for start in range(0, self.world_size, size):
            block = list(range(start, min(start + size, self.world_size)))
            group = self._new(block)
            if self.rank in block:
                mine = group
        return mine

    def build(self, kind: str) -> Any:
        """One of TOPOLOGIES: 'absent' -> None, 'single' -> own 1-rank group,
        'non_member' -> a group of all ranks but rank 0 (rank 0 is outside), 'multi' -> the world group."""
        if kind not in TOPOLOGIES:
            raise InvalidArgument(f"topology kind={kind!r}; allowed: {list(TOPOLOGIES)}")
        if kind not in topologies_for(self.world_size):
            raise InvalidArgument(f"topology {kind!r} needs world_size >= 2, got {self.world_size}")
        if kind == "absent":
            return self.absent()
        if kind == "single":
            return self.single()
        if kind == "non_member":
            return self.excluding(0)
        return self.world()

    def is_member(self, kind: str) -> bool:
        """Whether this rank belongs to the group ``build(kind)`` returns (False for 'absent')."""
        return kind in ("single", "multi") or (kind == "non_member" and self.rank != 0)
