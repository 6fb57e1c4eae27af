"""Run a DeepSpeed checkout's own unit tests, unchanged, on dstest's warm process world.

Enable it for a run from the checkout's ``tests/`` directory::

    cd DeepSpeed/tests
    DS_ACCELERATOR=cpu pytest -p dstest.compat.deepspeed unit/v1/zero unit/comm

(or ``PYTEST_ADDOPTS="-p dstest.compat.deepspeed"``). Without the option, the tests run on DeepSpeed's own
harness as before.

How it works. DeepSpeed's harness (``tests/unit/common.py`` of the checkout: ``DistributedExec`` with its
subclasses ``DistributedTest`` and ``DistributedFixture``) resolves a test's fixtures and world sizes in
the pytest process and then starts one process pool per test and world size. This plugin finds that class
at collection time and replaces only its launch step (``_launch_with_file_store``): for each world size the
test instance is pickled (as the harness pickles it for its pool) and run by the harness's own per-rank
entry point (``_dist_run``) in the warm workers of dstest's process world, which keep their gloo world
between tests. Nothing of ``common.py`` is copied; a checkout whose ``DistributedExec`` lacks those two
methods is refused at collection with a clear error.

What the harness offers, and what it means here:

- ``world_size`` as an int or a list, ``@pytest.mark.world_size(n)``, a ``world_size`` fixture,
  ``requires_cuda_env``, ``class_tmpdir``, ``DistributedFixture`` and the test ids: resolved by the harness's
  own code in the pytest process, unchanged.
- ``exec_timeout`` / ``DS_UNITTEST_TIMEOUT``: the run's timeout. A hanging test is reported with every
  rank's stack and the next test runs (the harness stops the whole session instead).
- ``reuse_dist_env``: every test reuses the warm world; the flag changes nothing.
- ``non_daemonic_procs``: dstest's workers are not daemonic, so such tests (they start processes of their
  own) run warm too.
- ``init_distributed = False`` or ``set_dist_env = False``: the test forms its world itself. It still runs
  in the warm workers, with their gloo world hidden for the test: ``torch.distributed`` is uninitialised
  there, the test's ``init_process_group`` (``env://`` on a fresh ``MASTER_PORT``, or whatever it passes)
  forms its own world, which is destroyed when the test ends, and the worker's world is put back; the
  workers are then replaced, since the test's store can outlive its groups and hold its port. With
  ``set_dist_env = False`` the test also sees no ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
  or ``MASTER_PORT``. The terminal summary counts these.
- A class with ``dstest_own_world = "<why>"`` or a test marked ``@pytest.mark.dstest_own_world("<why>")``
  runs on DeepSpeed's own launcher (a fresh pool); the terminal summary lists each with the reason.
- ``LOCAL_SIZE`` is not needed: each rank gets the harness's environment (``LOCAL_SIZE`` = the world size,
  ``RANK``, ``MASTER_PORT``...) from ``_dist_run`` itself; for a test that falls back to DeepSpeed's
  launcher, ``LOCAL_SIZE`` is raised to the test's world size for that launch.

State between tests. Each rank starts a test as a fresh process would: dstest's resets
(:mod:`dstest.resets`) restore the environment and working directory, :func:`reset_deepspeed` (registered
under the entry-point group ``dstest.resets``) drops DeepSpeed's communication backend, cached process
groups, an open ZeRO-3 ``Init`` context, activation-checkpointing state, a replaced accelerator and the
accelerator's peak-memory figure, and torch's global RNG gets the seed of a fresh process. A test that
leaves a worker unusable (it destroys the world group) is finished normally; its pool is replaced and the
summary lists it.

What stays warm: what is the same in every process of the machine. The fork server the workers come
from imports DeepSpeed, torch._dynamo and the modules every ``deepspeed.initialize`` loads on first use
(:mod:`dstest.compat._deepspeed_preload`), once, instead of each worker; a worker asks py-cpuinfo about the
CPU once and hands out copies of its answer (DeepSpeed asks again for every CPU optimizer, a subprocess each
time); DeepSpeed's compiled ops stay loaded, as its own op cache keeps them within a process.

Where it lives: the pytest hooks here; the patched launch in :mod:`dstest.compat._deepspeed_launch` (it
runs a launch through :mod:`dstest.compat._warm_run`, the warm run every compat plugin shares, and reaches
the process world only through :mod:`dstest.worlds.process.byref`), one rank's side in
:mod:`dstest.compat._deepspeed_rank`, the per-run reset in :mod:`dstest.compat._deepspeed_reset`, the fork
server's imports in :mod:`dstest.compat._deepspeed_preload`.

Reports. A rank's skip is reported at the line of the test that called ``pytest.skip``; a failure shows
every failing rank's traceback, which runs through the test's own file and line.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from dstest.compat._deepspeed_launch import (
    OWN_WORLD_ATTR,
    OWN_WORLD_MARK,
    LaunchState,
    patch_executors,
    restore_executors,
)
from dstest.compat._deepspeed_reset import reset_deepspeed

__all__ = ["OWN_WORLD_ATTR", "OWN_WORLD_MARK", "reset_deepspeed"]

_STATE_KEY = pytest.StashKey[LaunchState]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{OWN_WORLD_MARK}(reason): run this DeepSpeed test on DeepSpeed's own launcher, not warm"
    )
    config.addinivalue_line("markers", "world_size(n): the world size of one DistributedTest method")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # before the test modules import DeepSpeed
    state = LaunchState(strict_shapes=bool(config.getoption("--dstest-strict-shapes", False)))
    config.stash[_STATE_KEY] = state
    config.add_cleanup(lambda: restore_executors(state))  # when pytest unconfigures
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        from dstest.worlds.process.byref import preload_in_fork_server, start_fork_server

        preload_in_fork_server("dstest.compat._deepspeed_preload")
        start_fork_server()  # imports torch and DeepSpeed in its own process while pytest collects


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find the harness's executor class (from the test classes and the loaded modules) and patch it."""
    patch_executors(config.stash[_STATE_KEY], items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A rank failure is reported as the ranks' tracebacks alone (a rank's skip location is set through
    dstest's own SKIP_LOCATION_ATTR, which dstest's plugin applies)."""
    report = yield
    excinfo = call.excinfo
    if excinfo is None:
        return report
    text = getattr(excinfo.value, "_dstest_ds_report", None)
    if text is not None and report.failed:
        report.longrepr = text
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is None or not (state.patched or state.own):
        return
    tr = terminalreporter
    tr.section("dstest: DeepSpeed tests on the warm process world")
    formed = (
        f" ({len(state.hidden)} of them on a world the test formed itself, each followed by fresh workers)"
        if state.hidden
        else ""
    )
    tr.line(f"{state.warm_runs} launches ran warm{formed}; {len(state.own)} ran on DeepSpeed's own launcher")
    for e in state.own:
        tr.line(f"  own launcher: {e.nodeid} (world size {e.world_size}): {e.why}")
    for e in state.replaced:
        tr.line(f"  pool replaced after: {e.nodeid} (world size {e.world_size}): {e.why}")
