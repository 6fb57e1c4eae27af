"""The interface every world implements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from dstest.errors import InvalidArgument, InvalidWorldSize

__all__ = ["World", "check_run_arguments"]


def check_run_arguments(world_size: object, timeout: float) -> None:
    """The checks every ``World.run`` makes before it starts anything."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidWorldSize(f"world_size={world_size!r} must be an int >= 1")
    if timeout <= 0:
        raise InvalidArgument(f"timeout={timeout!r} must be > 0 seconds")


@runtime_checkable
class World(Protocol):
    """Runs ``fn(ctx, *args, **kwargs)`` on the ranks of a (simulated or real) process group.

    ``run`` returns per-rank results in rank order, or raises one error that carries every failing
    rank's traceback (:class:`dstest.errors.RankFailure`) or every rank's stack
    (:class:`dstest.errors.WorldTimeout`). Nothing it started outlives the call.
    """

    name: str

    @property
    def marker(self) -> str:
        """'cpu' or 'gpu': the pytest marker of items that run in this world."""
        ...

    def unavailable_reason(self, world_size: int) -> str | None:
        """Why this world cannot run ``world_size`` ranks here (a skip reason), or None."""
        ...

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = 60.0,
        seed: int = 0,
        target: str = "impl",
    ) -> list[Any]: ...
