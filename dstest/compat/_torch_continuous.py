"""torch's ``MultiProcContinuousTest`` (and ``DTensorContinuousTestBase``) on the warm process world
(:mod:`dstest.compat.torch`).

Upstream, the first test of a class spawns one process per rank (``_spawn_processes(cls, world_size)``),
each of which forms the class's world (``_init_pg``) and then runs the test ids the pytest process puts on
its task queue (``_run_test_given_id``), answering on a completion queue; the pytest process's wrapper of
each test method reads the answers (a skip, an error, or the id) and ``tearDownClass`` ends the processes.

Here ``_spawn_processes`` starts nothing: the queues it leaves behind are dstest's. When the wrapper asks
for the first answer of a test, the test runs on dstest's warm process world: each rank, with the worker's
own world hidden, forms the class's world through the class's ``_init_pg`` (on a rendezvous file of its
own), runs the test through the class's ``_run_test_given_id`` and leaves; the answers are those of
upstream's worker loop (a skip by exception or exit code is a ``SkipTest``, an error is a ``RuntimeError``
with the rank's traceback), so the base's own wrapper judges them, its "skip the rest of the class after a
failure" included. A rank that raised stops the ranks it left blocked, where upstream waits for the
timeout. Each test forms the class's world again (tens of milliseconds with gloo), so no test sees what an
earlier one left in it. What a test leaves in the worker otherwise (its module's globals, ``sys.path``, its
imports, torch's settings), the next test of the class sees, as in upstream's process; when the class ends,
a run of its own puts it back and names it (:func:`~dstest.worlds.process.byref.fresh_process`, held per
class).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import unittest
import weakref
from typing import Any

import pytest

from dstest.compat._hidden_world import world_hidden
from dstest.compat._torch_launch import TorchState
from dstest.compat._warm_run import Elsewhere, patch, run_warm

__all__ = ["adapt_continuous_base", "close_class", "run_continuous"]

_SPAWN = "_spawn_processes"


class _Live:
    """Stands in for a rank's process: alive for as long as the class runs."""

    exitcode = None

    def __init__(self, rank: int) -> None:
        self.pid = -1 - rank

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""

    def terminate(self) -> None:
        """Nothing to end."""


class _ClassRun:
    """The ranks of one test class: the test ids put on their queues, and the answers of the last one."""

    def __init__(self, state: TorchState, cls: type, world_size: int) -> None:
        self.state = state
        self.cls = cls
        self.world_size = world_size
        self.pending: str | None = None
        self.answers: list[Any] = []
        self.files = tempfile.mkdtemp(prefix="dstest-rdvz-")
        # the class's rendezvous files go when its ranks get upstream's poison pill (None), or at the latest
        # when this run is collected or the process exits
        self.remove_files = weakref.finalize(self, shutil.rmtree, self.files, True)
        self.count = 0

    def put(self, rank: int, test_id: str | None) -> None:
        if test_id is None:  # upstream's poison pill: the class is over
            if self.remove_files.alive and self.count:
                self._close()
            self.remove_files()
        elif test_id != self.pending:
            self.pending, self.answers = test_id, []

    def _close(self) -> None:
        """The class's processes end upstream, and with them what its tests left: the workers put it back
        (and name it) in a run of their own."""
        from dstest.worlds.process import ProcessWorld
        from dstest.worlds.request import RunRequest

        request = RunRequest(close_class, self.world_size, timeout=60.0, watch_modules=("torch.distributed",))
        ProcessWorld().run(request)

    def answer(self, rank: int) -> Any:
        __tracebackhide__ = True
        if not self.answers and self.pending is not None:
            self.answers = self._run(self.pending)
        return self.answers[rank]

    def _run(self, test_id: str) -> list[Any]:
        from dstest.errors import RankFailure, WorldAborted, WorldTimeout
        from dstest.worlds.process.byref import module_ref
        from dstest.worlds.torch_internals import bases_timeout

        self.count += 1
        rdvz = os.path.join(self.files, f"rdvz-{self.count}")
        module = module_ref(sys.modules[self.cls.__module__])
        env = dict(os.environ)
        args = (
            module, self.cls.__qualname__, test_id, self.world_size, rdvz, list(sys.path), os.getcwd(), env,
            self.state.checked,
        )  # fmt: skip
        nodeid = self.state.nodeids.get(test_id, test_id)
        try:
            results = run_warm(
                self.state,
                nodeid,
                run_continuous,
                self.world_size,
                args,
                timeout=bases_timeout(test_id),
                watch="torch.distributed",
            )
        except RankFailure as exc:
            return [_failure_answer(exc, WorldAborted)] * self.world_size
        except WorldTimeout as exc:
            return [RuntimeError(str(exc))] * self.world_size
        return [_answer(kind, text) for kind, text in results]


