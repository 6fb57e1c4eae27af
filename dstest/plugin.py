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


def _usage(option: str, value: object, exc: Exception, shown: str) -> pytest.UsageError:
    """An option error in pytest's usage-error form, naming the option, the value and what is allowed.

    The shared checks start their message with the Python argument (``shown``, e.g. ``timeout=nan``); on
    the command line the option and the text given are named instead.
    """
    detail = str(exc).removeprefix(shown).lstrip(" :")
    return pytest.UsageError(f"{option}={value!r}: {detail}")


def _parse_worlds(value: str) -> tuple[str, ...]:
    from dstest.worlds import WORLD_NAMES  # light: no torch import

    names = tuple(w.strip() for w in value.split(",") if w.strip())
    unknown = [w for w in names if w not in WORLD_NAMES]
    if not names or unknown:
        raise pytest.UsageError(
            f"{OPT_WORLDS}={value!r}: unknown world(s) {unknown or '(none given)'}; "
            f"use a comma-separated list of {', '.join(WORLD_NAMES)}"
        )
    repeated = sorted({w for w in names if names.count(w) > 1})
    if repeated:
        raise pytest.UsageError(f"{OPT_WORLDS}={value!r}: lists {repeated} more than once; give each world once")
    return names


def _parse_timeout(value: str) -> float:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import MAX_TIMEOUT_S, check_timeout  # light: no torch import

    try:
        seconds = float(value)
    except ValueError:
        raise pytest.UsageError(
            f"{OPT_TIMEOUT}={value!r}: give the per-world timeout in seconds, > 0 and <= {MAX_TIMEOUT_S:g} (e.g. 60)"
        ) from None
    try:
        return check_timeout(seconds)
    except InvalidArgument as exc:
        raise _usage(OPT_TIMEOUT, value, exc, f"timeout={seconds!r}") from None


def _parse_target(value: str) -> str:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import check_target  # light: no torch import

    try:
        return check_target(value)
    except InvalidArgument as exc:
        raise _usage(OPT_TARGET, value, exc, f"target={value!r}") from None


def _parse_seed(value: str) -> int:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import check_seed

    try:
        return check_seed(int(value))
    except (ValueError, InvalidArgument):
        raise pytest.UsageError(f"{OPT_SEED}={value!r}: give an integer seed >= 0 (e.g. 0)") from None


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
    group.addoption(
        OPT_TIMEOUT,
        type=_parse_timeout,
        default=60.0,
        help="seconds before a world is failed with every rank's stack: > 0, at most 86400 (default 60)",
    )
    group.addoption(
        OPT_TARGET,
        type=_parse_target,
        default="impl",
        help="system under test for the bundled specs: impl (default) or deepspeed",
    )
    group.addoption(
        OPT_SEED, type=_parse_seed, default=0, help="base seed of every rank's generator, an int >= 0 (default 0)"
    )
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
    from dstest.errors import InvalidArgument
    from dstest.specification import Settings

    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "dstest.fixtures")
    # Option values set without the parsers (a conftest's config.option, pytest.main's plugins) are
    # checked here too: every setting reaches the worlds checked.
    values = {
        "timeout": (OPT_TIMEOUT, config.getoption(OPT_TIMEOUT)),
        "target": (OPT_TARGET, config.getoption(OPT_TARGET)),
        "seed": (OPT_SEED, config.getoption(OPT_SEED)),
    }
    try:
        config.stash[_settings_key] = Settings(**{key: value for key, (_, value) in values.items()})
    except InvalidArgument as exc:
        key = str(exc).partition("=")[0]
        option, value = values.get(key, (key, None))
        raise _usage(option, value, exc, f"{key}={value!r}") from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from dstest.specification import CASE_ARG, Case, spec_info
    from dstest.worlds import DEFAULT_WORLDS, WORLD_MARKERS

    info = spec_info(metafunc.function)
    if info is None:
        return
    _check_placement(metafunc, info)
    worlds = metafunc.config.getoption(OPT_WORLDS) or info.worlds or DEFAULT_WORLDS
    params = [
        pytest.param(case, id=case.id, marks=[getattr(pytest.mark, WORLD_MARKERS[case.world])])
        for case in (Case(world=w, world_size=ws) for w in worlds for ws in info.world_sizes)
    ]
    metafunc.parametrize(CASE_ARG, params)


def _check_placement(metafunc: pytest.Metafunc, info: Any) -> None:
    """A spec in a test class must be a method taking ``self`` first (or a staticmethod)."""
    import inspect

    from dstest.errors import InvalidSpec

    if metafunc.cls is None or info.method:
        return
    name = metafunc.function.__name__
    if isinstance(inspect.getattr_static(metafunc.cls, name, None), staticmethod):
        return
    body = info.source
    first = next(iter(inspect.signature(body).parameters), "ctx")
    error = InvalidSpec(
        f"spec {metafunc.cls.__name__}.{name} is a method of a test class, but its first parameter is "
        f"{first!r}, not self: write def {name}(self, ctx, ...) (self is the instance pytest makes, ctx the "
        "rank context), or make it a @staticmethod"
    )
    # A collection error that shows only this message (pytest's own frames would bury it).
    pytest.fail(f"{type(error).__name__}: {error}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A skip inside a spec body is reported at the body's line, not inside dstest (``-rs``)."""
    report = yield
    excinfo = call.excinfo
    location = getattr(excinfo.value, "dstest_location", None) if excinfo is not None else None
    if location is not None and report.skipped and isinstance(report.longrepr, tuple):
        path, lineno = location
        report.longrepr = (str(path), int(lineno), report.longrepr[2])
    return report


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
