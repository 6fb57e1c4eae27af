"""The spec body as the ranks call it: whether it is a method of a test class, the ``self`` carried to the
ranks (:class:`SpecSelf`), the adapter the worlds call, the check of its parameters, and the refusal of a body
that returned without running (a generator or coroutine)."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from dstest.errors import InvalidArgument, InvalidSpec
from dstest.specification.info import CASE_ARG, INSTANCE_ARG, SETTINGS_ARG

__all__ = [
    "SpecSelf",
    "check_body_parameters",
    "defined_in_class",
    "rank_adapter",
    "refuse_unrun_results",
    "signature_names",
]


def defined_in_class(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was written in a class body (``Cls.meth``, not ``outer.<locals>.inner``)."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


def signature_names(fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


class SpecSelf:
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

    def __reduce__(self) -> tuple[Callable[[bytes], SpecSelf], tuple[bytes]]:
        try:
            blob = pickle.dumps(self._obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise InvalidArgument(
                f"self={self._obj!r}: the process world sends a spec method's test-class instance to its "
                f"workers, and this one does not pickle ({type(exc).__name__}: {exc}); keep only picklable "
                "attributes on self, or make the spec a module-level function"
            ) from exc
        return (_instance_from_blob, (blob,))


def _instance_from_blob(blob: bytes) -> SpecSelf:
    holder = SpecSelf(None)
    holder._blob = blob
    return holder


def rank_adapter(body: Callable[..., Any], method: bool) -> Callable[..., Any]:
    """``fn(ctx, **params)`` for the worlds: calls ``body(ctx, **params)``.

    For a method of a test class it calls ``body(self, ctx, **params)``. ``self`` travels in the params
    (:data:`~dstest.specification.info.INSTANCE_ARG`), so the adapter survives worlds that send
    functions by reference: it takes the body's module and qualified name, and the process world finds it
    through the spec wrapper, whose :class:`~dstest.specification.info.SpecInfo` holds it.
    """

    def call(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if not method:
            return body(ctx, *args, **kwargs)
        holder = kwargs.pop(INSTANCE_ARG, None)
        if not isinstance(holder, SpecSelf):
            raise InvalidSpec(
                f"{body.__qualname__} is a method of a test class: run it through pytest (which makes self), "
                "not with dstest.run"
            )
        return body(holder.get(), ctx, *args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(call, attr, getattr(body, attr))
    return call


def check_body_parameters(fn: Callable[..., Any], method: bool) -> list[inspect.Parameter]:
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


def refuse_unrun_results(results: Sequence[Any], fn: Callable[..., Any], *, generators: bool) -> None:
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
