"""torch's threaded test bases on dstest's threaded world (:mod:`dstest.compat.torch`).

``MultiThreadedTestCase`` (of the installed torch) runs a test as threads over torch's threaded process
group: ``setUp`` calls ``_spawn_threads`` (one thread per rank, each entering the class's ``_run``, which
makes a test instance and calls ``run_test_with_threaded_pg``: ``init_process_group("threaded")``,
``perThreadSetUp``, the test method, ``destroy_process_group``, ``perThreadTearDown``), and the wrapped test
method joins them (``_join_threads``) and judges the ranks' exceptions (``_check_return_codes``).

Three steps are replaced on the class, at run time:

- ``_spawn_threads(self)`` starts nothing and notes the test's name and world size;
- ``_join_threads(cls, threads, fn)`` runs the class's ``_run`` for every rank on dstest's threaded world,
  where the rank's default group is dstest's, which matches and checks every collective;
- ``run_test_with_threaded_pg``, on a dstest rank, skips forming torch's threaded world (the rank is in
  dstest's) and runs ``perThreadSetUp``, the test and ``perThreadTearDown`` as upstream.

The ranks' outcomes go to the base's own ``_check_return_codes``: its skip and error texts are upstream's,
with dstest's findings (a mismatch, a deadlock, unwaited work) among the ranks' exceptions.
"""

from __future__ import annotations

import sys
import threading
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from dstest.compat._torch_launch import TorchState, fresh_reason
from dstest.compat._warm_run import Elsewhere, patch

__all__ = ["adapt_threaded_base"]

_SPAWN, _JOIN, _RUN_TEST, _CHECK = "_spawn_threads", "_join_threads", "run_test_with_threaded_pg", "_check_return_codes"
_on_dstest = threading.local()  # .outcomes: the run's {rank: exc_info} of skips and exits, on a dstest rank


@dataclass
class _ThreadPlan:
    """Stands in for the threads the base would have started."""

    cls: type
    test_name: str
    world_size: int
    nodeid: str

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for: the ranks run when the test joins."""

    def is_alive(self) -> bool:
        return False


def adapt_threaded_base(state: TorchState, base: type) -> None:
    """Replace ``base``'s thread start, join and per-thread run (``base``: ``MultiThreadedTestCase``)."""
    if base in state.patched:
        return
    originals: dict[str, Any] = {name: base.__dict__.get(name) for name in (_SPAWN, _JOIN, _RUN_TEST, _CHECK)}
    missing = [name for name, fn in originals.items() if fn is None]
    if missing:
        import torch

        raise pytest.UsageError(
            f"dstest.compat.torch adapts to {base.__module__}.{base.__qualname__} with the methods "
            f"{', '.join(originals)}; torch {torch.__version__}'s {base.__qualname__} lacks {missing}; run "
            "without -p dstest.compat.torch"
        )
    spawn = originals[_SPAWN]
    join = originals[_JOIN].__func__  # a classmethod
    run_test = originals[_RUN_TEST]

    def _spawn_threads(self: Any) -> None:
        why = fresh_reason(state, self)
        if why is not None:
            state.own.append(Elsewhere(state.nodeids.get(self.id(), self.id()), why))
            spawn(self)
            return
        self.threads = [
            _ThreadPlan(
                type(self), self._current_test_name, int(self.world_size), state.nodeids.get(self.id(), self.id())
            )
        ]
        return None

    def _join_threads(cls: type, threads: list[Any], fn: Callable[..., Any]) -> None:
        __tracebackhide__ = True
        if not (len(threads) == 1 and isinstance(threads[0], _ThreadPlan)):
            join(cls, threads, fn)
            return
        _run_on_threaded_world(state, threads[0], fn)

    def run_test_with_threaded_pg(self: Any, test_name: str, rank: int, world_size: int) -> None:
        outcomes = getattr(_on_dstest, "outcomes", None)
        if outcomes is None:
            run_test(self, test_name, rank, world_size)
            return
        self.perThreadSetUp()
        try:
            getattr(self, test_name)()
        except (unittest.SkipTest, SystemExit):  # upstream's verdict: a skip, or an exit code that may be one
            outcomes[rank] = sys.exc_info()
        finally:
            self.perThreadTearDown()

    replacements = {_SPAWN: _spawn_threads, _JOIN: classmethod(_join_threads), _RUN_TEST: run_test_with_threaded_pg}
    patch(state, base, replacements, keep=(_CHECK,))


def _rank(ctx: Any, plan: _ThreadPlan, outcomes: dict[int, Any]) -> None:
    """One rank on dstest's threaded world: the class's own per-rank entry point."""
    _on_dstest.outcomes = outcomes
    try:
        plan.cls._run(plan.test_name, ctx.rank, plan.world_size)  # type: ignore[attr-defined]
    finally:
        del _on_dstest.outcomes


def _run_on_threaded_world(state: TorchState, plan: _ThreadPlan, fn: Callable[..., Any]) -> None:
    __tracebackhide__ = True
    from dstest.errors import RankFailure, WorldAborted
    from dstest.worlds.request import RunRequest
    from dstest.worlds.threaded import ThreadedWorld
    from dstest.worlds.torch_internals import bases_default_timeout

    state.threaded_runs += 1
    timeout = bases_default_timeout()
    outcomes: dict[int, Any] = {}
    failed: list[tuple[int, Any]] = []
    run_failure: RankFailure | None = None
    try:
        request = RunRequest(
            _rank, plan.world_size, args=(plan, outcomes), timeout=timeout, strict_shapes=state.strict_shapes
        )
        ThreadedWorld(warm=True).run(request)
    except RankFailure as exc:
        run_failure = exc
        for rank, raised in sorted(exc.exceptions.items()):
            if not isinstance(raised, WorldAborted):
                failed.append((rank, (type(raised), raised, raised.__traceback__)))
        if not failed:
            raise
    failed.extend(sorted(outcomes.items(), key=lambda kv: kv[0]))
    try:
        plan.cls._check_return_codes(failed, timeout, fn)  # type: ignore[attr-defined]
    except RuntimeError as err:  # upstream's report of the ranks' exceptions
        _end_with_run_notes(err, run_failure)
        raise


def _end_with_run_notes(err: RuntimeError, run_failure: BaseException | None) -> None:
    """Upstream's report of a failed run ends with what dstest's report of the run adds (each rank's last
    calls, where its flight-recorder dumps went), as a spec's report does."""
    from dstest.trace import run_notes

    notes = run_notes(run_failure) if run_failure is not None else ""
    if notes and err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0].rstrip()}\n{notes}", *err.args[1:])
