"""The pytest plugin (entry point ``pytest11: dstest``): options, markers, spec expansion. Hooks only.

Imports only pytest and the standard library at import time, so it costs nothing in projects that do
not use it; torch is imported by the specs that run.
"""

from __future__ import annotations

from typing import Any

import pytest

OPT_WORLDS = "--dstest-worlds"
OPT_TIMEOUT = "--dstest-timeout"
OPT_TARGET = "--dstest-target"
OPT_SEED = "--dstest-seed"
OPT_MARK_UNMARKED = "--dstest-mark-unmarked"

_MARKERS = {
    "cpu": "runs on CPU only (simulated worlds, gloo processes). Provided by dstest.",
    "gpu": "needs CUDA GPUs (NCCL world, threaded world on CUDA); skipped with a reason when too few. Provided by dstest.",
    "soak": "long-running hardening runs, excluded from the default suite. Provided by dstest.",
}

_settings_key = pytest.StashKey[Any]()
_owns_pools_key = pytest.StashKey[bool]()
# Sessions configured in this process and not yet unconfigured: pytester's in-process runs nest a session
# inside the outer one, and only the outermost may stop the worlds' pools and crews.
_active_sessions: list[pytest.Config] = []


def _parse_worlds(value: str) -> tuple[str, ...]:
    from dstest.worlds import WORLD_NAMES  # light: no torch import

    names = tuple(w.strip() for w in value.split(",") if w.strip())
    unknown = [w for w in names if w not in WORLD_NAMES]
    if not names or unknown:
        raise pytest.UsageError(
            f"{OPT_WORLDS}={value!r}: unknown world(s) {unknown or '(none given)'}; "
            f"use a comma-separated list of {', '.join(WORLD_NAMES)}"
        )
    return names


def _parse_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise pytest.UsageError(f"{OPT_TIMEOUT}={value!r}: give the per-world timeout in seconds, > 0 (e.g. 60)")
    return seconds


def _parse_seed(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{OPT_SEED}={value!r}: give an integer seed (e.g. 0)") from None


def _parse_mark(value: str) -> str:
    if value not in ("cpu", "gpu"):
        raise pytest.UsageError(f"{OPT_MARK_UNMARKED}={value!r}: allowed values are 'cpu' and 'gpu'")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dstest", "dstest: distributed specs on simulated and real worlds")
    group.addoption(
        OPT_WORLDS,
        type=_parse_worlds,
        default=None,
        help="comma-separated worlds to expand every spec to (threaded, threaded-cuda, fake, process, nccl); "
        "default: each spec's own list, else threaded,nccl",
    )
    group.addoption(OPT_TIMEOUT, type=_parse_timeout, default=60.0, help="seconds before a world is failed with every rank's stack (default 60)")
    group.addoption(OPT_TARGET, default="impl", help="system under test for the bundled specs: impl (default) or deepspeed")
    group.addoption(OPT_SEED, type=_parse_seed, default=0, help="base seed of every rank's generator (default 0)")
    group.addoption(
        OPT_MARK_UNMARKED,
        type=_parse_mark,
        default=None,
        metavar="cpu|gpu",
        help="give tests that carry neither the cpu nor the gpu marker this one, so -m cpu keeps them",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_owns_pools_key] = not _active_sessions
    _active_sessions.append(config)
    for name, text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    from dstest import fixtures
    from dstest.specification import Settings

    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "dstest.fixtures")
    config.stash[_settings_key] = Settings(
        timeout=config.getoption(OPT_TIMEOUT),
        target=config.getoption(OPT_TARGET),
        seed=config.getoption(OPT_SEED),
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from dstest.specification import CASE_ARG, Case, spec_info
    from dstest.worlds import DEFAULT_WORLDS, WORLD_MARKERS

    info = spec_info(metafunc.function)
    if info is None:
        return
    worlds = metafunc.config.getoption(OPT_WORLDS) or info.worlds or DEFAULT_WORLDS
    params = [
        pytest.param(case, id=case.id, marks=[getattr(pytest.mark, WORLD_MARKERS[case.world])])
        for case in (Case(world=w, world_size=ws) for w in worlds for ws in info.world_sizes)
    ]
    metafunc.parametrize(CASE_ARG, params)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" not in (config.getoption("markexpr", "") or ""):
        soak = [item for item in items if item.get_closest_marker("soak") is not None]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [item for item in items if item.get_closest_marker("soak") is None]
    mark = config.getoption(OPT_MARK_UNMARKED)
    if mark is None:
        return
    for item in items:
        if item.get_closest_marker("cpu") is None and item.get_closest_marker("gpu") is None:
            item.add_marker(getattr(pytest.mark, mark))


def settings(config: pytest.Config) -> Any:
    """The run settings the options produced (used by the fixtures)."""
    return config.stash[_settings_key]


def pytest_unconfigure(config: pytest.Config) -> None:
    """No worker process or warm rank thread outlives the test session (E4)."""
    import sys

    if config in _active_sessions:
        _active_sessions.remove(config)
    if not config.stash.get(_owns_pools_key, True):
        return  # the outer session stops them; the atexit handlers cover everything else
    for module in ("dstest.worlds.process", "dstest.worlds.threaded"):
        shutdown = getattr(sys.modules.get(module), "shutdown_all", None)
        if shutdown is not None:
            shutdown()
