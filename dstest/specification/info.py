"""What a spec declares and the settings of a run: :class:`SpecInfo`, :class:`Case`, :class:`Settings`, the
keywords the plugin passes a spec, and the checks of the options that both ``@dstest.spec`` and ``dstest.run``
take (``async_hazards``, ``strict_shapes``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dstest.errors import InvalidArgument
from dstest.registry import check_target
from dstest.worlds.protocol import check_seed, check_timeout
from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT

__all__ = [
    "CASE_ARG",
    "INSTANCE_ARG",
    "SETTINGS_ARG",
    "SKIP_LOCATION_ATTR",
    "Case",
    "Settings",
    "SpecInfo",
    "check_async_hazards",
    "check_strict_shapes",
    "spec_info",
]

CASE_ARG = "dstest_case"
SETTINGS_ARG = "dstest_settings"
#: The keyword that carries a spec method's ``self`` to its ranks (see :class:`~dstest.specification.bodies.SpecSelf`).
INSTANCE_ARG = "_dstest_instance"
#: Where pytest's report of a skip should point: ``(path, 1-based line)``, set on the Skipped raised by
#: :func:`~dstest.specification.runs.run_spec` and read by the plugin's ``pytest_runtest_makereport``.
SKIP_LOCATION_ATTR = "dstest_location"


@dataclass(frozen=True, kw_only=True)
class SpecInfo:
    """What ``@dstest.spec`` recorded about a spec body.

    ``fn`` is what the worlds call as ``fn(ctx, **params)`` (after the run request's setup bound the target
    onto ``ctx``): an adapter that calls ``body(ctx, **params)``, or for a method of a test class ``body(self, ctx, **params)`` (``self`` travels under
    :data:`INSTANCE_ARG`). It carries the body's module and qualified name, so a world that sends
    functions by reference finds it through the spec (``spec_info(module.qualname).fn``). ``body`` is the
    function as the user wrote it.
    """

    fn: Callable[..., Any]
    world_sizes: tuple[int, ...]
    worlds: tuple[str, ...] | None
    timeout: float | None
    contract: str | None
    body: Callable[..., Any] | None = None
    method: bool = False
    async_hazards: bool = False
    strict_shapes: bool = False
    faults: tuple[Any, ...] = ()  # dstest.faults to inject in every case (contract G5)

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def source(self) -> Callable[..., Any]:
        """The user's function (where its file and lines are)."""
        return self.body if self.body is not None else self.fn


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
    """Run settings shared by every case (from the ``--dstest-*`` options); checked on creation."""

    timeout: float = DEFAULT_TIMEOUT
    target: str = "impl"
    seed: int = DEFAULT_SEED
    async_hazards: bool = False
    strict_shapes: bool = False
    judge_on_processes: bool = True
    crosscheck: int = 0  # percent of the threaded cases also run on the process world and compared

    def __post_init__(self) -> None:
        check_timeout(self.timeout)
        check_target(self.target)
        check_seed(self.seed)
        check_async_hazards(self.async_hazards)
        check_strict_shapes(self.strict_shapes)
        if not isinstance(self.crosscheck, int) or isinstance(self.crosscheck, bool) or not 0 <= self.crosscheck <= 100:
            raise InvalidArgument(f"crosscheck={self.crosscheck!r}: give a percent of the threaded cases, 0 to 100")
        if not isinstance(self.judge_on_processes, bool):
            raise InvalidArgument(f"judge_on_processes={self.judge_on_processes!r}: give True or False")


def check_strict_shapes(value: object) -> bool:
    """``strict_shapes`` must be a bool."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"strict_shapes={value!r}: must be True or False, got a {type(value).__name__}")
    return value


def check_async_hazards(value: object, worlds: Sequence[str] | None = None) -> bool:
    """``async_hazards`` must be a bool; with True, explicit ``worlds`` must be ones that can poison."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"async_hazards={value!r}: must be True or False, got a {type(value).__name__}")
    if value and worlds is not None:
        from dstest.worlds import world_names

        other = [w for w in worlds if not _can_poison(w)]
        if other:
            raise InvalidArgument(
                f"async_hazards=True with worlds={list(worlds)!r}: {other} cannot poison unwaited outputs "
                f"(the fake world moves no data, gloo and NCCL write outputs themselves); allowed worlds: "
                f"{[w for w in world_names() if _can_poison(w)]}"
            )
    return value


def _can_poison(world: str) -> bool:
    """Whether world ``world`` declares hazards (a name no plug-in registered yet is left to its run to judge)."""
    from dstest.worlds import capabilities_of, get_world

    try:
        return capabilities_of(get_world(world)).hazards
    except InvalidArgument:
        return True


def spec_info(obj: object) -> SpecInfo | None:
    """The SpecInfo of a spec-decorated function, or None."""
    info = getattr(obj, "__dstest_spec__", None)
    return info if isinstance(info, SpecInfo) else None
