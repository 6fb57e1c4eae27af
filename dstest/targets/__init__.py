"""Systems under test. ``get_target(name)`` returns a :class:`~dstest.targets.base.Target` adapter."""

from __future__ import annotations

import importlib

from dstest.errors import InvalidArgument
from dstest.targets.base import FEATURES, Target, TrainingEngine, require

__all__ = ["FEATURES", "TARGET_NAMES", "Target", "TrainingEngine", "get_target", "require"]

# name -> (module, class); adapters are imported on first use (a third-party target may not be installed).
_TARGETS: dict[str, tuple[str, str]] = {
    "impl": ("dstest.targets.impl", "ImplTarget"),
    "deepspeed": ("dstest.targets.deepspeed", "DeepSpeedTarget"),
}
TARGET_NAMES = tuple(_TARGETS)


def get_target(name: str) -> Target:
    """The adapter for target ``name`` (a new object per call; adapters hold no state between runs)."""
    try:
        module, attr = _TARGETS[name]
    except KeyError:
        raise InvalidArgument(f"target={name!r} is unknown; allowed: {list(_TARGETS)}") from None
    target: Target = getattr(importlib.import_module(module), attr)()
    return target
