"""Running specs and rank functions: :func:`run` (``dstest.run``, any rank function, outside pytest too) and
:func:`run_spec` (one case of a spec, as the plugin's test function calls it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dstest.binding import TargetBinding, prepares, world_device
from dstest.errors import InvalidSpec, RankFailure
from dstest.registry import check_world_name
from dstest.specification.bodies import SpecSelf, refuse_unrun_results
from dstest.specification.info import (
    INSTANCE_ARG,
    Case,
    Settings,
    SpecInfo,
    check_async_hazards,
    check_strict_shapes,
    spec_info,
)
from dstest.specification.judging import crosschecked, judge_on_processes, sampled, thread_shared
from dstest.specification.skips import skip, skip_if_every_rank_skipped, skip_location
from dstest.worlds.core.faults import check_faults
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT, RunRequest

__all__ = ["run", "run_spec"]


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    world: str = "threaded",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    seed: int = DEFAULT_SEED,
    target: str = "impl",
    async_hazards: bool = False,
    strict_shapes: bool = False,
    watch_modules: Sequence[str] = (),
    faults: Iterable[Any] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank of a world; returns per-rank results.

    Per rank::

        rank 0: fn(ctx(rank=0)) -> r0      run(fn, 2) == [r0, r1]
        rank 1: fn(ctx(rank=1)) -> r1

    ``ctx.target`` is ``target``'s adapter on every rank (the world knows nothing of it: the run binds it,
    see :class:`~dstest.binding.TargetBinding`). Every argument is checked before anything starts
    (:mod:`dstest.worlds.protocol`): an unknown world or target, a timeout that is not a finite positive
    number of seconds (at most a day), a world size that is not an int >= 1, or a generator or
    ``async def`` ``fn`` raise :class:`~dstest.errors.InvalidArgument`. ``async_hazards=True`` poisons unwaited
    async outputs (:mod:`dstest.worlds.threaded.hazards`; threaded worlds); ``strict_shapes=True`` refuses
    collectives whose ranks' buffers differ only in shape (by default, as on gloo and NCCL, element counts
    and dtypes must match, shapes may differ). ``watch_modules`` (process world): module-level state of those
    modules that the run changes is put back after it and reported as :class:`~dstest.errors.StateLeftBehind`.
    ``faults``: :mod:`dstest.faults` to inject (``Kill``, ``Fail``, ``Delay``; threaded and process worlds; a
    killed rank's result is a ``dstest.faults.Killed``; contract G5). Wrap the call in
    :func:`dstest.recording` to keep its collective trace.
    """
    info = _checked_spec(fn, world, async_hazards, strict_shapes)
    binding = TargetBinding(target)
    request = RunRequest(
        fn if info is None else info.fn,
        world_size,
        args=args,
        kwargs=kwargs or {},
        timeout=timeout,
        seed=seed,
        setup=binding,  # binding(ctx) on every rank, then fn
        async_hazards=async_hazards,
        strict_shapes=strict_shapes or (info is not None and info.strict_shapes and capabilities(world).strict_shapes),
        watch_modules=tuple(watch_modules) if not isinstance(watch_modules, str) else (watch_modules,),
        faults=check_faults(faults) or (info.faults if info is not None else ()),
    )
    from dstest.worlds import get_world

    capabilities(world).refuse(request, world)  # before anything starts; a plug-in world may not refuse it
    if prepares(target, fn):
        binding.prepare(world_device(world))  # the target's builds, once, outside the run's timeout
    results = get_world(world).run(request)
    refuse_unrun_results(results, fn, generators=False)
    return results


def capabilities(world: str) -> Capabilities:
    """What world ``world`` declares it can do beyond running ranks."""
    from dstest.worlds import capabilities_of, get_world

    return capabilities_of(get_world(world))


def _checked_spec(fn: Callable[..., Any], world: str, async_hazards: bool, strict_shapes: bool) -> SpecInfo | None:
    """:func:`run`'s checks of ``fn``, ``world`` and the switches, before anything starts; the spec of ``fn``, if it
    is one (a spec method needs the instance pytest makes, so it is refused here)."""
    info = spec_info(fn)
    if info is not None:
        if info.method:
            raise InvalidSpec(f"{info.source.__qualname__} is a spec method of a test class: run it through pytest")
    check_world_name(world)
    check_async_hazards(async_hazards, [world])
    check_strict_shapes(strict_shapes)
    return info


def run_spec(
    info: SpecInfo, case: Case, settings: Settings, params: dict[str, Any], *, instance: object = None
) -> list[Any]:
    """Run one case of a spec; skips (via pytest) when the world cannot host it or every rank skipped.

    ``instance`` is the test-class instance of a spec method (``self``). A skip is reported at the spec
    body's line, not here.
    """
    from dstest.worlds import get_world

    world = get_world(case.world)
    reason = world.unavailable_reason(case.world_size)
    if reason is not None:
        skip(reason, skip_location(info, None, None))
    kwargs = dict(params)
    if info.method:
        kwargs[INSTANCE_ARG] = SpecSelf(instance)
    binding = TargetBinding(settings.target)
    if prepares(settings.target, info.source):
        binding.prepare(world_device(case.world))  # the target's builds, once, outside the run's timeout

    def request_for(world_name: str) -> RunRequest:
        return RunRequest(
            info.fn,
            case.world_size,
            kwargs=kwargs,
            timeout=info.timeout or settings.timeout,
            seed=settings.seed,
            setup=binding,  # on every rank, before the body
            # The session-wide switches apply where the world declares them (Capabilities).
            async_hazards=(info.async_hazards or settings.async_hazards) and capabilities(world_name).hazards,
            strict_shapes=(info.strict_shapes or settings.strict_shapes) and capabilities(world_name).strict_shapes,
            faults=info.faults,
        )

    judge = settings.judge_on_processes and case.world == "threaded"
    if case.world == "threaded" and sampled(settings.crosscheck, f"{info.name}[{case.id}]"):
        return crosschecked(info, case, world, request_for, judge)
    request = request_for(case.world)
    capabilities(case.world).refuse(request, case.world)  # a plug-in world may not refuse it itself
    try:
        results = world.run(request)
    except RankFailure as failure:
        skip_if_every_rank_skipped(info, failure)
        shared = thread_shared(world, failure)
        if judge and shared:
            return judge_on_processes(info, case, request_for("process"), shared, failure)
        raise
    shared = thread_shared(world, None) if judge else []
    if shared:
        return judge_on_processes(info, case, request_for("process"), shared, None)
    refuse_unrun_results(results, info.source, generators=True)
    return results
