"""Systems under test. ``get_target(name)`` returns a :class:`~dstest.targets.base.Target` adapter.

dstest ships ``impl`` and ``deepspeed``; plug-ins add more (a pytest hook, an entry point in the group
``dstest.targets`` or :func:`register_target`, see :mod:`dstest.registry`). An adapter may also define
``environment(device: str) -> Mapping[str, str]``: variables set in each rank's process before the spec
body runs (DeepSpeed: ``DS_ACCELERATOR=cpu`` on CPU), and ``prepare(device: str) -> None``: what its ranks
need built (native ops JIT-compiled on first use), run once per process before the first run's timeout
starts (DeepSpeed: its shm_comm op; impl: its native ops). Worlds know nothing of targets; the spec layer
binds ``ctx.target`` and applies the environment on every rank (:class:`dstest.binding.TargetBinding`).
"""

from __future__ import annotations

from dstest.registry import BUILTIN_TARGETS, register_target, target_factory, target_names
from dstest.targets.base import FEATURES, Target, TrainingEngine, require

__all__ = [
    "FEATURES",
    "TARGET_NAMES",
    "Target",
    "TrainingEngine",
    "get_target",
    "register_target",
    "require",
    "target_names",
]

#: The built-in target names (plug-ins: :func:`target_names`).
TARGET_NAMES = tuple(BUILTIN_TARGETS)


def get_target(name: str) -> Target:
    """The adapter for target ``name`` (a new object per call; adapters hold no state between runs)."""
    target: Target = target_factory(name)()
    return target
