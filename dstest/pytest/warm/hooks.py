"""The pytest hooks of ``--dstest-warm`` (a plugin of dstest's: ``pytest_plugins`` of
:mod:`dstest.pytest.plugin` names the package, which re-exports them): hand the run over before any conftest,
check a forked session once configured, say in the header which the run was, and start a server after a
cold run.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from dstest.pytest.warm.client import WarmState, hand_over, record_configured, start_server
from dstest.pytest.warm.session import check_session, decline, forked
from dstest.pytest.warm.staleness import loaded_origins

_STATE = pytest.StashKey[WarmState]()


def wanted(config: pytest.Config) -> bool:
    """Whether this run is a warm one: ``--dstest-warm`` or ``--dstest-no-warm`` when given, else the ini
    setting ``dstest_warm`` (a project that opted in once keeps its server between runs)."""
    given = getattr(config.known_args_namespace, "dstest_warm", None)
    if given is not None:
        return bool(given)
    try:
        return bool(config.getini("dstest_warm"))
    except ValueError:  # the setting is not registered: dstest's options plugin was left out (-p no:...)
        return False


@pytest.hookimpl(wrapper=True, tryfirst=True)  # before pytest's capture starts: the streams handed over are the run's
def pytest_load_initial_conftests(early_config: pytest.Config) -> Any:
    # An xdist worker finds no server: its environment holds the run's PYTEST_XDIST_TESTRUNUID, new each run.
    if wanted(early_config) and forked() is None:
        early_config.stash[_STATE] = hand_over(early_config)
    return (yield)


@pytest.hookimpl(trylast=True)  # after the conftests' and the other plugins' configuration
def pytest_configure(config: pytest.Config) -> None:
    if not wanted(config):
        return
    if forked() is not None:
        reason = check_session(config)
        if reason is not None:
            decline(reason)
        return
    state = config.stash.get(_STATE, None)
    if state is not None:
        record_configured(state)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not wanted(config):
        return None
    child = forked()
    if child is not None:
        age = child.started - child.server_started
        return f"dstest warm: forked from a warm server (pid {os.getppid()}, started {age:.0f} s before this run)"
    state = config.stash.get(_STATE, None)
    return None if state is None else f"dstest warm: cold run ({state.why})"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    worker = hasattr(config, "workerinput")  # an xdist worker's run is its controller's
    if state is not None and forked() is None and state.env and not worker:
        state.origins_at_end = loaded_origins()
        terminalreporter.write_line(f"dstest warm: {start_server(state)}")
