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
import numbers
import pickle
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from dstest.binding import TargetBinding, prepares, world_device
from dstest.errors import InvalidArgument, InvalidSpec, InvalidWorldSize, RankFailure
from dstest.registry import check_target, check_world_name
from dstest.worlds.core.faults import check_faults
from dstest.worlds.protocol import RANK_FN_ATTR, check_rank_function, check_seed, check_timeout
from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT, RunRequest

__all__ = [
    "CASE_ARG",
    "SETTINGS_ARG",
    "Case",
    "Settings",
    "SpecInfo",
    "TargetBinding",
    "run",
    "run_spec",
    "spec",
    "spec_info",
]

CASE_ARG = "dstest_case"
SETTINGS_ARG = "dstest_settings"
#: The keyword that carries a spec method's ``self`` to its ranks (see :class:`_Instance`).
INSTANCE_ARG = "_dstest_instance"
#: The keyword that carries a spec's :class:`TargetBinding` to its ranks (popped by the rank adapter).
#: Where pytest's report of a skip should point: ``(path, 1-based line)``, set on the Skipped raised by
#: :func:`run_spec` and read by the plugin's ``pytest_runtest_makereport``.
SKIP_LOCATION_ATTR = "dstest_location"
F = TypeVar("F", bound=Callable[..., Any])


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


def _as_sizes(world_size: object) -> tuple[int, ...]:
    if isinstance(world_size, numbers.Integral) and not isinstance(world_size, bool):
        sizes: tuple[Any, ...] = (world_size,)
    elif isinstance(world_size, str | bytes) or not isinstance(world_size, Iterable):
        raise InvalidWorldSize(
            f"world_size={world_size!r} ({type(world_size).__name__}): give an int >= 1 or a list of them, "
            "e.g. world_size=[1, 2, 4]"
        )
    else:
        sizes = tuple(world_size)
    if not sizes:
        raise InvalidWorldSize("world_size=[] must name at least one world size")
    for ws in sizes:
        if not isinstance(ws, numbers.Integral) or isinstance(ws, bool) or ws < 1:
            raise InvalidWorldSize(f"world_size={world_size!r}: each size must be an int >= 1, got {ws!r}")
    repeated = sorted({int(ws) for ws in sizes if sizes.count(ws) > 1})
    if repeated:
        raise InvalidWorldSize(f"world_size={world_size!r}: lists {repeated} more than once; give each size once")
    return tuple(int(ws) for ws in sizes)


def _as_worlds(worlds: object) -> tuple[str, ...] | None:
    if worlds is None:
        return None
    from dstest.registry import world_names

    WORLD_NAMES = world_names()
    if isinstance(worlds, str | bytes) or not isinstance(worlds, Iterable):
        raise InvalidArgument(
            f"worlds={worlds!r}: give a list of world names, e.g. worlds=['threaded']; allowed: {list(WORLD_NAMES)}"
        )
    names = tuple(worlds)
    unknown = [w for w in names if not isinstance(w, str) or w not in WORLD_NAMES]
    if unknown:
        raise InvalidArgument(f"worlds={list(names)!r}: unknown {unknown}; allowed: {list(WORLD_NAMES)}")
    if not names:
        raise InvalidArgument(
            f"worlds=[] names no world; leave it out for the default, or pick from {list(WORLD_NAMES)}"
        )
    repeated = sorted({w for w in names if names.count(w) > 1})
    if repeated:
        raise InvalidArgument(f"worlds={list(names)!r}: lists {repeated} more than once; give each world once")
    return names


#: Worlds that can poison unwaited outputs (``async_hazards=True``); the nccl world runs on the threaded
#: world when GPUs are fewer than ranks and runs plain NCCL otherwise.
HAZARD_WORLDS = ("threaded", "threaded-cuda", "nccl")


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
        other = [w for w in worlds if w not in HAZARD_WORLDS]
        if other:
            raise InvalidArgument(
                f"async_hazards=True with worlds={list(worlds)!r}: {other} cannot poison unwaited outputs "
                f"(the fake world moves no data, gloo and NCCL write outputs themselves); allowed worlds: "
                f"{list(HAZARD_WORLDS)}"
            )
    return value


