"""Native ops of impl: the uneven-shard allgather and its compaction kernel (SPEC D5, D6)."""

from __future__ import annotations

from impl.ops._build import ExtensionBuildError, ExtensionInfo, load_extension
from impl.ops.allgather import (
    AllgatherV,
    GroupedAllgatherV,
    Impl,
    allgather_v,
    allgather_v_many,
    compact,
    compact_grouped,
    compact_grouped_reference,
    compact_reference,
    shard_size,
)

__all__ = [
    "AllgatherV",
    "ExtensionBuildError",
    "ExtensionInfo",
    "GroupedAllgatherV",
    "Impl",
    "allgather_v",
    "allgather_v_many",
    "compact",
    "compact_grouped",
    "compact_grouped_reference",
    "compact_reference",
    "load_extension",
    "shard_size",
]
