"""One rank of a test on torch's process-based bases, in a warm worker (:mod:`dstest.compat.torch`).

:func:`run_planned` is the process world's rank function: it makes the worker look like the process the
base would have started (the environment it would have inherited, the pytest process's ``sys.path`` and
working directory, no ``torch.distributed`` world), then calls the base's own per-rank entry point with the
arguments the base gave it, a pipe of the rank's own standing in for the one to the pytest process. The
rank's result is its exit code; a rank that ended with the base's error code raises :class:`TestError`
with the traceback the base sent, so that the process world stops the ranks it left blocked. What the test
leaves in the worker is put back after it and named, as upstream's next fresh process would not have seen
it (:func:`~dstest.worlds.process.byref.fresh_process`).
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from dstest.compat._hidden_world import DIST_ENV, world_hidden

if TYPE_CHECKING:
    from dstest.worlds.process.byref import FreshProcess, ModuleRef

__all__ = ["Plan", "TestError", "bases_env", "class_as_spawned", "plan_of", "run_planned"]


class TestError(Exception):
    """A rank's test raised: ``text`` is the traceback the base sent to the pytest process."""

    __test__ = False  # not a pytest test class

    def __init__(self, text: str) -> None:
        super().__init__(text.strip().splitlines()[-1] if text.strip() else "the test raised")
        self.text = text

    def __reduce__(self) -> tuple[Any, ...]:
        return (TestError, (self.text,))


class _Pipe:
    """Where the base's pipe to the pytest process was, in a plan's arguments."""


class Plan(NamedTuple):
    """One rank's entry point as the base would have started it, in a form that reaches a worker."""

    module: ModuleRef
    cls: str  # qualname of the test class in its module
    method: str  # the class's per-rank entry point, e.g. "_run"
    args: bytes  # pickled arguments, the pipe replaced by _Pipe
    kwargs: bytes
    env: dict[str, str]


def plan_of(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], env: dict[str, str], nodeid: str) -> Plan:
    """In the pytest process: a :class:`Plan` for a recorded process, or a clear error."""
    from multiprocessing.connection import Connection

    from dstest.worlds.process.byref import module_ref

    owner = getattr(target, "__self__", None)
    if not isinstance(owner, type) or not hasattr(owner, getattr(target, "__name__", "")):
        raise TypeError(
            f"{nodeid}: the base starts its processes with target {target!r}; dstest.compat.torch runs a class's "
            "per-rank entry point (a classmethod such as MultiProcessTestCase._run); mark the test "
            "@pytest.mark.dstest_fresh_process to run it on its own processes"
        )
    swapped = tuple(_Pipe() if isinstance(a, Connection) else a for a in args)
    try:
        packed = pickle.dumps(swapped), pickle.dumps(kwargs)
    except Exception as exc:
        raise TypeError(
            f"{nodeid}: the arguments of {owner.__qualname__}.{target.__name__} must pickle to reach a rank, as "
            f"for a spawned process ({type(exc).__name__}: {exc})"
        ) from exc
    module = sys.modules[owner.__module__]
    return Plan(module_ref(module), owner.__qualname__, target.__name__, packed[0], packed[1], env)


def _exit_code(exc: SystemExit) -> int:
    """The exit code a process ending with ``exc`` has (``sys.exit("text")`` exits with 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def class_as_spawned(
    module: ModuleRef, qualname: str, path: list[str], cwd: str, env: dict[str, str], scope: FreshProcess
) -> Any:
    """On a rank: this worker made to look like the process a base would have spawned (the pytest process's
    ``sys.path`` first, its working directory, exactly the environment the process would have inherited;
    dstest's reset puts the worker's back), and the test class ``qualname`` of ``module`` imported there.
    ``scope`` starts there: what the test changes from then on is put back when it ends."""
    from dstest.worlds.process.byref import import_module_ref, put_path_first

    put_path_first(path)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    imported = import_module_ref(module)
    scope.started(imported)
    owner: Any = imported
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


def bases_env(name: str) -> bool:
    """Environment variables torch's bases set in every rank (``run_test``'s ``TORCH_SHOW_CPP_STACKTRACES``,
    the launch variables their ``init_pg``/``_init_pg`` set, the torchcomms ones), which a fresh process
    per test leaves behind with its process: put back unnamed."""
    return name in _BASES_ENV or name.startswith("TORCHCOMM_")


_BASES_ENV = frozenset((*DIST_ENV, "TORCH_SHOW_CPP_STACKTRACES"))


def run_planned(ctx: Any, plans: list[Plan], path: list[str], cwd: str, checked: bool = True) -> int:
    """One rank: the base's entry point as ``plans[ctx.rank]`` records it; its exit code. The worker is put
    back as a fresh process per test would leave it (:func:`~dstest.worlds.process.state_watch.fresh_process`)."""
    import multiprocessing

    from dstest.worlds.process.byref import fresh_process

    plan = plans[ctx.rank]
    code = 0
    with fresh_process(quiet_env=bases_env) as scope:
        owner = class_as_spawned(plan.module, plan.cls, path, cwd, plan.env, scope)
        entry = getattr(owner, plan.method)
        ours, theirs = multiprocessing.Pipe()
        args = tuple(theirs if isinstance(a, _Pipe) else a for a in pickle.loads(plan.args))
        with world_hidden(drop_dist_env=False, replace_after=None, checked=checked):
            try:
                entry(*args, **pickle.loads(plan.kwargs))
            except SystemExit as exc:
                code = _exit_code(exc)
    text = None
    try:
        if ours.poll():
            text = ours.recv()
    except (EOFError, OSError):  # the base closed its end without sending: no error text
        pass
    ours.close()
    if code == getattr(owner, "TEST_ERROR_EXIT_CODE", 10):
        raise TestError(text if isinstance(text, str) else f"exit code {code}")
    return code
