"""Binding the system under test onto each rank: the spec layer's half of "worlds know nothing of targets".

:class:`TargetBinding` travels as a run request's ``setup`` (:class:`dstest.worlds.request.RunRequest`) and, on
the rank, applies the target's environment and attaches ``ctx.target``. Before the first run, in the caller's
thread, :meth:`TargetBinding.prepare` runs the target's ``prepare(device)`` once per process: what a target
must build before its ranks can run (native ops JIT-compiled on first use: minutes on a fresh machine) is
built there, outside every run's timeout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dstest.errors import InvalidArgument
from dstest.registry import check_target, world_marker

__all__ = ["DEFAULT_TARGET", "TargetBinding", "forget_prepared", "prepares", "world_device"]

#: The target a run binds when none is named.
DEFAULT_TARGET = "impl"

# (target name, device) -> None once its prepare ran, or the exception it raised (raised again, not retried:
# a failed build would otherwise be retried, for minutes, before every run).
_PREPARED: dict[tuple[str, str], BaseException | None] = {}
_PREPARE_LOCK = threading.Lock()


def forget_prepared(name: str) -> None:
    """Run target ``name``'s ``prepare`` again before its next run in this process (tests; a rebuilt cache)."""
    with _PREPARE_LOCK:
        for key in [k for k in _PREPARED if k[0] == name]:
            del _PREPARED[key]


def prepares(target: str, body: Callable[..., Any] | None) -> bool:
    """Whether a run of ``body`` binding ``target`` runs the target's ``prepare`` first: a run of the bundled
    conformance specs (``dstest --target X``: every spec there uses ``ctx.target``), or a run naming a target
    other than the default, impl (DeepSpeed, a plug-in's). A user's own spec on the default target does not:
    most never touch ``ctx.target``, and should not pay for impl's native build (or need a compiler for it);
    impl builds its ops on first use there."""
    module = str(getattr(body, "__module__", None) or "")
    return target != DEFAULT_TARGET or module == "dstest.conformance" or module.startswith("dstest.conformance.")


def world_device(world: str) -> str:
    """The device a world's ranks compute on, as a target's hooks name it: 'cuda' for GPU worlds, else 'cpu'."""
    return "cuda" if world_marker(world) == "gpu" else "cpu"


class TargetBinding:
    """Binds the system under test onto a rank's context: ``binding(ctx)`` on every rank, before the body.

    It applies the target's environment (``environment(device)`` on the target's class, e.g. DeepSpeed's
    ``DS_ACCELERATOR=cpu``) to the rank's process and makes ``ctx.target`` the target's adapter, made on
    first use. The factory is looked up where the binding is made (the caller's thread: importing a target
    inside rank threads would spend the world's timeout). Picklable: built-in targets and entry-point
    plug-ins travel by name (a worker process finds them itself); a target registered by a hook or
    :func:`dstest.registry.register_target` travels with its factory, pickled by reference (so it must be
    importable by module name where the rank runs).
    """

    __slots__ = ("_factory", "name")

    def __init__(self, name: str, factory: Callable[[], Any] | None = None) -> None:
        from dstest.registry import target_factory

        self.name = check_target(name)
        self._factory = factory if factory is not None else target_factory(name)

    def factory(self) -> Callable[[], Any]:
        """What makes the target's adapter (usually its class)."""
        return self._factory

    def environment(self, device: str) -> Mapping[str, str]:
        """The variables the target asks for on ``device`` ('cpu', 'cuda'), checked to be str -> str."""
        hook = getattr(self._factory, "environment", None)
        if hook is None:
            return {}
        env = hook(device)
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidArgument(
                f"target {self.name!r}: environment({device!r}) returned {env!r}; it must return a mapping of "
                "str names to str values (e.g. {'DS_ACCELERATOR': 'cpu'})"
            )
        return env

    def prepare(self, device: str) -> None:
        """Run the target's ``prepare(device)`` (on its class, like ``environment``) once per process and
        device, here in the caller's thread, before a run starts its timeout. A target builds there what its
        ranks would otherwise build inside the first run's timeout (DeepSpeed's shm_comm op, impl's native
        ops) and says on stderr what it builds. An exception it raises is raised again at every later call
        (each run fails with it) without running it again."""
        hook = getattr(self._factory, "prepare", None)
        if hook is None:
            return
        key = (self.name, device)
        with _PREPARE_LOCK:
            if key not in _PREPARED:
                try:
                    hook(device)
                    _PREPARED[key] = None
                except Exception as exc:
                    _PREPARED[key] = exc
            failed = _PREPARED[key]
        if failed is not None:
            raise failed

    def __call__(self, ctx: Any) -> None:
        device = getattr(ctx.device, "type", str(ctx.device))  # a plug-in world may give a str
        for key, value in self.environment(device).items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        ctx.bind_target(self.name, self._factory)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TargetBinding) and (other.name, other._factory) == (self.name, self._factory)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"TargetBinding({self.name!r})"

    def __reduce__(self) -> tuple[Callable[..., TargetBinding], tuple[Any, ...]]:
        from dstest.registry import BUILTIN_TARGETS, is_entry_point_target

        if self.name in BUILTIN_TARGETS or is_entry_point_target(self.name):
            return (TargetBinding, (self.name,))
        return (_binding_with_factory, (self.name, self._factory))


def _binding_with_factory(name: str, factory: Callable[[], Any]) -> TargetBinding:
    """A :class:`TargetBinding` unpickled where ``name`` may not be registered yet (a process-world worker)."""
    from dstest.registry import register_target

    register_target(name, factory, replace=True)
    return TargetBinding(name, factory)
