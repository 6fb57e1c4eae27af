"""Hooks a pytest plugin or ``conftest.py`` implements to add targets and worlds to dstest.

.. code-block:: python

    # conftest.py (or a plugin module registered under the ``pytest11`` entry point)
    def pytest_dstest_targets():
        return {"mytarget": MyTarget}        # a factory: called with no arguments, returns the adapter

    def pytest_dstest_worlds():
        return {"myworld": MyWorld}          # returns a dstest.worlds.World

The dstest plugin calls every implementation at ``pytest_configure`` (implementations in the initial
conftests, plugins and ``-p`` modules are seen) and registers what they return in
:mod:`dstest.registry`, before it checks ``--dstest-target`` and ``--dstest-worlds``. Not firstresult:
each implementation contributes its own names; two that give one name different factories are an error.
(The names start with ``pytest_`` because pytest takes only such functions of a conftest as hooks.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

__all__ = ["pytest_dstest_targets", "pytest_dstest_worlds"]

hookspec = pluggy.HookspecMarker("pytest")


@hookspec
def pytest_dstest_targets() -> Mapping[str, Callable[[], Any]]:  # type: ignore[empty-body]
    """Systems under test this plugin adds: ``{name: factory}``, ``factory()`` -> a ``dstest.targets.Target``."""


@hookspec
def pytest_dstest_worlds() -> Mapping[str, Callable[[], Any]]:  # type: ignore[empty-body]
    """Worlds this plugin adds: ``{name: factory}``, ``factory()`` -> a ``dstest.worlds.World``."""
