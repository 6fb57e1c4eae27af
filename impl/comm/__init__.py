"""Communication for impl: group predicates (``pg_utils``) and guarded, counted collectives (``collectives``)."""

from __future__ import annotations

from impl.comm.collectives import Comm, CommStats
from impl.comm.pg_utils import effective_rank, effective_size, is_parallel

__all__ = ["Comm", "CommStats", "effective_rank", "effective_size", "is_parallel"]
