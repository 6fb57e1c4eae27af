"""One world run, asked for in one object: :class:`RunRequest`.

Everything a world needs to run a function on its ranks travels here, and only here: the function and its
arguments, the world size, the timeout, the seed, the per-rank setup (the spec layer's binding of the system
under test), the run options (async hazards, strict shapes) and the recorder of the run's collectives. The
request is checked once, when it is made (each check names the argument, the value and what is allowed), so a
world never re-validates it and never looks anywhere else (no thread-local options, no hidden keyword
arguments). Every default of a run is defined here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dstest.errors import InvalidArgument
from dstest.worlds.core.faults import check_faults
from dstest.worlds.protocol import check_rank_function, check_seed, check_timeout, check_world_size

__all__ = ["DEFAULT_SEED", "DEFAULT_TIMEOUT", "RunRequest"]

#: Seconds a world run may take before it fails with every rank's stack (``--dstest-timeout``, ``timeout=``).
DEFAULT_TIMEOUT = 60.0
#: The seed of every rank's generators when none is given (``--dstest-seed``, ``seed=``).
DEFAULT_SEED = 0


def _module_prefixes(value: object) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    ok = isinstance(names, tuple | list) and all(
        isinstance(n, str) and n and all(part.isidentifier() for part in n.split(".")) for n in names
    )
    if not ok:
        raise InvalidArgument(
            f"watch_modules={value!r}: give module names or prefixes as a tuple of str (e.g. ('deepspeed',))"
        )
    return tuple(names)  # type: ignore[arg-type]


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r}: must be True or False, got a {type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class RunRequest:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks: what :meth:`dstest.worlds.protocol.World.run` takes.

    ``setup``, when given, is called as ``setup(ctx)`` on every rank before ``fn`` (a world that runs ranks in
    other processes pickles it). ``async_hazards`` poisons outputs of async collectives read before their wait
    (worlds that can); ``strict_shapes`` makes buffers that differ only in shape a mismatch. ``recorder`` is
    the :class:`dstest.trace.Recorder` the run writes its collectives into; None gives the run a
    fresh one. ``watch_modules`` (module names or prefixes, e.g. ``("deepspeed",)``): in the process world,
    what a run changes in their module-level state is put back after it and reported as
    :class:`~dstest.errors.StateLeftBehind` (:mod:`dstest.worlds.process.state_watch`); a world that does not
    declare it refuses it (:class:`~dstest.worlds.protocol.Capabilities`). ``faults``: :mod:`dstest.faults` to inject (``Kill``,
    ``Fail``, ``Delay``; threaded and process worlds; contract G5). Made once, checked once: a bad value raises
    :class:`~dstest.errors.InvalidArgument` naming it.
    """

    fn: Callable[..., Any]
    world_size: int
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT
    seed: int = DEFAULT_SEED
    setup: Callable[[Any], None] | None = None
    async_hazards: bool = False
    strict_shapes: bool = False
    recorder: Any = None
    watch_modules: tuple[str, ...] = ()
    faults: Sequence[Any] = ()

    def __post_init__(self) -> None:
        check_rank_function(self.fn)
        put = object.__setattr__
        put(self, "world_size", check_world_size(self.world_size))
        put(self, "timeout", check_timeout(self.timeout))
        put(self, "seed", check_seed(self.seed))
        args, kwargs = self.args, self.kwargs
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise InvalidArgument(f"args={args!r} ({type(args).__name__}): must be a tuple or list of positional arguments")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise InvalidArgument(f"kwargs={kwargs!r}: must be a dict with str keys, or None")
        put(self, "args", tuple(args))
        put(self, "kwargs", MappingProxyType(dict(kwargs)))
        if self.setup is not None and not callable(self.setup):
            raise InvalidArgument(f"setup={self.setup!r}: must be callable as setup(ctx), or None")
        _bool(self.async_hazards, "async_hazards")
        _bool(self.strict_shapes, "strict_shapes")
        put(self, "watch_modules", _module_prefixes(self.watch_modules))
        if self.recorder is not None and not hasattr(self.recorder, "view"):
            raise InvalidArgument(f"recorder={self.recorder!r}: must be a dstest.trace Recorder, or None")
        put(self, "faults", check_faults(self.faults, self.world_size))

    def call_kwargs(self) -> dict[str, Any]:
        """The keyword arguments as a fresh dict (each rank gets its own)."""
        return dict(self.kwargs)

    def rank_call(self, ctx: Any) -> Any:
        """What one rank runs: ``setup(ctx)`` if any, then ``fn(ctx, *args, **kwargs)``."""
        if self.setup is not None:
            self.setup(ctx)
        return self.fn(ctx, *self.args, **self.kwargs)

    def replace(self, **changes: Any) -> RunRequest:
        """This request with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        """The function's qualified name, as reports show it."""
        return str(getattr(self.fn, "__qualname__", None) or getattr(self.fn, "__name__", None) or repr(self.fn))
