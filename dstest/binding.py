"""Binding the system under test onto each rank: the spec layer's half of "worlds know nothing of targets".

:class:`TargetBinding` travels as a run request's ``setup`` (:class:`dstest.worlds.request.RunRequest`) and, on
the rank, applies the target's environment and attaches ``ctx.target``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from dstest.errors import InvalidArgument
from dstest.registry import check_target

__all__ = ["TargetBinding"]


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
