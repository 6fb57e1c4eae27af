"""The pytest plugin (entry point ``pytest11: dstest``): options, markers, spec expansion. Hooks only.

Imports only pytest and the standard library at import time, so it costs nothing in projects that do
not use it; torch is imported by the specs that run.

A good guest: in a session that collects no dstest spec and gives no dstest option, it changes nothing. It
deselects nothing (``soak`` items are left out only where the ini opts in with ``dstest_deselect_soak``, as
this repository's does), registers only the markers the project does not declare itself, and its warning
filter matches only dstest's own ``WorldAborted``. The one exception is by design: under a launcher (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) every session runs in lockstep, plain tests included
(:mod:`dstest.pytest.lockstep`).

Also: the hooks of :mod:`dstest.pytest.hookspecs` (plug-in targets and worlds, registered at configure time),
collection of the bundled conformance package (``pytest dstest/conformance`` collects every spec module, not
only ``test_*.py``), and deviations: a spec failure of a third-party target is marked as a deviation on
its report and shown as ``D`` / ``DEV`` with its own summary section (see :mod:`dstest.report`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from dstest.pytest.options import (  # light: no torch import
    INI_DESELECT_SOAK,
    OPT_ASYNC_HAZARDS,
    OPT_CROSSCHECK,
    OPT_FLIGHT_RECORDER,
    OPT_MARK_UNMARKED,
    OPT_SEED,
    OPT_STRICT_SHAPES,
    OPT_TARGET,
    OPT_THREADS_ALONE,
    OPT_TIMEOUT,
    OPT_TRACE,
    OPT_WORLD_SIZES,
    OPT_WORLDS,
    check_worlds,
    pytest_addoption,
    usage_error,
)

__all__ = ["pytest_addoption", "settings"]  # pytest_addoption: the options' hook, defined beside their parsers

# --dstest-html (the conformance report of a pytest run as one HTML page) and --dstest-warm (runs forked from
# a server that has imported what they need) have their hooks in their own modules.
pytest_plugins = ["dstest.pytest.html", "dstest.pytest.warm"]

_MARKERS = {
    "cpu": "runs on CPU only (simulated worlds, gloo processes). Provided by dstest.",
    "gpu": "needs CUDA GPUs (NCCL world, threaded world on CUDA); skipped with a reason when too few. Provided by dstest.",
    "soak": "long-running hardening runs; left out unless -m names soak where the ini sets "
    f"{INI_DESELECT_SOAK} = true. Provided by dstest.",
}

_owns_pools_key = pytest.StashKey[bool]()
_third_party_key = pytest.StashKey[bool]()
#: The runs of a test whose outcome its call did not show (a unittest TestCase's), for its report to judge.
_unjudged_runs_key = pytest.StashKey[Any]()
# Sessions configured in this process and not yet unconfigured: pytester's in-process runs nest a session
# inside the outer one, and only the outermost may stop the worlds' pools and crews.
_active_sessions: list[pytest.Config] = []


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from dstest.pytest import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def _register_plugins(config: pytest.Config) -> None:
    """Register the targets and worlds that ``pytest_dstest_targets`` / ``pytest_dstest_worlds`` implementations return."""
    from dstest.errors import InvalidArgument
    from dstest.registry import register_target, register_world

    for hook, register in (
        (config.hook.pytest_dstest_targets, register_target),
        (config.hook.pytest_dstest_worlds, register_world),
    ):
        kind = hook.name
        seen: dict[str, object] = {}
        for mapping in hook():
            if mapping is None:
                continue
            if not hasattr(mapping, "items"):
                raise pytest.UsageError(f"{kind}() returned {mapping!r}; return a dict of name -> factory")
            for name, factory in mapping.items():
                if name in seen and seen[name] is not factory:
                    raise pytest.UsageError(
                        f"{kind}(): {name!r} is given by two plugins ({seen[name]!r} and {factory!r}); rename one"
                    )
                seen[name] = factory
                try:  # replace: a conftest reloaded by a nested (pytester) session brings a new class
                    register(name, factory, replace=True)
                except InvalidArgument as exc:
                    raise pytest.UsageError(f"{kind}(): {exc}") from None


_IGNORE_SWALLOWED_ABORT = r"ignore:(?s).*dstest\.errors\.WorldAborted:pytest.PytestUnraisableExceptionWarning"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_owns_pools_key] = not _active_sessions
    _active_sessions.append(config)
    # A project that declares a marker of the same name keeps its own description (``--markers`` lists it
    # once); --strict-markers is satisfied either way.
    declared = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    for name, text in _MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", f"{name}: {text}")
    # A hung rank thread is stopped by raising WorldAborted into it, again and again until it leaves. One
    # that lands while the thread runs a gc callback (hypothesis installs one) is "ignored" by Python and
    # reported as an unraisable exception; the thread gets the next one. Not a failure of the test, even
    # under filterwarnings=error; any other unraisable exception still is.
    config.addinivalue_line("filterwarnings", _IGNORE_SWALLOWED_ABORT)
    from dstest.errors import InvalidArgument
    from dstest.pytest import fixtures
    from dstest.specification import Settings

    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "dstest.pytest.fixtures")
    _register_plugins(config)
    check_worlds(config.getoption(OPT_WORLDS))
    # Option values set without the parsers (a conftest's config.option, pytest.main's plugins) are
    # checked here too: every setting reaches the worlds checked.
    values = {
        "timeout": (OPT_TIMEOUT, config.getoption(OPT_TIMEOUT)),
        "target": (OPT_TARGET, config.getoption(OPT_TARGET)),
        "seed": (OPT_SEED, config.getoption(OPT_SEED)),
        "async_hazards": (OPT_ASYNC_HAZARDS, config.getoption(OPT_ASYNC_HAZARDS)),
        "strict_shapes": (OPT_STRICT_SHAPES, config.getoption(OPT_STRICT_SHAPES)),
        "judge_on_processes": (OPT_THREADS_ALONE, not config.getoption(OPT_THREADS_ALONE)),
        "crosscheck": (OPT_CROSSCHECK, config.getoption(OPT_CROSSCHECK)),
    }
    try:
        config.stash[fixtures.SETTINGS_KEY] = Settings(**{key: value for key, (_, value) in values.items()})
    except InvalidArgument as exc:
        key = str(exc).partition("=")[0]
        option, value = values.get(key, (key, None))
        raise usage_error(option, value, exc, f"{key}={value!r}") from None
    _start_lockstep(config)


def _start_lockstep(config: pytest.Config) -> None:
    """Under a launcher (torchrun), run every item in lockstep with the other ranks (:mod:`dstest.pytest.lockstep`)."""
    from dstest.errors import InvalidArgument
    from dstest.worlds.launched import launch_environment  # light: no torch import

    try:
        env = launch_environment()
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None
    if env is None or config.pluginmanager.has_plugin("dstest.pytest.lockstep"):
        return
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            f"-n {config.option.numprocesses} under a launcher (RANK={env.rank}, WORLD_SIZE={env.world_size}): "
            "each launched rank is one pytest session, so pytest-xdist cannot split it; drop -n"
        )
    from dstest.pytest.lockstep import Lockstep

    config.pluginmanager.register(Lockstep(config, settings(config).timeout), "dstest.pytest.lockstep")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from dstest.registry import world_marker
    from dstest.specification import CASE_ARG, Case, spec_info
    from dstest.worlds import DEFAULT_WORLDS

    info = spec_info(metafunc.function)
    if info is None:
        return
    _check_placement(metafunc, info)
    worlds = metafunc.config.getoption(OPT_WORLDS) or _under_launcher(info.worlds or DEFAULT_WORLDS)
    sizes = metafunc.config.getoption(OPT_WORLD_SIZES) or info.world_sizes
    params = [
        pytest.param(case, id=case.id, marks=[getattr(pytest.mark, world_marker(case.world))])
        for case in (Case(world=w, world_size=ws) for w in worlds for ws in sizes)
    ]
    metafunc.parametrize(CASE_ARG, params)


def _under_launcher(worlds: tuple[str, ...]) -> tuple[str, ...]:
    """Under a launcher the GPU specs run on the launched ranks: ``nccl`` becomes ``launched``."""
    from dstest.worlds.launched import launch_environment

    if launch_environment() is None:
        return worlds
    mapped = ["launched" if w == "nccl" else w for w in worlds]
    return tuple(dict.fromkeys(mapped))


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
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Record the world runs of the test; write their trace (``--dstest-trace``, or on failure)."""
    import os

    import dstest.trace as _trace  # light: no torch import

    failed = False
    trace_dir = item.config.getoption(OPT_TRACE)
    fr_dir = item.config.getoption(OPT_FLIGHT_RECORDER)
    if fr_dir is not None:
        fr_dir = os.path.join(fr_dir, _file_name(item))
    elif trace_dir is not None:
        fr_dir = os.path.join(trace_dir, _file_name(item) + ".fr")
    with _trace.recording(full=trace_dir is not None, flight_recorder=fr_dir) as rec:
        try:
            return (yield)
        except BaseException as exc:
            failed = not isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception))
            raise
        finally:
            if failed or trace_dir is not None:
                _add_trace_section(item, _write_trace(item, rec, failed))
            elif rec.runs:  # a unittest TestCase's failure raises nothing here: its report tells (makereport)
                item.stash[_unjudged_runs_key] = rec


