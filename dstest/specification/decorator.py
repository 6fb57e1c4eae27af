"""``@dstest.spec`` itself: its arguments checked, the body checked and wrapped, and the wrapper dressed as the
pytest test function the plugin parametrizes (one case per world and world size)."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dstest.errors import InvalidArgument, InvalidSpec, InvalidWorldSize
from dstest.specification.bodies import check_body_parameters, defined_in_class, rank_adapter, signature_names
from dstest.specification.info import (
    CASE_ARG,
    SETTINGS_ARG,
    SpecInfo,
    check_async_hazards,
    check_strict_shapes,
)
from dstest.specification.runs import run_spec
from dstest.worlds.core.faults import check_faults
from dstest.worlds.protocol import RANK_FN_ATTR, check_rank_function, check_timeout

__all__ = ["spec"]


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
        method = defined_in_class(fn) and next(iter(signature_names(fn)), None) == "self"
        rest = check_body_parameters(fn, method)
        info = SpecInfo(
            fn=rank_adapter(fn, method),
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
