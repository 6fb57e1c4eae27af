"""What is installed for rank threads right now: the hosting world's hooks and the saved torch originals.

Every other module of this package reads these two records: the wrappers (:mod:`.wrappers`,
:mod:`.threads`, :mod:`.rank_hooks`) to find the original they stand in for and the hooks the hosting
world set, :mod:`.install` to count the worlds using the switches and undo them when the last one ends.
Kept apart from :mod:`.install` so that a wrapper can read them without importing what installs it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dstest.worlds.torch_internals.c10d_world import ThreadLocalWorld

__all__ = ["HOOKS", "INSTALL"]


class _Hooks:
    """What the hosting world adds while rank threads are installed (set by the first installer)."""

    def __init__(self) -> None:
        self.capture: Callable[[], Callable[[], Any] | None] | None = None
        self.translate: Callable[[Any], Any] | None = None
        self.own_backend: str | None = None


HOOKS = _Hooks()


class _Installation:
    """Process-wide switches that rank threads need, reference-counted and undone when the last world ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.world: ThreadLocalWorld | None = None
        self.saved: dict[str, Any] = {}


INSTALL = _Installation()
