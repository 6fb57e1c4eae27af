"""pytest hooks of ``--dstest-html=PATH``: the conformance report of a pytest run as one HTML page.

Loaded with the dstest plugin (its ``pytest_plugins``). The option registers a watching
:class:`dstest.report.ConformanceReport` (it changes no collection) and writes
:func:`dstest.report.html.write_html`'s page at the end of the session: the same page as
``dstest --html PATH``, for runs that go through pytest (``pytest dstest/conformance --dstest-target=X``, a
suite that imports the bundled specs). Under pytest-xdist the workers put each case on its reports and
the controller writes the page. Imports only pytest and the standard library at import time.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

import pytest

OPT_HTML = "--dstest-html"

_collector_key = pytest.StashKey[Any]()
_started_key = pytest.StashKey[float]()


def _parse_html(value: str) -> str:
    from dstest.errors import InvalidArgument
    from dstest.report.html import check_output_path  # light: no torch import

    try:
        return check_output_path(value, OPT_HTML)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dstest", "dstest: distributed specs on simulated and real worlds")
    group.addoption(
        OPT_HTML,
        type=_parse_html,
        default=None,
        metavar="PATH",
        help="write the conformance report of the specs this run executes as one self-contained HTML page",
    )


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption(OPT_HTML) is None or _is_xdist_worker(config):
        return
    from dstest.pytest.options import OPT_TARGET
    from dstest.report import ConformanceReport

    collector = ConformanceReport(config.getoption(OPT_TARGET), progress=False, select=False)
    config.stash[_collector_key] = collector
    config.stash[_started_key] = time.perf_counter()
    config.pluginmanager.register(collector, "dstest-html-report")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if _is_xdist_worker(item.config) and item.config.getoption(OPT_HTML) is not None:
        from dstest.report import annotate

        annotate(report, item, call)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    collector = config.stash.get(_collector_key, None)
    if collector is None:
        return
    from dstest.report.html import write_html

    command = shlex.join(["pytest", *config.invocation_params.args])
    seconds = time.perf_counter() - config.stash[_started_key]
    write_html(collector.results, config.getoption(OPT_HTML), seconds=seconds, command=command)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if config.stash.get(_collector_key, None) is not None:
        terminalreporter.write_sep("-", f"dstest HTML report: {config.getoption(OPT_HTML)}")
