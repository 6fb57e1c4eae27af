"""torch's process-based test bases on the warm process world, the pytest process's side (:mod:`dstest.compat.torch`).

``MultiProcessTestCase`` (of the user's installed torch, ``torch.testing._internal.common_distributed``)
runs a test in two roles: in the pytest process, ``setUp`` starts one process per rank
(``_spawn_processes`` / ``_fork_processes``, both through ``_start_processes(proc)``) and the test method,
wrapped, joins them (``_join_processes(fn)``) and judges their exit codes (``_check_return_codes``); in
each process the base's per-rank entry point (the class's ``_run``) runs the test method.

This module replaces two of those steps on the class, at run time, and nothing else:

- ``_start_processes(self, proc)`` runs the base's own code with ``proc`` standing in for the process
  class: each "process" records the target, arguments and keyword arguments the base gives it (the
  environment too, as a spawned process would inherit it at that moment), and starts nothing;
- ``_join_processes(self, fn)`` runs the recorded per-rank entry points on dstest's warm process world (by
  the warm run every compat plugin shares, :mod:`dstest.compat._warm_run`; one worker per rank, the worker's
  own world hidden: the test's ``init_process_group`` forms its world, as in a fresh process) and gives each recorded process the exit code its rank ended with, then lets the base's
  own ``_join_processes`` and ``_check_return_codes`` judge them: skips by exit code, the exit-code checks
  and the error text are upstream's. A rank that raised is reported with upstream's text ("Process r
  exited with error code 10 and exception: ...") and the ranks it left blocked are stopped with their
  stacks; a hang is reported with every rank's stack after upstream's timeout (``get_timeout``).

A test whose class says ``dstest_fresh_process = "<why>"``, or marked ``@pytest.mark.dstest_fresh_process``,
runs on the base's own processes; the terminal summary lists it.
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from dstest.compat._warm_run import Elsewhere, WarmState, patch, run_warm

__all__ = ["FRESH_ATTR", "FRESH_MARK", "TorchState", "adapt_process_base", "fresh_reason"]

#: A class attribute (a reason string) that sends a test class to the base's own processes.
FRESH_ATTR = "dstest_fresh_process"
#: The marker that does the same for one test: ``@pytest.mark.dstest_fresh_process("why")``.
FRESH_MARK = "dstest_fresh_process"

_START, _JOIN, _CHECK = "_start_processes", "_join_processes", "_check_return_codes"
_WARM_ATTR = "_dstest_warm_plan"
_pids = itertools.count(2**22)  # above any real pid of this machine: a recorded process's "pid"


@dataclass
class TorchState(WarmState):
    """What the plugin keeps for one pytest session, beyond every compat plugin's: the threaded runs, and
    each test's pytest nodeid and fresh-process mark by its unittest id."""

    threaded_runs: int = 0
    nodeids: dict[str, str] = field(default_factory=dict)  # unittest id -> pytest nodeid, marks looked up by it
    marked_fresh: dict[str, str] = field(default_factory=dict)  # unittest id -> why


