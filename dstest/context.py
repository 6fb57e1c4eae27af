"""The per-rank context a spec receives as its first argument."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

    from dstest.groups import GroupBuilder
    from dstest.targets.base import Target

__all__ = ["RankContext", "current_context", "rank_seed"]


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator: distinct per rank, identical run after run (E5)."""
    return zlib.crc32(f"{seed}:{rank}".encode()) & 0x7FFF_FFFF


_CURRENT = threading.local()


def current_context() -> RankContext | None:
    """The RankContext of the rank running on this thread (or process), if any."""
    return getattr(_CURRENT, "ctx", None)


@dataclass(kw_only=True)
class RankContext:
    """What one rank of a world knows about itself.

    ``generator`` is this rank's own seeded RNG (E5). Threads of one process share torch's global RNG, so
    draw through ``ctx.randn``/``ctx.rand``/``ctx.randint`` (or pass ``generator=ctx.generator``) to get
    numbers that do not depend on how the ranks were scheduled.
    """

    rank: int
    world_size: int
    world: str
    device: torch.device
    seed: int = 0
    target_name: str = "impl"
    generator: torch.Generator = field(init=False, repr=False)
    _groups: GroupBuilder | None = field(default=None, init=False, repr=False)
    _target: Target | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(rank_seed(self.seed, self.rank))

    # -- random data -----------------------------------------------------------------------------
    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normal samples from this rank's generator, on this rank's device."""
        return torch.randn(*shape, generator=self.generator, dtype=dtype).to(self.device)

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, dtype=dtype).to(self.device)

    def randint(self, low: int, high: int, shape: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.generator, dtype=dtype).to(self.device)

    def numpy_rng(self) -> np.random.Generator:
        import numpy as np

        return np.random.default_rng([self.seed, self.rank])

    # -- helpers bound to this rank ---------------------------------------------------------------
    @property
    def groups(self) -> GroupBuilder:
        """Builders for the hard group topologies (absent, single-rank, non-member, subgroups)."""
        if self._groups is None:
            from dstest.groups import GroupBuilder

            self._groups = GroupBuilder(rank=self.rank, world_size=self.world_size)
        return self._groups

    @property
    def target(self) -> Target:
        """The system under test (``impl`` unless ``--dstest-target`` says otherwise)."""
        if self._target is None:
            from dstest.targets import get_target

            self._target = get_target(self.target_name)
        return self._target

    def bind(self) -> Any:
        """Make this context the current one on this thread; returns a token for ``unbind``."""
        previous = getattr(_CURRENT, "ctx", None)
        _CURRENT.ctx = self
        return previous

    @staticmethod
    def unbind(token: Any) -> None:
        _CURRENT.ctx = token
