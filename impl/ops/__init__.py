"""Native ops of impl: the uneven-shard allgather and its compaction kernel (SPEC D5, D6).

The Python API is :mod:`impl.ops.allgather` (every name of its ``__all__`` is re-exported here); the
build of ``csrc/`` on first use is :mod:`impl.ops._build`.
"""

from __future__ import annotations

from impl.ops import allgather as _allgather
from impl.ops._build import ExtensionBuildError, ExtensionInfo, load_extension
from impl.ops.allgather import *  # noqa: F403  (the API, listed once: allgather.__all__)

__all__ = [*_allgather.__all__, "ExtensionBuildError", "ExtensionInfo", "load_extension"]