class _Planned:
    """Stands in for one rank's process: what the base would have started, and the exit code it gets."""

    def __init__(
        self,
        target: Any = None,
        name: str = "",
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        self.target = target
        self.name = name
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.env = dict(os.environ)
        self.pid = next(_pids)
        self.exitcode: int | None = None

    def start(self) -> None:
        """Nothing starts: the rank runs on a warm worker when the test joins."""

    def join(self, timeout: float | None = None) -> None:
        """Already ended, or never started."""

    def is_alive(self) -> bool:
        return False

    def terminate(self) -> None:
        """Nothing to end."""

    kill = terminate

    def close(self) -> None:
        """Nothing to release."""


class _Said:
    """Stands in for the pipe a rank's error text arrives on."""

    def __init__(self, text: str | None) -> None:
        self.text = text
        self.closed = False

    def recv(self) -> str:
        return self.text or ""

    def poll(self, timeout: float | None = None) -> bool:
        return self.text is not None

    def send(self, obj: Any) -> None:
        """The ranks are gone: nothing listens."""

    def close(self) -> None:
        self.closed = True


def fresh_reason(state: TorchState, test: Any) -> str | None:
    why = state.marked_fresh.get(test.id())
    if why is not None:
        return why
    attr = getattr(test, FRESH_ATTR, None)
    return str(attr) if attr else None


def adapt_process_base(state: TorchState, base: type) -> None:
    """Replace ``base``'s process start and join with the warm ones (``base``: ``MultiProcessTestCase``)."""
    if base in state.patched:
        return
    originals: dict[str, Any] = {name: base.__dict__.get(name) for name in (_START, _JOIN, _CHECK)}
    missing = [name for name, fn in originals.items() if not callable(fn)]
    if missing or list(inspect.signature(originals[_START]).parameters)[:2] != ["self", "proc"]:
        import torch

        raise pytest.UsageError(
            f"dstest.compat.torch adapts to {base.__module__}.{base.__qualname__} with the methods "
            f"{_START}(self, proc), {_JOIN}(self, fn) and {_CHECK}; torch {torch.__version__}'s "
            f"{base.__qualname__} lacks {missing or [_START + '(self, proc)']}; run without -p dstest.compat.torch"
        )
    start, join = originals[_START], originals[_JOIN]

    def _start_processes(self: Any, proc: Any) -> None:
        why = fresh_reason(state, self)
        if why is not None:
            state.own.append(Elsewhere(state.nodeids.get(self.id(), self.id()), why))
            start(self, proc)
            return
        setattr(self, _WARM_ATTR, True)
        start(self, _Planned)

    def _join_processes(self: Any, fn: Callable[..., Any]) -> None:
        __tracebackhide__ = True
        if not getattr(self, _WARM_ATTR, False):
            join(self, fn)
            return
        _run_warm(state, self, fn, join)

    _start_processes.__wrapped__ = start  # type: ignore[attr-defined]
    _join_processes.__wrapped__ = join  # type: ignore[attr-defined]
    patch(state, base, {_START: _start_processes, _JOIN: _join_processes}, keep=(_CHECK,))


def _run_warm(state: TorchState, test: Any, fn: Callable[..., Any], join: Callable[..., Any]) -> None:
    """Run the recorded ranks warm, then let the base's own join judge their exit codes."""
    __tracebackhide__ = True
    from dstest.compat._torch_rank import plan_of, run_planned
    from dstest.errors import RankFailure
    from dstest.worlds.torch_internals import bases_timeout

    planned: list[_Planned] = list(test.processes)
    if not planned:  # the base started nothing (a skip before the start): upstream's join says so
        join(test, fn)
        return
    nodeid = state.nodeids.get(test.id(), test.id())
    plans = [plan_of(p.target, p.args, p.kwargs, p.env, nodeid) for p in planned]
    world_size = len(plans)
    error_code = int(getattr(test, "TEST_ERROR_EXIT_CODE", 10))
    args = (plans, list(sys.path), os.getcwd(), state.checked)
    try:
        codes = run_warm(
            state, nodeid, run_planned, world_size, args, timeout=bases_timeout(test.id()), watch="torch.distributed"
        )
        errors: dict[int, str] = {}
    except RankFailure as exc:
        codes, errors = _codes_of_failure(exc, world_size, error_code)
    for rank, p in enumerate(planned):
        p.exitcode = codes[rank]
    test.pid_to_pipe = {p.pid: _Said(errors.get(rank)) for rank, p in enumerate(planned)}
    if errors:  # upstream's join would terminate every child of this process, dstest's workers too
        _check_codes(test, fn)
    else:
        join(test, fn)


def _codes_of_failure(exc: Any, world_size: int, error_code: int) -> tuple[list[int | None], dict[int, str]]:
    """Exit codes and error texts from a failed run: a rank that raised in the test exited with the base's
    error code and sent its traceback; a rank stopped because of it (or that failed in dstest's own code)
    never exited. What the run's failure report adds (each rank's last calls, where its flight-recorder dumps
    went) ends the last text, so upstream's report ends with it."""
    from dstest.compat._torch_rank import TestError
    from dstest.errors import WorldAborted
    from dstest.trace import run_notes

    codes: list[int | None] = [None] * world_size
    errors: dict[int, str] = {}
    for rank, text in exc.failures.items():
        raised = exc.exceptions.get(rank)
        if isinstance(raised, TestError):
            codes[rank] = error_code
            errors[rank] = raised.text
        elif rank in exc.exceptions and not isinstance(raised, WorldAborted):
            codes[rank] = error_code
            errors[rank] = text
    if not errors:
        raise exc
    stopped = sorted(set(range(world_size)) - set(errors))
    if stopped:
        notes = "".join(f"\n---- rank {r} (stopped) ----\n{exc.failures.get(r, '')}" for r in stopped)
        first = min(errors)
        errors[first] = errors[first] + f"\n(dstest: ranks {stopped} were stopped after the failure){notes}"
    calls_and_dumps = run_notes(exc)
    if calls_and_dumps:  # upstream's report lists the ranks in order: the last one's text ends it
        last = max(errors)
        errors[last] = f"{errors[last].rstrip()}\n{calls_and_dumps}"
    return codes, errors


def _check_codes(test: Any, fn: Callable[..., Any]) -> None:
    """The base's own ``_check_return_codes``, called as its torch version declares it."""
    __tracebackhide__ = True
    check = test._check_return_codes
    params = list(inspect.signature(check).parameters)
    if len(params) >= 2:
        check(fn, 0.0)
    else:
        check(0.0)
