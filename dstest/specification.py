"""``@dstest.spec``: one test body that runs on every rank of every world it is expanded to.

.. code-block:: python

    @dstest.spec(world_size=[1, 2, 3, 4], contract="A4")
    def test_guard_skips_non_member(ctx):
        g = ctx.groups.excluding(0)   # rank 0 is not a member
        ...                           # runs on every rank; assert freely

The decorator returns an ordinary pytest test function: the plugin parametrizes it with one case per
(world, world size), ids like ``[threaded-ws3]``, each carrying the world's ``cpu`` or ``gpu`` marker.
``pytest.mark.parametrize`` arguments and ordinary fixtures reach every rank as keyword arguments.
Outside pytest, :func:`run` and :func:`run_spec` do the same work.

(The module is not called ``spec.py``: importing a submodule ``dstest.spec`` would replace the
``dstest.spec`` decorator with the module.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dstest.errors import InvalidArgument, RankFailure

__all__ = ["CASE_ARG", "SETTINGS_ARG", "Case", "Settings", "SpecInfo", "run", "run_spec", "spec", "spec_info"]

CASE_ARG = "dstest_case"
SETTINGS_ARG = "dstest_settings"
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True)
class SpecInfo:
    """What ``@dstest.spec`` recorded about a spec body."""

    fn: Callable[..., Any]
    world_sizes: tuple[int, ...]
    worlds: tuple[str, ...] | None
    timeout: float | None
    contract: str | None

    @property
    def name(self) -> str:
        return self.fn.__name__


@dataclass(frozen=True, kw_only=True)
class Case:
    """One expansion of a spec: a world and a world size."""

    world: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.world}-ws{self.world_size}"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Run settings shared by every case (from the ``--dstest-*`` options)."""

    timeout: float = 60.0
    target: str = "impl"
    seed: int = 0


def _as_sizes(world_size: int | Iterable[int]) -> tuple[int, ...]:
    sizes = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    if not sizes:
        raise InvalidArgument("world_size=[] must name at least one world size")
    for ws in sizes:
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            raise InvalidArgument(f"world_size={world_size!r}: each size must be an int >= 1, got {ws!r}")
    return sizes


def spec(
    world_size: int | Iterable[int] = (2,),
    *,
    worlds: Sequence[str] | None = None,
    timeout: float | None = None,
    contract: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a spec: ``fn(ctx, **params)`` runs on every rank of each (world, world size).

    ``worlds`` defaults to :data:`dstest.worlds.DEFAULT_WORLDS` (threaded on CPU, NCCL on GPUs);
    ``contract`` names the SPEC.md line the spec checks (shown in reports).
    """
    sizes = _as_sizes(world_size)
    if worlds is not None:
        from dstest.worlds import WORLD_NAMES

        unknown = [w for w in worlds if w not in WORLD_NAMES]
        if unknown:
            raise InvalidArgument(f"worlds={list(worlds)!r}: unknown {unknown}; allowed: {list(WORLD_NAMES)}")
    if timeout is not None and timeout <= 0:
        raise InvalidArgument(f"timeout={timeout!r} must be > 0 seconds")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise InvalidArgument(f"spec {fn.__qualname__} must take the rank context as its first argument")
        info = SpecInfo(
            fn=fn, world_sizes=sizes, worlds=tuple(worlds) if worlds else None, timeout=timeout, contract=contract
        )

        def wrapper(**kwargs: Any) -> None:
            case = kwargs.pop(CASE_ARG)
            settings = kwargs.pop(SETTINGS_ARG)
            run_spec(info, case, settings, kwargs)

        # A real pytest function whose arguments are the case, the settings and the body's own
        # parameters after ctx (parametrize names and fixtures). No __wrapped__: pytest must not see
        # through to the body, whose first argument is not a fixture.
        hidden = [
            inspect.Parameter(CASE_ARG, inspect.Parameter.KEYWORD_ONLY),
            inspect.Parameter(SETTINGS_ARG, inspect.Parameter.KEYWORD_ONLY),
        ]
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[1:]]
        wrapper.__signature__ = inspect.Signature(hidden + rest)  # type: ignore[attr-defined]
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(wrapper, attr, getattr(fn, attr))
        wrapper.__dict__.update(fn.__dict__)  # keeps pytest marks applied below the decorator
        wrapper.__dstest_spec__ = info  # type: ignore[attr-defined]
        return wrapper

    return decorate


def spec_info(obj: object) -> SpecInfo | None:
    """The SpecInfo of a spec-decorated function, or None."""
    info = getattr(obj, "__dstest_spec__", None)
    return info if isinstance(info, SpecInfo) else None


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    world: str = "threaded",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    seed: int = 0,
    target: str = "impl",
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank of a world; returns per-rank results.

    Per rank::

        rank 0: fn(ctx(rank=0)) -> r0      run(fn, 2) == [r0, r1]
        rank 1: fn(ctx(rank=1)) -> r1
    """
    from dstest.worlds import get_world

    return get_world(world).run(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, seed=seed, target=target)


def run_spec(info: SpecInfo, case: Case, settings: Settings, params: dict[str, Any]) -> list[Any]:
    """Run one case of a spec; skips (via pytest) when the world cannot host it or every rank skipped."""
    import pytest

    from dstest.worlds import get_world

    world = get_world(case.world)
    reason = world.unavailable_reason(case.world_size)
    if reason is not None:
        pytest.skip(reason)
    try:
        return world.run(
            info.fn,
            case.world_size,
            kwargs=params,
            timeout=info.timeout or settings.timeout,
            seed=settings.seed,
            target=settings.target,
        )
    except RankFailure as failure:
        from dstest.errors import WorldAborted

        primary = [e for e in failure.exceptions.values() if not isinstance(e, WorldAborted)]
        skipped = [e for e in primary if isinstance(e, pytest.skip.Exception)]
        if skipped and len(skipped) == len(primary):
            pytest.skip(str(skipped[0]))
        raise