def _failure_answer(exc: Any, aborted: type) -> RuntimeError:
    """Every rank's answer to a failed test: the ranks that raised first (upstream's "Exception in worker
    process"), then the ranks stopped because of them, with their stacks, then what the run's failure report
    adds (each rank's last calls, where its flight-recorder dumps went)."""
    from dstest.trace import run_notes

    stopped = sorted(r for r, e in exc.exceptions.items() if isinstance(e, aborted))
    failed = [r for r in sorted(exc.failures) if r not in stopped]
    text = "".join(f"Exception in worker process (rank {r}):\n{exc.failures[r]}\n" for r in failed)
    if stopped:
        text += f"ranks {stopped} were stopped after another rank's failure:\n"
        text += "".join(f"---- rank {r} ----\n{exc.failures.get(r, '')}\n" for r in stopped)
    return RuntimeError(text + run_notes(exc))


def _answer(kind: str, text: str) -> Any:
    return unittest.SkipTest(text) if kind == "skip" else text


class _Tasks:
    def __init__(self, run: _ClassRun, rank: int) -> None:
        self.run, self.rank = run, rank

    def put(self, item: Any) -> None:
        self.run.put(self.rank, item)


class _Answers:
    def __init__(self, run: _ClassRun, rank: int) -> None:
        self.run, self.rank = run, rank

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        __tracebackhide__ = True
        return self.run.answer(self.rank)

    def empty(self) -> bool:
        return False


def adapt_continuous_base(state: TorchState, base: type) -> None:
    """Replace ``base``'s process start (``base``: ``MultiProcContinuousTest``) with dstest's queues."""
    if base in state.patched:
        return
    original = base.__dict__.get(_SPAWN)
    needed = ("_init_pg", "_run_test_given_id", "_worker_run_main_wait")
    missing = [n for n in needed if not hasattr(base, n)] + ([] if isinstance(original, classmethod) else [_SPAWN])
    if missing:
        import torch

        raise pytest.UsageError(
            f"dstest.compat.torch adapts to {base.__module__}.{base.__qualname__} through {_SPAWN}(cls, "
            f"world_size), {', '.join(needed)}; torch {torch.__version__}'s lacks {missing}; run without -p dstest.compat.torch"
        )
    spawn = original.__func__  # type: ignore[union-attr]

    def _spawn_processes(cls: type, world_size: int) -> None:
        why = getattr(cls, "dstest_fresh_process", None)
        if why:
            state.own.append(Elsewhere(f"{cls.__module__}.{cls.__qualname__}", str(why), int(world_size)))
            spawn(cls, world_size)
            return
        run = _ClassRun(state, cls, int(world_size))
        with tempfile.NamedTemporaryFile(delete=False) as f:
            name = f.name
        setattr(cls, "rdvz_file", name)  # noqa: B010 (upstream's tearDownClass removes it)
        setattr(cls, "processes", [_Live(r) for r in range(run.world_size)])  # noqa: B010
        setattr(cls, "task_queues", [_Tasks(run, r) for r in range(run.world_size)])  # noqa: B010
        setattr(cls, "completion_queues", [_Answers(run, r) for r in range(run.world_size)])  # noqa: B010

    patch(state, base, {_SPAWN: classmethod(_spawn_processes)})


def _skip_message(code: Any) -> str | None:
    from dstest.worlds.torch_internals import bases_skip_message

    return bases_skip_message(code)


def run_continuous(
    ctx: Any,
    module: Any,
    qualname: str,
    test_id: str,
    world_size: int,
    rdvz: str,
    path: list[str],
    cwd: str,
    env: dict[str, str],
    checked: bool = True,
) -> tuple[str, str]:
    """One rank of one test of a continuous class: ``("ok", test_id)`` or ``("skip", why)``; an error raises."""
    from dstest.compat._torch_rank import bases_env, class_as_spawned
    from dstest.worlds.process.byref import fresh_process

    # upstream's processes serve the whole class: what one test leaves, the next of the class sees
    with fresh_process(key=f"{module.module}:{qualname}", quiet_env=bases_env) as scope:
        owner = class_as_spawned(module, qualname, path, cwd, env, scope)
        owner.rank, owner.world_size = ctx.rank, world_size
        with world_hidden(drop_dist_env=False, replace_after=None, checked=checked):
            try:
                owner._init_pg(ctx.rank, world_size, rdvz)
                owner._run_test_given_id(test_id)
            except unittest.SkipTest as exc:
                return ("skip", str(exc))
            except SystemExit as exc:
                why = _skip_message(exc.code)
                if why is None:
                    raise
                return ("skip", why)
    return ("ok", test_id)


def close_class(ctx: Any) -> None:
    """On a rank, after the last test of a class: what the class's tests left is put back and named."""
    from dstest.worlds.process.byref import close_held_scope

    close_held_scope()