def _defined_in_class(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was written in a class body (``Cls.meth``, not ``outer.<locals>.inner``)."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


class _Instance:
    """Carries a spec method's ``self`` to its ranks.

    In-process worlds get the object itself (every rank shares the instance pytest made). For the process
    world it pickles to bytes and unpickles only when the rank calls the method, after the worker has
    imported the test module (which ``pickle`` could not find by name on its own).
    """

    def __init__(self, obj: object) -> None:
        self._obj = obj
        self._blob: bytes | None = None

    def get(self) -> object:
        if self._blob is not None:
            self._obj, self._blob = pickle.loads(self._blob), None
        return self._obj

    def __reduce__(self) -> tuple[Callable[[bytes], _Instance], tuple[bytes]]:
        try:
            blob = pickle.dumps(self._obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise InvalidArgument(
                f"self={self._obj!r}: the process world sends a spec method's test-class instance to its "
                f"workers, and this one does not pickle ({type(exc).__name__}: {exc}); keep only picklable "
                "attributes on self, or make the spec a module-level function"
            ) from exc
        return (_instance_from_blob, (blob,))


def _instance_from_blob(blob: bytes) -> _Instance:
    holder = _Instance(None)
    holder._blob = blob
    return holder


def _rank_adapter(body: Callable[..., Any], method: bool) -> Callable[..., Any]:
    """``fn(ctx, **params)`` for the worlds: calls ``body(ctx, **params)``.

    For a method of a test class it calls ``body(self, ctx, **params)``. ``self`` travels in the params
    (:data:`INSTANCE_ARG`), so the adapter survives worlds that send
    functions by reference: it takes the body's module and qualified name, and the process world finds it
    through the spec wrapper, whose :class:`SpecInfo` holds it.
    """

    def call(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if not method:
            return body(ctx, *args, **kwargs)
        holder = kwargs.pop(INSTANCE_ARG, None)
        if not isinstance(holder, _Instance):
            raise InvalidSpec(
                f"{body.__qualname__} is a method of a test class: run it through pytest (which makes self), "
                "not with dstest.run"
            )
        return body(holder.get(), ctx, *args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(call, attr, getattr(body, attr))
    return call


def _check_body_parameters(fn: Callable[..., Any], method: bool) -> list[inspect.Parameter]:
    """The body's parameters after ``(self,) ctx``: the names pytest fills (parametrize, fixtures)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise InvalidSpec(f"spec {fn!r}: cannot read its signature ({exc})") from None
    leading = ["self", "ctx"] if method else ["ctx"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    head = params[: len(leading)]
    if len(head) < len(leading) or any(p.kind not in positional for p in head):
        shape = "(self, ctx, ...)" if method else "(ctx, ...)"
        raise InvalidSpec(
            f"spec {fn.__qualname__} must take the rank context as its first positional argument{' after self' if method else ''}: "
            f"def {fn.__name__}{shape}"
        )
    rest = params[len(leading) :]
    taken = [p.name for p in rest if p.name in (CASE_ARG, SETTINGS_ARG, INSTANCE_ARG)]
    if taken:
        raise InvalidSpec(f"spec {fn.__qualname__}: parameter names {taken} are reserved by dstest; rename them")
    odd = [p.name for p in rest if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)]
    if odd:
        raise InvalidSpec(
            f"spec {fn.__qualname__}: parameters {odd} cannot be filled by pytest (it passes parametrize values "
            "and fixtures by name); make them ordinary parameters"
        )
    return [p for p in rest if p.kind is not inspect.Parameter.VAR_KEYWORD]


def spec(
    world_size: int | Iterable[int] = (2,),
    *,
    worlds: Sequence[str] | None = None,
    timeout: float | None = None,
    contract: str | None = None,
    async_hazards: bool = False,
    strict_shapes: bool = False,
    faults: Iterable[Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a spec: ``fn(ctx, **params)`` runs on every rank of each (world, world size).

    ``worlds`` defaults to :data:`dstest.worlds.DEFAULT_WORLDS` (threaded on CPU, NCCL on GPUs);
    ``timeout`` (seconds, see :func:`dstest.worlds.protocol.check_timeout`) overrides ``--dstest-timeout``;
    ``contract`` names the docs/contracts.md line the spec checks (shown in reports). ``async_hazards=True``
    poisons the outputs of async collectives and irecvs until they are waited (see
    :mod:`dstest.worlds.threaded.hazards`; threaded worlds only, like ``--dstest-async-hazards``).
    ``strict_shapes=True`` also refuses collectives whose ranks' buffers differ only in shape (gloo and
    NCCL compare element counts and dtypes; like ``--dstest-strict-shapes``). ``faults``: the
    :mod:`dstest.faults` (``Kill``, ``Fail``, ``Delay``) injected in every case (threaded and process worlds;
    contract G5).

    In a test class, write ``def test_x(self, ctx, ...)``: ``self`` is the instance pytest made (shared by
    the ranks of in-process worlds, a pickled copy per rank in the process world), ``ctx`` the rank's
    context. Generator and ``async def`` bodies are refused (calling them would run nothing).
    """
    sizes = _as_sizes(world_size)
    names = _as_worlds(worlds)
    seconds = None if timeout is None else check_timeout(timeout)
    if contract is not None and not isinstance(contract, str):
        raise InvalidArgument(
            f"contract={contract!r}: must be a str naming a contract of docs/contracts.md (e.g. 'A4'), or None"
        )
    check_async_hazards(async_hazards, names)
    check_strict_shapes(strict_shapes)
    injected = check_faults(faults)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        check_rank_function(fn, "@dstest.spec body")
        method = _defined_in_class(fn) and next(iter(_signature_names(fn)), None) == "self"
        rest = _check_body_parameters(fn, method)
        info = SpecInfo(
            fn=_rank_adapter(fn, method),
            world_sizes=sizes,
            worlds=names,
            timeout=seconds,
            contract=contract,
            body=fn,
            method=method,
            async_hazards=async_hazards,
            strict_shapes=strict_shapes,
            faults=injected,
        )
        return _as_pytest_function(_spec_wrapper(fn, info, method), fn, info, method, rest)

    return decorate


def _spec_wrapper(fn: Callable[..., Any], info: SpecInfo, method: bool) -> Callable[..., Any]:
    """What pytest calls for the spec ``fn``: it takes the case and settings dstest's plugin passes (and,
    for a method of a test class, the instance pytest made) and runs the spec on them."""
    if method:

        def wrapper(self: Any, /, **kwargs: Any) -> None:
            case = kwargs.pop(CASE_ARG)
            settings = kwargs.pop(SETTINGS_ARG)
            run_spec(info, case, settings, kwargs, instance=self)

    else:

        def wrapper(*args: Any, **kwargs: Any) -> None:  # type: ignore[misc]
            if args:
                raise InvalidSpec(
                    f"spec {fn.__qualname__} was called with positional arguments {args!r}; a spec in a test "
                    "class must take self first, then the rank context: def "
                    f"{fn.__name__}(self, ctx, ...)"
                )
            case = kwargs.pop(CASE_ARG)
            settings = kwargs.pop(SETTINGS_ARG)
            run_spec(info, case, settings, kwargs)

    return wrapper


def _as_pytest_function(
    wrapper: Callable[..., Any], fn: Callable[..., Any], info: SpecInfo, method: bool, rest: list[inspect.Parameter]
) -> Callable[..., Any]:
    """``wrapper`` dressed as the body ``fn`` for pytest (name, module, docstring, marks) and marked as the
    spec ``info``."""
    # A real pytest function whose arguments are the case, the settings and the body's own
    # parameters after ctx (parametrize names and fixtures). No __wrapped__: pytest must not see
    # through to the body, whose first argument is not a fixture.
    hidden = [
        inspect.Parameter(CASE_ARG, inspect.Parameter.KEYWORD_ONLY),
        inspect.Parameter(SETTINGS_ARG, inspect.Parameter.KEYWORD_ONLY),
    ]
    # self as an ordinary parameter: pytest drops the first name of a method's signature.
    first = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if method else []
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in rest]
    wrapper.__signature__ = inspect.Signature(first + hidden + keyword)  # type: ignore[attr-defined]
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attr, getattr(fn, attr))
    wrapper.__dict__.update(fn.__dict__)  # keeps pytest marks applied below the decorator
    wrapper.__dstest_spec__ = info  # type: ignore[attr-defined]
    setattr(wrapper, RANK_FN_ATTR, info.fn)  # what worlds call when they find the spec by reference
    return wrapper


def _signature_names(fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def spec_info(obj: object) -> SpecInfo | None:
    """The SpecInfo of a spec-decorated function, or None."""
    info = getattr(obj, "__dstest_spec__", None)
    return info if isinstance(info, SpecInfo) else None


def _refuse_unrun_results(results: Sequence[Any], fn: Callable[..., Any], *, generators: bool) -> None:
    """A rank that returned a coroutine (or, for a spec, a generator) ran none of its body: fail loudly."""
    bad: list[int] = []
    for rank, value in enumerate(results):
        if inspect.iscoroutine(value) or inspect.isasyncgen(value) or (generators and inspect.isgenerator(value)):
            bad.append(rank)
            close = getattr(value, "close", None)
            if callable(close) and not inspect.isasyncgen(value):
                close()  # no "coroutine was never awaited" warning on top of this error
    if bad:
        kind = type(results[bad[0]]).__name__
        label = getattr(fn, "__qualname__", None) or repr(fn)
        raise InvalidSpec(
            f"fn={label} returned a {kind} on ranks {bad} instead of running: it wraps a generator or async "
            "function, whose body only runs when iterated or awaited; make the rank body a plain function"
        )


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
    see :class:`TargetBinding`). Every argument is checked before anything starts
    (:mod:`dstest.worlds.protocol`): an unknown world or target, a timeout that is not a finite positive
    number of seconds (at most a day), a world size that is not an int >= 1, or a generator or
    ``async def`` ``fn`` raise :class:`InvalidArgument`. ``async_hazards=True`` poisons unwaited
    async outputs (:mod:`dstest.worlds.threaded.hazards`; threaded worlds); ``strict_shapes=True`` refuses
    collectives whose ranks' buffers differ only in shape (by default, as on gloo and NCCL, element counts
    and dtypes must match, shapes may differ). ``watch_modules`` (process world): module-level state of those
    modules that the run changes is put back after it and reported as :class:`~dstest.errors.StateLeftBehind`.
    ``faults``: :mod:`dstest.faults` to inject (``Kill``, ``Fail``, ``Delay``; threaded and process worlds; a
    killed rank's result is a ``dstest.faults.Killed``; contract G5). Wrap the call in
    :func:`dstest.recording` to keep its collective trace.
    """
    info = spec_info(fn)
    if info is not None:
        if info.method:
            raise InvalidSpec(f"{info.source.__qualname__} is a spec method of a test class: run it through pytest")
    check_world_name(world)
    check_async_hazards(async_hazards, [world])
    check_strict_shapes(strict_shapes)
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
        strict_shapes=strict_shapes or (info is not None and info.strict_shapes),
        watch_modules=tuple(watch_modules) if not isinstance(watch_modules, str) else (watch_modules,),
        faults=check_faults(faults) or (info.faults if info is not None else ()),
    )
    from dstest.worlds import get_world

    if prepares(target, fn):
        binding.prepare(world_device(world))  # the target's builds, once, outside the run's timeout
    results = get_world(world).run(request)
    _refuse_unrun_results(results, fn, generators=False)
    return results


_FRAME_LINE = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in ', re.MULTILINE)


def _skip_location(info: SpecInfo, exc: BaseException | None, text: str | None) -> tuple[str, int]:
    """Where a skip inside a spec happened, as pytest reports it: ``(path, 1-based line)``.

    The innermost frame in the spec body's file: from the rank's traceback object (in-process worlds),
    else from its formatted traceback (the process world), else the body's ``def`` line.
    """
    code = getattr(inspect.unwrap(info.source), "__code__", None)
    if code is None:
        return ("<unknown>", 0)
    path = code.co_filename
    found: int | None = None
    tb: TracebackType | None = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            found = tb.tb_lineno
        tb = tb.tb_next
    if found is None and text:
        lines = [int(m["line"]) for m in _FRAME_LINE.finditer(text) if m["path"] == path]
        found = lines[-1] if lines else None
    return (path, found if found is not None else code.co_firstlineno)


def _skip(reason: str, location: tuple[str, int]) -> None:
    """``pytest.skip(reason)``, reported at ``location`` (see the plugin's makereport hook)."""
    import pytest

    exc = pytest.skip.Exception(reason, allow_module_level=False)
    setattr(exc, SKIP_LOCATION_ATTR, location)
    raise exc


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
        _skip(reason, _skip_location(info, None, None))
    kwargs = dict(params)
    if info.method:
        kwargs[INSTANCE_ARG] = _Instance(instance)
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
            async_hazards=(info.async_hazards or settings.async_hazards) and world_name in HAZARD_WORLDS,
            strict_shapes=info.strict_shapes or settings.strict_shapes,
            faults=info.faults,
        )

    judge = settings.judge_on_processes and case.world == "threaded"
    if case.world == "threaded" and sampled(settings.crosscheck, f"{info.name}[{case.id}]"):
        return _crosschecked(info, case, world, request_for, judge)
    try:
        results = world.run(request_for(case.world))
    except RankFailure as failure:
        _skip_if_every_rank_skipped(info, failure)
        shared = _thread_shared(world, failure)
        if judge and shared:
            return _judge_on_processes(info, case, request_for("process"), shared, failure)
        raise
    shared = _thread_shared(world, None) if judge else []
    if shared:
        return _judge_on_processes(info, case, request_for("process"), shared, None)
    _refuse_unrun_results(results, info.source, generators=True)
    return results


def _skip_if_every_rank_skipped(info: SpecInfo, failure: RankFailure) -> None:
    """A run whose every failing rank called ``pytest.skip`` is a skip, reported at the body's line."""
    import pytest

    from dstest.errors import WorldAborted

    primary = {r: e for r, e in failure.exceptions.items() if not isinstance(e, WorldAborted)}
    skipped = {r: e for r, e in primary.items() if isinstance(e, pytest.skip.Exception)}
    if skipped and len(skipped) == len(primary):
        rank, first = next(iter(skipped.items()))
        _skip(str(first), _skip_location(info, first, failure.failures.get(rank)))


def _thread_shared(world: Any, failure: RankFailure | None) -> list[str]:
    """What a threaded run shared between rank threads that processes would not: carried by its failure, or
    asked of the world after a pass (worlds without rank threads share nothing)."""
    if failure is not None:
        return list(getattr(failure, "thread_shared", None) or [])
    return world.thread_shared() if hasattr(world, "thread_shared") else []


def sampled(percent: int, case_name: str) -> bool:
    """Whether ``--dstest-crosscheck`` (``percent`` of the threaded cases, 100 for all) takes this case: the
    same cases run after run (a digest of the case's name), so a divergence found once is found again."""
    import zlib

    return percent >= 100 or (percent > 0 and zlib.crc32(case_name.encode()) % 100 < percent)


def _crosschecked(
    info: SpecInfo, case: Case, threaded: Any, request_for: Callable[[str], RunRequest], judge: bool
) -> list[Any]:
    """``--dstest-crosscheck``: the threaded case also runs on the process world; verdicts, per-rank results
    and collective traces must agree bit for bit (:func:`dstest.compare.compare_outcomes`), else the test
    fails with :class:`~dstest.errors.WorldsDiverge` naming the first difference (contract E14)."""
    from dstest.compare import compare_outcomes, run_recorded
    from dstest.worlds import get_world

    first = run_recorded(case.world_size, lambda: threaded.run(request_for("threaded")))
    if first.failure is not None:
        _skip_if_every_rank_skipped(info, first.failure)
    shared = _thread_shared(threaded, first.failure)
    if judge and shared:
        return _judge_on_processes(info, case, request_for("process"), shared, first.failure)
    process = get_world("process")
    if process.unavailable_reason(case.world_size) is not None:
        if first.failure is not None:
            raise first.failure
        return first.results or []
    second = run_recorded(case.world_size, lambda: process.run(request_for("process")))
    outcomes = {"threaded": first, "process": second}
    results = compare_outcomes(f"{info.name}[{case.id}]", case.world_size, outcomes, rtol=0.0, atol=0.0)
    _refuse_unrun_results(results, info.source, generators=True)
    return results


#: Specs the threaded world handed to the process world this session (worker-local; the plugin reports them).
JUDGED_ON_PROCESSES: list[str] = []


def _judge_on_processes(
    info: SpecInfo, case: Case, request: RunRequest, shared: list[str], threaded: BaseException | None
) -> list[Any]:
    """A threaded run that shared what processes would not (contract E14): the process world's verdict counts.

    The threaded verdict, pass or fail, is not trusted where rank threads shared state: a rank's patch of a
    module, a module global holding a rank's group, torch's generator used by name. The same request runs on
    the process world; its failure is raised with the threaded one as a note, its pass passes the test, and
    either way the test is named in the session summary so that it can be marked ``worlds=["process"]``."""
    from dstest.worlds import get_world

    process = get_world("process")
    first = str(threaded).splitlines()[0] if threaded is not None else "passed"
    why = "; ".join(shared)
    entry = f"{why} (threaded: {first[:200]})"
    reason = process.unavailable_reason(case.world_size)
    if reason is not None:
        if threaded is not None:
            threaded.add_note(f"dstest: rank threads shared state ({why}); the process world could not judge: {reason}")
            raise threaded
        raise RankFailure(
            f"the threaded run passed, but rank threads shared state ({why}), and the process world could not "
            f'judge it: {reason}. Mark the spec worlds=["process"] where processes are available.',
            {},
        )
    JUDGED_ON_PROCESSES.append(entry)
    try:
        results = process.run(request)
    except RankFailure as failure:
        failure.add_note(
            f"dstest: judged on the process world because rank threads shared state ({why}); "
            f"the threaded world's verdict: {first}"
        )
        raise
    _refuse_unrun_results(results, info.source, generators=True)
    return results
