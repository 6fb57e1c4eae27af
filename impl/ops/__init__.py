"""Native ops of impl: the uneven-shard allgather and its compaction kernel (contract D5, D6).

The Python API is :mod:`impl.ops.allgather` (the collective) and :mod:`impl.ops.compact` (the compaction
and its pure-torch references); every name of their ``__all__`` is re-exported here. The build of
``csrc/`` on first use is :mod:`impl.ops._build`.
"""

from __future__ import annotations

from impl.ops import allgather as _allgather
from impl.ops import compact as _compact
from impl.ops._build import ExtensionBuildError, ExtensionInfo, load_extension
from impl.ops.allgather import *  # noqa: F403  (listed once: allgather.__all__)
from impl.ops.compact import *  # noqa: F403  (listed once: compact.__all__)

__all__ = [*_allgather.__all__, *_compact.__all__, "ExtensionBuildError", "ExtensionInfo", "load_extension"]