def _add_trace_section(item: pytest.Item, text: str | None, report: pytest.TestReport | None = None) -> None:
    """The "dstest trace" section of the test's report (on ``report`` once it is made)."""
    if text is None:
        return
    if report is None:
        item.add_report_section("call", "dstest trace", text)
    else:
        report.sections.append(("Captured dstest trace call", text))


def _file_name(item: pytest.Item) -> str:
    """The test id as a file name of its own (the trace is ``<name>.json``, flight-recorder dumps
    ``<name>.fr``): the id made readable, then ``-`` and ten hex digits of a digest of the whole id.

    The digest is always there. A readable name alone cannot tell every pair of ids apart: ids longer than
    the name are cut (parametrized ids share long prefixes), and characters a file name should not hold
    become ``_``, so ``t[a b]`` and ``t[a_b]`` read the same; and every id has ``::``, so no id makes a
    name that could not also come from another. A digest only in some cases would need a rule for which,
    which a reader of the directory cannot check; the digest of the id alone keeps a test's name the same in
    every run and every xdist worker, without knowing the other tests.
    """
    import hashlib
    import re

    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "_", item.nodeid).strip("_")[:189]
    digest = hashlib.blake2b(item.nodeid.encode("utf-8", "surrogatepass"), digest_size=5).hexdigest()
    return f"{readable}-{digest}"  # at most 200 characters, before ``.json`` or ``.fr``


