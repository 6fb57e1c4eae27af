"""Reusable fixtures: thin, documented wrappers over public functions, for projects that prefer no decorator.

Registered by the plugin; every fixture is also importable behaviour (``dstest.run``, ``dstest.get_world``,
``dstest.shards``, ``dstest.groups``) for code outside pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["dstest_run", "dstest_settings", "dstest_shards", "dstest_topologies", "dstest_world"]

#: Where the plugin keeps the run's :class:`dstest.specification.Settings` (set at configure time). Here,
#: not in the plugin, so that the plugin imports this module and not the other way round.
SETTINGS_KEY = pytest.StashKey[Any]()

#: The keywords ``dstest_run`` passes on to :func:`dstest.run`.
_RUN_OPTIONS = frozenset({"world", "args", "kwargs", "timeout", "seed", "target"})


@pytest.fixture
def dstest_settings(request: pytest.FixtureRequest) -> Any:
    """The ``--dstest-*`` settings (timeout, target, seed) as a :class:`dstest.specification.Settings`."""
    return request.config.stash[SETTINGS_KEY]


@pytest.fixture
def dstest_run(dstest_settings: Any) -> Callable[..., list[Any]]:
    """``dstest_run(fn, world_size=3, world="threaded")`` -> per-rank results of ``fn(ctx)``.

    Same as :func:`dstest.run` (and checked as strictly), with the timeout, target and seed of the command
    line as defaults.
    """
    from dstest.errors import InvalidArgument
    from dstest.specification import run

    def runner(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> list[Any]:
        unknown = sorted(set(kwargs) - _RUN_OPTIONS)
        if unknown:
            raise InvalidArgument(
                f"dstest_run(..., {', '.join(f'{k}=' for k in unknown)}): unknown keyword(s) {unknown}; "
                f"allowed: {sorted(_RUN_OPTIONS)}"
            )
        kwargs.setdefault("timeout", dstest_settings.timeout)
        kwargs.setdefault("target", dstest_settings.target)
        kwargs.setdefault("seed", dstest_settings.seed)
        return run(fn, world_size, **kwargs)

    return runner


@pytest.fixture
def dstest_world() -> Callable[[str], Any]:
    """A world factory: ``dstest_world("threaded").run(dstest.RunRequest(fn, 4))`` (see :func:`dstest.get_world`).

    A world runs a :class:`dstest.RunRequest`, which checks its arguments when it is made; unknown world
    names raise :class:`dstest.InvalidArgument`. ``dstest_run`` is the shorter way for most tests.
    """
    from dstest.worlds import get_world

    return get_world


@pytest.fixture
def dstest_topologies() -> tuple[str, ...]:
    """The group topologies every optional-group call site must handle: absent, single, non_member, multi.

    Build one inside a rank with ``ctx.groups.build(kind)`` (:class:`dstest.groups.GroupBuilder`).
    """
    from dstest.groups import TOPOLOGIES

    return TOPOLOGIES


@pytest.fixture
def dstest_shards() -> Any:
    """The shard-layout module: ``dstest_shards.padded(n, w)`` and ``dstest_shards.uneven(counts)``."""
    from dstest import shards

    return shards
