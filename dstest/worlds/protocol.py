"""The interface every world implements, and the argument checks every entry point shares.

The checks here are the single source of what dstest accepts as a timeout, a world size, a seed and a rank
function; :class:`dstest.worlds.request.RunRequest` (what every ``World.run`` takes), ``@dstest.spec``, the
``--dstest-*`` options and the ``dstest`` CLI call them (target and world names are checked by
:mod:`dstest.registry`). They import neither torch nor the worlds,
so the pytest plugin can use them at configure time. Each raises :class:`dstest.errors.InvalidArgument`
(or :class:`~dstest.errors.InvalidWorldSize`) with a message naming the argument, the value received and
what is allowed (docs/contracts.md, "clear error").
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dstest.errors import InvalidArgument, InvalidSpec, InvalidWorldSize

if TYPE_CHECKING:
    from dstest.worlds.request import RunRequest

__all__ = [
    "MAX_TIMEOUT_S",
    "NO_CAPABILITIES",
    "RANK_FN_ATTR",
    "Capabilities",
    "World",
    "capabilities_of",
    "check_rank_function",
    "check_seed",
    "check_timeout",
    "check_world_size",
    "parse_timeout",
    "parse_world_sizes",
    "rank_function_of",
]

#: The longest timeout dstest accepts, in seconds (one day). A world that needs longer is a mistake, and
#: far larger values (1e12) overflow ``threading`` waits and ``datetime.timedelta`` inside the worlds.
MAX_TIMEOUT_S = 86_400.0

#: An object a world finds by reference (module and qualified name) may name, in this attribute, the function
#: the world calls instead of the object itself: ``@dstest.spec`` wrappers name their rank adapter. Worlds
#: resolve specs through it without importing the spec layer.
RANK_FN_ATTR = "__dstest_rank_fn__"


def rank_function_of(obj: Any) -> Any:
    """What a world calls for ``obj`` found by reference: its :data:`RANK_FN_ATTR` if it has one, else ``obj``."""
    found = vars(obj).get(RANK_FN_ATTR) if hasattr(obj, "__dict__") else None
    return obj if found is None else found


def _kind(value: object) -> str:
    return type(value).__name__


def check_timeout(value: object, name: str = "timeout") -> float:
    """``value`` as a float number of seconds: a real number, finite, > 0 and <= :data:`MAX_TIMEOUT_S`.

    Booleans and strings (even ``"10"``) are refused; ``name`` is the argument the message names.
    """
    if (type(value) is float or type(value) is int) and 0 < value <= MAX_TIMEOUT_S:  # without the ABC check
        return float(value)
    allowed = f"allowed: a finite number of seconds, > 0 and <= {MAX_TIMEOUT_S:g} (e.g. 60)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name}={value!r}: a {_kind(value)} is not a number of seconds; {allowed}")
    seconds = float(value)
    if math.isnan(seconds):
        raise InvalidArgument(f"{name}={value!r}: NaN is not a number of seconds; {allowed}")
    if seconds <= 0:
        raise InvalidArgument(f"{name}={value!r}: must be > 0 seconds; {allowed}")
    if seconds > MAX_TIMEOUT_S:
        raise InvalidArgument(f"{name}={value!r}: more than the maximum of {MAX_TIMEOUT_S:g} s (one day); {allowed}")
    return seconds


def parse_world_sizes(text: str, option: str) -> tuple[int, ...]:
    """A command-line list of world sizes (``"1,2,3"``): ints >= 1, each once; ``option`` is named in errors."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise InvalidArgument(f"{option}={text!r}: give comma-separated ints >= 1, e.g. 1,2,3")
    if len(set(sizes)) != len(sizes):
        raise InvalidArgument(f"{option}={text!r}: give each size once, e.g. 1,2,3")
    return sizes


def parse_timeout(text: str, option: str) -> float:
    """A command-line timeout: seconds per world run, checked as :func:`check_timeout` checks it."""
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidArgument(
            f"{option}={text!r}: give seconds per world run, > 0 and <= {MAX_TIMEOUT_S:g} (e.g. 60)"
        ) from None
    try:
        return check_timeout(seconds)
    except InvalidArgument as exc:
        detail = str(exc).removeprefix(f"timeout={seconds!r}").lstrip(" :")
        raise InvalidArgument(f"{option}={text!r}: {detail}") from None


def check_world_size(value: object, name: str = "world_size") -> int:
    """``value`` as an int >= 1 (booleans and floats such as 2.0 or 2.5 are refused)."""
    if type(value) is int and value >= 1:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidWorldSize(f"{name}={value!r} must be an int >= 1, got a {_kind(value)}")
    if value < 1:
        raise InvalidWorldSize(f"{name}={value!r} must be an int >= 1")
    return int(value)


def check_seed(value: object, name: str = "seed") -> int:
    """``value`` as an int >= 0 (numpy's generators, ``ctx.numpy_rng()``, refuse negative seeds)."""
    if type(value) is int and value >= 0:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name}={value!r}: must be an int >= 0 (e.g. 0), got a {_kind(value)}")
    if value < 0:
        raise InvalidArgument(f"{name}={value!r}: must be an int >= 0 (e.g. 0)")
    return int(value)