def _write_trace(item: pytest.Item, rec: Any, failed: bool) -> str | None:
    """Write the test's trace (and with ``--dstest-trace`` its runs' dumps); the lines naming them, or None."""
    import os

    if not rec.runs:
        return None
    folder = item.config.getoption(OPT_TRACE)
    if folder is None:
        cache = getattr(item.config, "cache", None)
        if not failed or cache is None:
            return None
        folder = str(cache.mkdir("dstest-traces"))
    for run in rec.runs:
        run.label = run.label or item.nodeid
    path = rec.write(os.path.join(folder, _file_name(item) + ".json"))
    lines = [f"{path} (open in https://ui.perfetto.dev or chrome://tracing)"]
    if item.config.getoption(OPT_TRACE) is not None:
        from dstest.trace.flight_recorder import analyzer_command, write_flight_recorder

        for n, run in enumerate(rec.runs, start=1):
            dumps = os.path.join(folder, f"{_file_name(item)}.fr", f"run-{n}")
            write_flight_recorder(dumps, run)
            lines.append(f"{dumps} (flight-recorder dumps; read with: {analyzer_command(dumps)})")
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A skip inside a spec body is reported at the body's line, not inside dstest (``-rs``); a spec
    failure of a third-party target is marked as a deviation (:func:`dstest.report.classify`); a failing
    unittest TestCase (torch's test bases) gets its trace written as a failing spec does, here, where its
    failure is first known."""
    from dstest.specification import SKIP_LOCATION_ATTR  # light: no torch import

    report = yield
    unjudged = item.stash.get(_unjudged_runs_key, None) if call.when == "call" else None
    if unjudged is not None:  # pytest's unittest support turned the TestCase's recorded failure into the report
        del item.stash[_unjudged_runs_key]
        if report.failed:
            _add_trace_section(item, _write_trace(item, unjudged, failed=True), report)
    excinfo = call.excinfo
    location = getattr(excinfo.value, SKIP_LOCATION_ATTR, None) if excinfo is not None else None
    if location is not None and report.skipped and isinstance(report.longrepr, tuple):
        path, lineno = location
        report.longrepr = (str(path), int(lineno), report.longrepr[2])
    if excinfo is not None and report.failed and call.when == "call" and _is_spec(item):
        from dstest.report import DEVIATION, OUTCOME_PROPERTY, classify

        if classify(excinfo.value, _third_party(item.config))[0] == DEVIATION:
            report.user_properties.append((OUTCOME_PROPERTY, DEVIATION))
    if call.when == "call" and _is_spec(item):
        from dstest.specification import JUDGED_ON_PROCESSES

        while JUDGED_ON_PROCESSES:  # this item's cases that the process world judged (worker-local)
            report.user_properties.append((JUDGED_PROPERTY, JUDGED_ON_PROCESSES.pop(0)))
    return report


#: A report's user property naming a case the process world judged (it travels from xdist workers).
JUDGED_PROPERTY = "dstest_judged_on_processes"


def _is_spec(item: pytest.Item) -> bool:
    from dstest.specification import spec_info

    return spec_info(getattr(item, "function", None)) is not None


def _third_party(config: pytest.Config) -> bool:
    known = config.stash.get(_third_party_key, None)
    if known is None:
        from dstest.report import is_third_party

        known = config.stash[_third_party_key] = is_third_party(settings(config).target)
    return known


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """Deviations are their own category: ``D`` in the progress line, ``DEV`` with ``-v``, "N deviation"."""
    from dstest.report import DEVIATION, is_deviation

    if report.when == "call" and report.failed and is_deviation(report):
        return DEVIATION, "D", "DEV"
    return None


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The tests the process world judged, and the tracebacks of deviations (pytest's FAILURES section lists
    only the "failed" category)."""
    from dstest.report import DEVIATION

    judged = [
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        for key, value in getattr(report, "user_properties", ())
        if key == JUDGED_PROPERTY
    ]
    if judged:
        n = len(judged)
        terminalreporter.write_sep(
            "=", f"{n} test{'s were' if n > 1 else ' was'} judged on processes (rank threads shared state)", yellow=True
        )
        for line in judged:
            terminalreporter.line(line)
        terminalreporter.line(
            f'mark them @dstest.spec(worlds=["process"]) (or give {OPT_THREADS_ALONE} to keep the threaded verdict)'
        )
    _report_rank_cpus(terminalreporter, config)
    reports = terminalreporter.stats.get(DEVIATION, [])
    if not reports or config.option.tbstyle == "no":
        return
    terminalreporter.write_sep(
        "=", f"DEVIATIONS of target {settings(config).target!r} from the contracts (docs/contracts.md)", yellow=True
    )
    for report in reports:
        terminalreporter.write_sep("_", report.head_line or report.nodeid, yellow=True)
        terminalreporter.line(report.longreprtext)
    if set(config.option.reportchars or "") & set("faA"):  # -rf / -ra: one line each, as for failures
        terminalreporter.write_sep("=", "deviations (short)", yellow=True)
        for report in reports:
            lines = [ln for ln in report.longreprtext.splitlines() if ln.startswith("E ")]
            terminalreporter.line(f"DEV {report.nodeid} - {lines[0][1:].strip() if lines else ''}")


def _report_rank_cpus(terminalreporter: Any, config: pytest.Config) -> None:
    """With ``-v``: where this process held the threaded world's rank threads under ``DSTEST_RANK_CPUS=auto``
    (the default), and why; timings of the threaded world depend on it."""
    import sys

    cpus = sys.modules.get("dstest.worlds.threaded.cpus")  # not imported: no threaded world ran (nor torch)
    decision = cpus.decided() if cpus is not None else None
    if decision is not None and config.option.verbose > 0:
        terminalreporter.line(f"dstest: {decision.describe()}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before the first spec: the target's builds (its ``prepare``, :meth:`dstest.binding.TargetBinding.prepare`),
    once per device the collected specs run on, so that no spec's rank JIT-builds inside its timeout. Here,
    between collection and the first test, pytest captures nothing: the target's progress lines show. An
    error is left for the runs, each of which fails with it."""
    if session.config.option.collectonly or not session.items:
        return
    from dstest.binding import TargetBinding, prepares, world_device
    from dstest.specification import CASE_ARG, spec_info

    target = settings(session.config).target
    devices = set()
    for item in session.items:
        info = spec_info(getattr(item, "function", None))
        case = getattr(item, "callspec", None) and item.callspec.params.get(CASE_ARG)  # type: ignore[attr-defined]
        if info is not None and case is not None and prepares(target, info.source):
            devices.add(world_device(case.world))
    import contextlib

    for device in sorted(devices):
        with contextlib.suppress(Exception):  # raised again by every run of the target: each fails with it
            TargetBinding(target).prepare(device)


def pytest_collect_file(file_path: Any, parent: pytest.Collector) -> pytest.Module | None:
    """Every module of the bundled conformance package is a test module (its names need not be test_*)."""
    import fnmatch
    import os

    if file_path.suffix != ".py" or file_path.name.startswith("_"):
        return None
    specs_dir = _specs_dir()
    if os.path.dirname(os.path.realpath(file_path)) != specs_dir:
        return None
    patterns = parent.config.getini("python_files")
    if parent.session.isinitpath(file_path) or any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # pytest's own python plugin collects it
    module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
    return module


@functools.cache
def _specs_dir() -> str:
    """The directory of :mod:`dstest.conformance`, found without importing it (it imports torch)."""
    import importlib.util
    import os

    found = importlib.util.find_spec("dstest.conformance")
    locations = list(found.submodule_search_locations or []) if found is not None else []
    return os.path.realpath(locations[0]) if locations else ""


@pytest.hookimpl(tryfirst=True)  # before pytest's -k deselection, which reads the contract keywords
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from dstest.pytest.selection import contracts_as_keywords, deselect_soak

    contracts_as_keywords(config, items)
    deselect_soak(config, items)
    mark = config.getoption(OPT_MARK_UNMARKED)
    if mark is None:
        return
    for item in items:
        if item.get_closest_marker("cpu") is None and item.get_closest_marker("gpu") is None:
            item.add_marker(getattr(pytest.mark, mark))


def settings(config: pytest.Config) -> Any:
    """The run settings the options produced (used by the fixtures)."""
    from dstest.pytest.fixtures import SETTINGS_KEY

    return config.stash[SETTINGS_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    """No worker process or warm rank thread outlives the test session (E4): every open world is closed
    through its ``close()`` (:func:`dstest.worlds.lifecycle.close_all`, which also runs at exit)."""
    if config in _active_sessions:
        _active_sessions.remove(config)
    if not config.stash.get(_owns_pools_key, True):
        return  # the outer session closes them
    from dstest.worlds.lifecycle import close_all

    close_all()
