"""``dstest.crosscheck``: one body on the threaded world and on the process world, compared (contract E14).

Rank threads share what processes do not: torch's caches and registries, a library's module globals, the
global RNG. dstest isolates what it knows of; this finds the next one before a user does. The same body
runs on each world (by reference, so the process world's workers can import it); the two must give

- the same verdict (both pass, or both fail),
- the same per-rank results, compared by type and exactly (:func:`difference`): tensors and numpy arrays
  by dtype, shape and bytes (a NaN equals the same NaN bits, ``-0.0`` differs from ``0.0``) or within
  ``rtol``/``atol``; containers recursively, the first difference named by its path
  (``rank 1's result[1]['w'][3]``); plain values by ``==``; and
- the same collective trace per rank: op, group, sequence number, dtype, shapes, reduce op, root and
  peer of every call, in order.

The first difference raises :class:`~dstest.errors.WorldsDiverge` naming the rank, what differs and both
sides. Where the worlds differ, the threaded world is wrong until shown otherwise::

    results = dstest.crosscheck(body, 4, kwargs={"rows": 9})   # the threaded world's results
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from dstest.compare import (  # the comparison itself (re-exported: dstest.crosscheck.difference is public)
    Difference,
    compare_outcomes,
    difference,
    run_recorded,
    trace_signature,
)
from dstest.errors import InvalidArgument
from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT

__all__ = ["Difference", "crosscheck", "difference", "trace_signature"]


def crosscheck(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    worlds: Sequence[str] = ("threaded", "process"),
    timeout: float = DEFAULT_TIMEOUT,
    seed: int = DEFAULT_SEED,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[Any]:
    """Run ``fn`` on both ``worlds`` and compare verdicts, per-rank results and collective traces.

    Returns the first world's per-rank results. Raises :class:`WorldsDiverge` at the first difference, and
    the first world's :class:`RankFailure` when the body fails on both. ``rtol``/``atol`` compare floating
    results within a tolerance (default: bit for bit). ``fn`` must be importable by reference (a
    module-level function) for the process world.
    """
    from dstest.specification import run

    if len(worlds) != 2 or len(set(worlds)) != 2:
        raise InvalidArgument(f"crosscheck: worlds={list(worlds)!r}: name two different worlds")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise InvalidArgument(f"crosscheck: {name}={value!r}: must be a finite number >= 0")

    def on(world: str) -> Callable[[], list[Any]]:
        return lambda: run(fn, world_size, world=world, args=args, kwargs=kwargs, timeout=timeout, seed=seed)

    outcomes = {world: run_recorded(world_size, on(world)) for world in worlds}
    return compare_outcomes(getattr(fn, "__qualname__", repr(fn)), world_size, outcomes, rtol=rtol, atol=atol)


class _CallableModule(types.ModuleType):
    """``dstest.crosscheck`` is this function, loaded on first use (``dstest.__getattr__``); but importing the
    module itself (``from dstest.crosscheck import difference``) makes Python set the package's
    ``crosscheck`` attribute to the module. Calling the module calls the function, so ``dstest.crosscheck(...)``
    works whichever came first."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return crosscheck(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
