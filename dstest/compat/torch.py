"""Run test files written on torch's own distributed test bases, unchanged, on dstest's worlds.

    pytest -p dstest.compat.torch test/distributed/tensor/test_dtensor.py

(or ``PYTEST_ADDOPTS="-p dstest.compat.torch"``). Without the option, the tests run on the bases as before.

The bases come from the torch that is installed (``torch.testing._internal``); dstest adapts to them when
the test files have imported them, at collection, and copies none of their code:

- ``MultiProcessTestCase`` and every base deriving from it (``DTensorTestBase`` with ``@with_comms``,
  ``FSDPTest``, ``DistributedTestBase``...): upstream spawns one fresh process per rank per test, which
  imports torch and the test module again (seconds per test). Here each rank runs in a warm worker of
  dstest's process world, through the base's own per-rank entry point (its ``_run``), with the environment
  the spawned process would have inherited and no ``torch.distributed`` world of the worker's in sight: the
  test's ``init_process_group`` (gloo on CPU) forms its own, as upstream, of dstest's checked gloo groups
  (each collective matched across ranks, seen by torch's dispatcher as gloo's are; ``--dstest-unchecked``:
  torch's own ``ProcessGroupGloo``). Skips (``skip_if_lt_x_gpu`` and
  every exit-code skip), the exit-code checks and the error texts are the base's own code judging the exit
  codes the ranks ended with. A hang is reported after the base's timeout with every rank's stack; a rank
  that raised stops the ranks it left blocked. See :mod:`dstest.compat._torch_launch`.
- ``MultiThreadedTestCase`` and what derives from it (``DTensorOpTestBase``, ``FSDPTestMultiThread``): the
  ranks run on dstest's threaded world instead of torch's threaded group, and gain its checks (a
  collective that does not match across ranks, a deadlock, unwaited work are errors naming the ranks); the
  base's own ``perThreadSetUp``/``perThreadTearDown`` and its ``_check_return_codes`` judge the outcome.
  See :mod:`dstest.compat._torch_threaded`.
- Between tests each worker is put back to what upstream's fresh process per rank per test has (per class,
  on the continuous bases): the test module's globals as its import left them, ``sys.path``, the modules
  of the user's own the test imported, the environment, the working directory, signal handlers, torch's
  global settings and RNG (:func:`dstest.worlds.process.byref.fresh_process`), and torch.distributed's
  module globals; what a test left is put back and named in a ``StateLeftBehind`` warning. dstest's
  resets (environment, working directory, default dtype, deterministic switch, grad mode) and
  :func:`reset_torch_testing` (default device, dynamo's caches, DeviceMesh's bookkeeping) put back what is
  known to change without a report.
- A test that needs a fresh process gets the base's own processes: a class with
  ``dstest_fresh_process = "<why>"`` or a test marked ``@pytest.mark.dstest_fresh_process("<why>")``. The
  terminal summary lists them, and the tests after which a pool was replaced.
- ``MultiProcContinuousTest`` and ``DTensorContinuousTestBase``: upstream spawns a process per rank per
  class and feeds it the class's tests; here each test runs on the warm workers, which form the class's
  world through its own ``_init_pg`` for the test. See :mod:`dstest.compat._torch_continuous`.

Test ids are upstream's; ``instantiate_parametrized_tests`` and the bases' skips work unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from dstest.compat._torch_launch import FRESH_ATTR, FRESH_MARK, TorchState, adapt_process_base
from dstest.compat._torch_reset import reset_torch_testing
from dstest.compat._warm_run import restore

__all__ = ["FRESH_ATTR", "FRESH_MARK", "reset_torch_testing"]

_STATE_KEY = pytest.StashKey[TorchState]()
_BASES = "torch.testing._internal.common_distributed"


@pytest.hookimpl(tryfirst=True)  # the fork server starts before anything imports torch here
def pytest_configure(config: pytest.Config) -> None:
    from dstest.compat import _server_feed

    # imports torch and its test bases in its own process while pytest collects, then what the collection imports
    _server_feed.start(config, preload=("dstest.compat._torch_preload",))
    config.addinivalue_line("markers", f"{FRESH_MARK}(reason): run this test on its base's own processes, not warm")
    from dstest.pytest.options import INI_UNCHECKED, OPT_UNCHECKED

    unchecked = bool(config.getoption(OPT_UNCHECKED, False)) or bool(config.getini(INI_UNCHECKED))
    state = TorchState(strict_shapes=bool(config.getoption("--dstest-strict-shapes", False)), checked=not unchecked)
    config.stash[_STATE_KEY] = state
    config.add_cleanup(lambda: restore(state))  # when pytest unconfigures
    import dstest.resets

    dstest.resets.register("dstest.compat._torch_reset:reset_torch_testing")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """Once a test module is imported, the fork server imports what it imported too (a library besides
    torch's bases: torchtitan's models, 2.1 s each time), while pytest goes on collecting: once, not once per
    worker (15 workers for pools of 1, 2, 4 and 8 ranks)."""
    report = yield
    if isinstance(collector, pytest.Module):
        from dstest.compat import _server_feed

        _server_feed.feed(collector.config)
    return report


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collection is done: the fork server imports what is left of it, then serves the first worker."""
    from dstest.compat import _server_feed

    _server_feed.end(session.config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Adapt the bases the collected test files imported; note each test's id and marks."""
    state = config.stash[_STATE_KEY]
    bases = sys.modules.get(_BASES)
    if bases is None:
        return
    from dstest.compat._torch_continuous import adapt_continuous_base
    from dstest.compat._torch_threaded import adapt_threaded_base

    adapt_process_base(state, bases.MultiProcessTestCase)
    adapt_threaded_base(state, bases.MultiThreadedTestCase)
    continuous = getattr(bases, "MultiProcContinuousTest", None)  # torch 2.11 has it too; older ones may not
    if continuous is not None:
        adapt_continuous_base(state, continuous)
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(
            cls, (bases.MultiProcessTestCase, bases.MultiThreadedTestCase, *([continuous] if continuous else []))
        ):
            continue
        test_id = f"{cls.__module__}.{cls.__qualname__}.{item.name}"
        state.nodeids[test_id] = item.nodeid
        mark = item.get_closest_marker(FRESH_MARK)
        if mark is not None:
            state.marked_fresh[test_id] = str(mark.args[0]) if mark.args else f"marked {FRESH_MARK}"
        elif issubclass(cls, bases.MultiProcessTestCase):
            own = _overridden(cls, bases.MultiProcessTestCase, ("_start_processes", "_join_processes"))
            if own is not None:  # its own start or join would wait on processes the plugin never starts
                state.marked_fresh[test_id] = f"{own} is the class's own: it runs on its own processes"


def _overridden(cls: type, base: type, names: tuple[str, ...]) -> str | None:
    """``Class.method`` for the first of ``names`` a class between ``cls`` and ``base`` defines, or None."""
    for klass in cls.__mro__[: cls.__mro__.index(base)]:
        for name in names:
            if name in vars(klass):
                return f"{klass.__qualname__}.{name}"
    return None


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is None or not (state.warm_runs or state.threaded_runs or state.own):
        return
    tr = terminalreporter
    tr.section("dstest: torch's test bases on dstest's worlds")
    tr.line(
        f"{state.warm_runs} process-based tests ran on warm workers, {state.threaded_runs} threaded ones on "
        f"dstest's threaded world; {len(state.own)} on their base's own processes"
    )
    for e in state.own:
        tr.line(f"  own processes: {e.nodeid}: {e.why}")
    for e in state.replaced:
        tr.line(f"  pool replaced after: {e.nodeid}: {e.why}")