def check_rank_function(fn: object, name: str = "fn") -> None:
    """Refuse what cannot be a rank body: non-callables, generator functions and ``async def`` functions.

    Calling a generator or coroutine function only creates a generator or coroutine; none of its body
    would run, and the run would pass without having tested anything.
    """
    if not callable(fn):
        raise InvalidArgument(f"{name}={fn!r} ({_kind(fn)}): must be a function taking the rank context")
    what = None
    if inspect.isasyncgenfunction(fn):
        what = "an async generator function (async def with yield)"
    elif inspect.iscoroutinefunction(fn):
        what = "a coroutine function (async def)"
    elif inspect.isgeneratorfunction(fn):
        what = "a generator function (it contains yield)"
    if what is not None:
        label = getattr(fn, "__qualname__", None) or repr(fn)
        shown = f"{name}={label}" if name.isidentifier() else f"{name} {label}"
        raise InvalidSpec(
            f"{shown} is {what}: calling it would not run its body, so the run would pass "
            "without testing anything; dstest runs plain functions only (run any async code with "
            "asyncio.run inside the body, and do not yield)"
        )


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a world can do beyond running ranks, as it declares it (``World.capabilities``).

    ``faults``: inject ``Kill``, ``Fail`` and ``Delay`` (:mod:`dstest.faults`, contract G5); ``hazards``:
    poison the outputs of async collectives until their wait (``async_hazards``); ``module_watch``: put back
    and report the module-level state a run changed (``watch_modules``); ``strict_shapes``: refuse buffers
    that differ between ranks only in shape. A run that asks for what its world does not declare is refused
    before any rank starts (:meth:`refuse`), and a session-wide option (``--dstest-async-hazards``,
    ``--dstest-strict-shapes``) applies only to the worlds that declare it.
    """

    faults: bool = False
    hazards: bool = False
    module_watch: bool = False
    strict_shapes: bool = False

    def refuse(self, request: RunRequest, world: str) -> None:
        """Raise :class:`InvalidArgument` naming the setting, its value and the world when ``request`` asks for
        what world ``world`` does not declare."""
        if request.faults and not self.faults:
            raise InvalidArgument(
                f"faults={list(request.faults)!r}: the {world} world cannot inject faults; faults run on "
                "world='threaded' and world='process' (gloo)"
            )
        if request.watch_modules and not self.module_watch:
            raise InvalidArgument(
                f"watch_modules={request.watch_modules!r}: the {world} world does not watch module state (rank "
                "threads share one process's modules; launched ranks are not dstest's workers); the watch "
                "runs on world='process'"
            )
        if request.async_hazards and not self.hazards:
            raise InvalidArgument(
                f"async_hazards=True: the {world} world cannot poison unwaited outputs (the fake world moves no "
                "data, gloo and NCCL write outputs themselves); the threaded worlds can"
            )
        if request.strict_shapes and not self.strict_shapes:
            raise InvalidArgument(
                f"strict_shapes=True: the {world} world does not compare the shapes of the ranks' buffers; the "
                "threaded world and world='process' (gloo) do"
            )


#: What a world that declares nothing can do: run ranks, nothing more.
NO_CAPABILITIES = Capabilities()


def capabilities_of(world: object) -> Capabilities:
    """What ``world`` declares it can do (:data:`NO_CAPABILITIES` for a plug-in world that declares nothing)."""
    declared = getattr(world, "capabilities", None)
    if declared is None:
        return NO_CAPABILITIES
    if not isinstance(declared, Capabilities):
        raise InvalidArgument(
            f"world {getattr(world, 'name', world)!r}: capabilities={declared!r} must be a dstest.Capabilities "
            "(e.g. dstest.Capabilities(faults=True))"
        )
    return declared


@runtime_checkable
class World(Protocol):
    """Runs ``fn(ctx, *args, **kwargs)`` on the ranks of a (simulated or real) process group.

    ``run`` returns per-rank results in rank order, or raises one error that carries every failing
    rank's traceback (:class:`dstest.errors.RankFailure`) or every rank's stack
    (:class:`dstest.errors.WorldTimeout`). Nothing it started outlives the call.

    A world knows nothing of systems under test: the request's ``setup`` binds ``ctx.target`` on each
    rank before the function (:meth:`RunRequest.rank_call`). A world that runs ranks in other processes
    sends the function there by reference or by pickle (it may be a picklable callable object, not only a
    module-level function) and the setup by pickle. Plug-in worlds are registered through
    :mod:`dstest.registry`.

    A world declares what it can do beyond running ranks (:attr:`capabilities`) and lets go of what it keeps
    between runs in :meth:`close` (warm rank threads, worker pools): :func:`dstest.worlds.get_world` hands out
    one open world per name, and :func:`dstest.worlds.lifecycle.close_all` closes every open world when the
    test session ends and at exit. A plug-in world without ``capabilities`` can do nothing more than run
    ranks; one without ``close`` keeps nothing.
    """

    name: str

    @property
    def marker(self) -> str:
        """'cpu' or 'gpu': the pytest marker of items that run in this world."""
        ...

    def unavailable_reason(self, world_size: int) -> str | None:
        """Why this world cannot run ``world_size`` ranks here (a skip reason), or None."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this world can do beyond running ranks; a request asking for more is refused."""
        ...

    def run(self, request: RunRequest) -> list[Any]:
        """Run ``request`` (:class:`dstest.worlds.request.RunRequest`, checked when made) on its ranks."""
        ...

    def close(self) -> None:
        """Stop what this world keeps between runs; it may run again afterwards (it starts afresh)."""
        ...
