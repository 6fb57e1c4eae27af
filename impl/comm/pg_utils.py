"""Predicates on optional process groups (contract A1-A4).

A group argument in impl is one of:

* ``None``: the parallel dimension is absent (A1). Never "the world".
* ``dist.GroupMember.NON_GROUP_MEMBER``: the caller is outside the group; torch reports its size as -1 (A4).
* a process group that contains the caller, of one rank (A3) or more (A2).

Only a group of two or more ranks that contains the caller is *parallel*; every collective on an optional
group is guarded by :func:`is_parallel` (A5). :func:`effective_size` and :func:`effective_rank` give the
size and rank a caller should compute with: 1 and 0 whenever the group is not parallel, so torch's -1 of
a non-member never becomes a dimension (A6).
"""

from __future__ import annotations

from typing import Any

__all__ = ["effective_rank", "effective_size", "is_member", "is_parallel"]


def _size_seen(group: Any) -> int:
    """The group's size as the caller sees it: 0 for ``None``, a non-member or an uninitialised world.

    ``get_world_size`` reads the group's local state, so this issues no collective; it is -1 for a
    non-member that holds a group handle, which is less than 1 as well.
    """
    if group is None:  # A1: touches nothing, works before init_process_group
        return 0
    import torch.distributed as dist

    if group is dist.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
        return 0
    return int(dist.get_world_size(group))


def is_member(group: Any) -> bool:
    """Whether the caller belongs to ``group`` (False for ``None`` and for a non-member). No collective."""
    return _size_seen(group) >= 1


def is_parallel(group: Any) -> bool:
    """Whether a collective on ``group`` would exchange data with another rank.

    ========================================  =======
    group                                     result
    ========================================  =======
    ``None`` (dimension absent)               False   (touches nothing: works before init_process_group)
    caller outside the group (size -1)        False   (no collective, cannot hang)
    one rank (the caller)                     False
    two or more ranks including the caller    True
    ========================================  =======
    """
    return _size_seen(group) >= 2


def effective_size(group: Any) -> int:
    """The number of ranks the caller computes with along this dimension: the group size if parallel, else 1."""
    if not is_parallel(group):
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def effective_rank(group: Any) -> int:
    """The caller's index along this dimension: its group rank if parallel, else 0."""
    if not is_parallel(group):
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group))
