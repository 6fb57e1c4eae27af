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

Reports. A rank's skip is reported at the line of the test that called ``pytest.skip``; a failure shows
every failing rank's traceback, which runs through the test's own file and line.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dstest.worlds.process.messages import _FnRef

__all__ = ["OWN_WORLD_ATTR", "OWN_WORLD_MARK", "reset_deepspeed"]

#: A class attribute (a reason string) that sends a DistributedTest class to DeepSpeed's own launcher.
OWN_WORLD_ATTR = "dstest_own_world"
#: The marker that does the same for one test: ``@pytest.mark.dstest_own_world("why")``.
OWN_WORLD_MARK = "dstest_own_world"

_LAUNCH = "_launch_with_file_store"  # DistributedExec._launch_with_file_store(self, request, world_size)
_RANK_ENTRY = "_dist_run"  # DistributedExec._dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg)
_STATE_KEY = pytest.StashKey["_State"]()


@dataclass
class _Elsewhere:
    nodeid: str
    world_size: int
    why: str


@dataclass
class _State:
    patched: dict[type, Callable[..., Any]] = field(default_factory=dict)  # class -> its original launch
    own_world: list[_Elsewhere] = field(default_factory=list)
    hidden: list[_Elsewhere] = field(default_factory=list)  # ran warm on a world the test formed itself
    replaced: list[_Elsewhere] = field(default_factory=list)
    warm_runs: int = 0
    ports: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # world size -> (port, pids)
    given: set[int] = field(default_factory=set)  # every MASTER_PORT this session gave ranks
    strict_shapes: bool = False  # --dstest-strict-shapes: shape-only differences are mismatches too


# ------------------------------------------------------------------------------------------------------
# pytest hooks
# ------------------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{OWN_WORLD_MARK}(reason): run this DeepSpeed test on DeepSpeed's own launcher, not warm"
    )
    config.addinivalue_line("markers", "world_size(n): the world size of one DistributedTest method")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # before the test modules import DeepSpeed
    config.stash[_STATE_KEY] = _State(strict_shapes=bool(config.getoption("--dstest-strict-shapes", False)))
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        from dstest.worlds.process.launch import preload_in_fork_server

        preload_in_fork_server("dstest.compat._deepspeed_preload")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is not None:
        for cls, original in state.patched.items():
            setattr(cls, _LAUNCH, original)
        state.patched.clear()
        _remove_shm_segments(state.given)


#: DeepSpeed's CPU shared-memory collectives (csrc/cpu/comm/shm.cpp) keep one segment per rank, named
#: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and never remove it.
_SHM_SEGMENT = "deepspeed_allreduce_buffer_{uid}_*_{port}_*"


def _remove_shm_segments(ports: set[int]) -> None:
    """Remove the shared-memory segments DeepSpeed's ranks made for the ports this session gave them.

    Every segment is about 66 MB of RAM (/dev/shm) that outlives the processes: DeepSpeed's harness reuses
    a few fixed ports, so it leaves a bounded number behind, but each session of this plugin picks free
    ports, and without this every run would leave new ones (13 GB of them filled this machine's memory).
    Unlinking is safe while a worker still maps one: the memory goes when the last mapping does.
    """
    import glob

    for port in ports:
        for path in glob.glob(os.path.join("/dev/shm", _SHM_SEGMENT.format(uid=os.getuid(), port=port))):
            with contextlib.suppress(OSError):
                os.unlink(path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find the harness's executor class (from the test classes and the loaded modules) and patch it."""
    state = config.stash[_STATE_KEY]
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(cls, "is_dist_test", False) and _executor_of(cls) is None:
            raise pytest.UsageError(
                f"dstest.compat.deepspeed: {item.nodeid} is a DistributedTest, but no class of "
                f"{cls.__qualname__}'s bases defines both {_LAUNCH}(self, request, world_size) and "
                f"{_RANK_ENTRY}(self, local_rank, num_procs, ...), the two steps of DeepSpeed's harness "
                "(tests/unit/common.py) this plugin adapts to; run without -p dstest.compat.deepspeed"
            )
    candidates: list[type] = [cls for cls in (getattr(item, "cls", None) for item in items) if cls is not None]
    for module in list(sys.modules.values()):
        for name in ("DistributedExec", "DistributedTest", "DistributedFixture"):
            obj = getattr(module, name, None) if module is not None else None
            if isinstance(obj, type):
                candidates.append(obj)
    for cls in candidates:
        base = _executor_of(cls)
        if base is not None and base not in state.patched:
            _check_shape(base)
            state.patched[base] = base.__dict__[_LAUNCH]
            setattr(base, _LAUNCH, _make_launch(state, base.__dict__[_LAUNCH]))


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
    if state is None or not (state.patched or state.own_world):
        return
    tr = terminalreporter
    tr.section("dstest: DeepSpeed tests on the warm process world")
    formed = (
        f" ({len(state.hidden)} of them on a world the test formed itself, each followed by fresh workers)"
        if state.hidden
        else ""
    )
    tr.line(f"{state.warm_runs} launches ran warm{formed}; {len(state.own_world)} ran on DeepSpeed's own launcher")
    for e in state.own_world:
        tr.line(f"  own launcher: {e.nodeid} (world size {e.world_size}): {e.why}")
    for e in state.replaced:
        tr.line(f"  pool replaced after: {e.nodeid} (world size {e.world_size}): {e.why}")


# ------------------------------------------------------------------------------------------------------
# The patched launch (pytest process)
# ------------------------------------------------------------------------------------------------------


def _executor_of(cls: type) -> type | None:
    """The class in ``cls``'s MRO that defines the harness's launch step, if any."""
    for base in cls.__mro__:
        if _LAUNCH in base.__dict__ and _RANK_ENTRY in vars(base):
            return base
    return None


def _check_shape(base: type) -> None:
    import inspect

    expected = {_LAUNCH: ["self", "request", "world_size"], _RANK_ENTRY: ["self", "local_rank", "num_procs"]}
    for name, params in expected.items():
        got = list(inspect.signature(getattr(base, name)).parameters)
        if got[: len(params)] != params:
            raise pytest.UsageError(
                f"dstest.compat.deepspeed adapts to {base.__module__}.{base.__qualname__}.{name}"
                f"({', '.join(params)}, ...), but this checkout's takes ({', '.join(got)}); run without "
                "-p dstest.compat.deepspeed, or with a DeepSpeed checkout whose tests/unit/common.py has that shape"
            )


def _own_world_reason(test: Any, request: Any) -> str | None:
    """Why a test must run on DeepSpeed's own launcher (its mark or class attribute), or None."""
    node = getattr(request, "node", None)
    mark = node.get_closest_marker(OWN_WORLD_MARK) if node is not None else None
    if mark is not None:
        return str(mark.args[0]) if mark.args else f"marked {OWN_WORLD_MARK}"
    why = getattr(test, OWN_WORLD_ATTR, None)
    return str(why) if why else None


def _forms_its_world(test: Any) -> bool:
    """Whether the test initialises torch.distributed itself (it then runs warm on a hidden world)."""
    return not getattr(test, "init_distributed", True) or not getattr(test, "set_dist_env", True)


@contextlib.contextmanager
def _local_size_at_least(n: int) -> Iterator[None]:
    old = os.environ.get("LOCAL_SIZE")
    if old is None or not old.isdigit() or int(old) < n:
        os.environ["LOCAL_SIZE"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LOCAL_SIZE", None)
        else:
            os.environ["LOCAL_SIZE"] = old


def _make_launch(state: _State, original: Callable[..., Any]) -> Callable[..., Any]:
    def _launch_with_file_store(self: Any, request: Any, world_size: Any) -> None:
        __tracebackhide__ = True
        sizes = [world_size] if isinstance(world_size, int) else list(world_size)
        nodeid = getattr(getattr(request, "node", None), "nodeid", "?")
        for procs in sizes:
            if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
                raise pytest.UsageError(f"{nodeid}: world_size={world_size!r}: give an int >= 1 or a list of them")
            why = _own_world_reason(self, request)
            if why is not None:
                state.own_world.append(_Elsewhere(nodeid, procs, why))
                with _local_size_at_least(procs):
                    original(self, request, procs)
                continue
            _run_warm(state, self, nodeid, procs)

    return _launch_with_file_store


def _pids(world_size: int) -> tuple[int, ...]:
    from dstest.worlds.process.warm import pool_pids

    return tuple(pool_pids().get(("gloo", world_size), ()))


def _port_for(state: _State, world_size: int) -> int:
    """A MASTER_PORT per pool: DeepSpeed's CPU shared-memory op names its segments after it, so two pools
    alive at once must not share one; a replaced pool gets a new one."""
    from dstest.worlds.process.launch import _free_port

    pids = _pids(world_size)
    known = state.ports.get(world_size)
    if known is None or (known[1] and known[1] != pids):
        known = (_free_port(), pids)
    elif not known[1]:  # the pool started during the run that chose the port: remember its workers
        known = (known[0], pids)
    state.ports[world_size] = known
    return known[0]


def _run_warm(state: _State, test: Any, nodeid: str, procs: int) -> None:
    __tracebackhide__ = True
    from dstest.errors import RankFailure, WorkerDied, WorldTimeout
    from dstest.specification import SKIP_LOCATION_ATTR
    from dstest.worlds import _trace
    from dstest.worlds.process import ProcessWorld

    try:
        payload = pickle.dumps(test, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{nodeid}: the test instance and its fixture values must pickle to reach the ranks, as they must "
            f"for DeepSpeed's own pool ({type(exc).__name__}: {exc})"
        ) from exc
    module = sys.modules[type(test).__module__]
    ref = _reference_of_module(module)
    hide = _forms_its_world(test)
    if hide:  # the test's own TCPStore: a port of its own, as the harness gives every launch
        from dstest.worlds.process.launch import _free_port

        port = _free_port()
        state.hidden.append(_Elsewhere(nodeid, procs, "forms its own world"))
    else:
        port = _port_for(state, procs)
    state.given.add(port)
    before = _pids(procs)
    timeout = float(getattr(test, "exec_timeout", 600))
    state.warm_runs += 1
    try:
        with _trace.run_options(strict_shapes=state.strict_shapes):
            results = ProcessWorld().run(
                _rank_main, procs, args=(payload, ref, list(sys.path), port, hide), timeout=timeout, seed=0
            )
    except (RankFailure, WorldTimeout, WorkerDied) as exc:
        setattr(exc, "_dstest_ds_report", _failure_text(nodeid, exc))  # noqa: B010 (read back by makereport)
        raise
    finally:
        after = _pids(procs)
        if before and after != before and not hide:  # a world of its own always gets fresh workers after
            state.replaced.append(_Elsewhere(nodeid, procs, "the test left its workers unusable"))
    messages = [msg for msg, _ in results]
    if any(messages):
        if len(set(messages)) != 1:  # the harness asserts the same
            raise AssertionError(
                f"{nodeid}: the ranks skipped with different messages, or only some of them skipped: "
                + "; ".join(f"rank {r}: {m!r}" for r, m in enumerate(messages))
            )
        skipped = pytest.skip.Exception(messages[0])
        location = next((loc for _, loc in results if loc is not None), None)
        if location is not None:
            setattr(skipped, SKIP_LOCATION_ATTR, location)  # reported there by dstest's plugin
        raise skipped


def _reference_of_module(module: Any) -> _FnRef:
    """What a worker needs to import the test module as pytest did (name, file, assertion rewriting)."""
    from dstest.worlds.process.messages import _FnRef

    path = getattr(module, "__file__", None)
    return _FnRef(module.__name__, "", os.path.abspath(path) if path else None, "@py_builtins" in vars(module))


def _failure_text(nodeid: str, exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [f"---- rank {r} ----\n{tb}" for r, tb in sorted(failures.items())]
        head = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{nodeid}: {head}\n" + "\n".join(parts)
    return f"{nodeid}: {type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------------------------
# One rank (in a warm worker)
# ------------------------------------------------------------------------------------------------------


class _SkipBox:
    """Stands in for the harness's skip queue (``skip_msg.put``) of non-daemonic launches."""

    def __init__(self) -> None:
        self.message = ""

    def put(self, message: str) -> None:
        self.message = message


def _fresh_process_rng() -> None:
    """torch's global RNG as a new process has it (the harness's ranks all start from that seed); Python's
    and numpy's from fresh entropy, as a new process seeds them."""
    import torch

    torch.manual_seed(torch.Generator().initial_seed())
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _remember_cpu_info() -> None:
    """``cpuinfo.get_cpu_info()`` answered from memory after its first call in this worker.

    DeepSpeed asks py-cpuinfo about the CPU each time it builds a CPU optimizer or checks an op (every
    ``DeepSpeedCPUAdam``, on every rank), and each call starts a Python subprocess that probes the CPU: about
    1.5 s on this 2-core machine, the largest part of an offload test's time on warm workers. The answer is
    the same for every process on the machine, so a worker asks once and hands out copies; a test that
    patches ``cpuinfo.get_cpu_info`` replaces the memo for as long as its patch lasts.
    """
    try:
        import cpuinfo
    except ImportError:
        return
    ask = cpuinfo.get_cpu_info
    if getattr(ask, "_dstest_remembers", False):
        return
    answers: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if not answers:
            answers.append(ask())
        return copy.deepcopy(answers[0])

    get_cpu_info._dstest_remembers = True  # type: ignore[attr-defined]
    get_cpu_info.__wrapped__ = ask  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def _skip_location(exc: BaseException) -> tuple[str, int] | None:
    """Where the test called pytest.skip: the innermost frame outside pytest."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}_pytest{os.sep}" not in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    return frame.filename, int(frame.lineno or 0)


#: What a launched rank's environment names about its world; a ``set_dist_env = False`` test sees none.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _world_hidden(set_dist_env: bool) -> Iterator[None]:
    """For a test that forms its own world: this worker's gloo world out of sight for the block.

    torch-internal: ``distributed_c10d._world`` is swapped for a world state of its own (uninitialised,
    group names counted from 0; torch's ``_World`` keeps its tables in module globals, so a second
    ``_World()`` would share them) and the worker's default group is taken out of torch's by-name registry,
    so the test's ``init_process_group`` registers its own. Afterwards everything the test formed is destroyed and
    the worker's world, its registration and its global rank are put back.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from dstest.worlds.torch_internals import new_rank_state

    registry: Any = torch._C._distributed_c10d
    saved = c10d._world
    default = c10d._get_default_group()
    name = default.group_name
    registry._unregister_process_group(name)
    c10d._world = new_rank_state()
    c10d._update_default_pg(None)
    if not set_dist_env:
        for key in _DIST_ENV:  # put back by dstest's reset of the environment before the next run
            os.environ.pop(key, None)
    try:
        yield
    finally:
        from dstest.worlds.process.worker import replace_after_this_run

        # Destroying the test's groups does not close its TCPStore while DeepSpeed's objects still refer to
        # it: its port (DeepSpeed's default, 29500, when the test sees no MASTER_PORT) would stay taken,
        # and the next test that binds that port fails. A fresh process for the next test, as the harness
        # gives every test.
        replace_after_this_run("the test formed a world of its own")
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            c10d._world = saved
            c10d._update_default_pg(default)
            registry._register_process_group(name, default)


def _rank_main(ctx: Any, payload: bytes, ref: _FnRef, path: list[str], port: int, hide: bool = False) -> Any:
    from _pytest.outcomes import Skipped

    from dstest.worlds.process.refs import _import_module

    known = set(path)
    sys.path[:] = [*path, *(p for p in sys.path if p not in known)]
    _remember_cpu_info()
    _import_module(ref)
    _fresh_process_rng()
    test = pickle.loads(payload)
    location: list[tuple[str, int] | None] = [None]
    run = test.run

    def run_noting_skips(**kwargs: Any) -> Any:
        try:
            return run(**kwargs)
        except Skipped as exc:
            location[0] = _skip_location(exc)
            raise

    test.run = run_noting_skips
    box = _SkipBox()
    with _world_hidden(getattr(test, "set_dist_env", True)) if hide else contextlib.nullcontext():
        returned = getattr(test, _RANK_ENTRY)(ctx.rank, ctx.world_size, port, None, box)
    message = returned if isinstance(returned, str) else box.message
    return (message, location[0] if message else None)


# ------------------------------------------------------------------------------------------------------
# The per-run reset of DeepSpeed's process-global state (entry point of the group dstest.resets)
# ------------------------------------------------------------------------------------------------------

_first_accelerator: list[Any] = []

#: Module globals of DeepSpeed's activation checkpointing and the values a fresh import gives them.
_CHECKPOINTING_DEFAULTS: dict[str, Any] = {
    "deepspeed_checkpointing_enabled": False,
    "mpu": None,
    "mp_rank": 0,
    "mp_size": 1,
    "mp_group": None,
    "num_layers": None,
    "timers": None,
    "PARTITION_ACTIVATIONS": False,
    "CPU_CHECKPOINT": False,
    "CONTIGUOUS_CHECKPOINTING": False,
    "SYNCHRONIZE": False,
    "PROFILE_TIME": False,
    "_cpu_offload_engine": None,
    "_checkpoint_grad_enabled": True,
}
_CHECKPOINTING_LISTS = ("contiguous_data_buffers", "data_offsets", "contiguous_size_buffers", "size_offsets")


def reset_deepspeed() -> None:
    """Put DeepSpeed's process-global state back to what a fresh process has (nothing when DeepSpeed was
    never imported here): the communication backend (``deepspeed.comm``), the process groups cached in
    ``deepspeed.utils.groups``, an open ZeRO-3 ``Init`` context, its buffers and its replacement of
    ``torch.nn.functional.linear``, activation checkpointing's
    configuration and buffers, and the accelerator if a test replaced it."""
    if "deepspeed" not in sys.modules:
        return
    comm: Any = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        for name in ("cdb", "nccl_backend", "mpi_backend", "ccl_backend", "hccl_backend"):
            if hasattr(comm, name):
                setattr(comm, name, None)
        logger = getattr(comm, "comms_logger", None)
        if logger is not None and hasattr(comm, "CommsLogger"):  # in place: other modules hold the object
            logger.__dict__.clear()
            logger.__dict__.update(comm.CommsLogger().__dict__)
        summary = getattr(comm, "timer_summary", None)
        if isinstance(summary, dict):
            summary.clear()
    groups: Any = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and hasattr(groups, "_release_process_group_references"):
        groups._release_process_group_references(group=None)
    zero: Any = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if zero is not None:
        zero.shutdown_init_context()
        zero.zero_init_context = 0
        zero.top_level_context = None
        zero.empty_buffers.clear()
        zero.temp_contiguous_tensor = None
        # Init's memory-efficient linear replaces torch.nn.functional.linear for the rest of the process
        # ("This will persist unless manually reset") and keeps the original on a class attribute.
        inserter = getattr(zero, "InsertPostInitMethodToModuleSubClasses", None)
        if inserter is not None and "linear_bk" in vars(inserter):
            delattr(inserter, "linear_bk")
        import torch

        if torch.nn.functional.linear is not torch._C._nn.linear:
            torch.nn.functional.linear = torch._C._nn.linear
    checkpointing: Any = sys.modules.get("deepspeed.runtime.activation_checkpointing.checkpointing")
    if checkpointing is not None:
        for name, value in _CHECKPOINTING_DEFAULTS.items():
            if hasattr(checkpointing, name):
                setattr(checkpointing, name, value)
        for name in _CHECKPOINTING_LISTS:
            if hasattr(checkpointing, name):
                setattr(checkpointing, name, [])
    accelerator: Any = sys.modules.get("deepspeed.accelerator.real_accelerator")
    if accelerator is not None and getattr(accelerator, "ds_accelerator", None) is not None:
        if not _first_accelerator:
            _first_accelerator.append(accelerator.ds_accelerator)
        elif accelerator.ds_accelerator is not _first_accelerator[0]:
            accelerator.ds_accelerator = _first_accelerator[0]
        _reset_memory_peak(accelerator.ds_accelerator)


def _reset_memory_peak(accelerator: Any) -> None:
    """The accelerator's peak-memory figure starts afresh, as in a new process: the CPU accelerator keeps
    the peak resident size since it was created (``max_mem``, what ``max_memory_allocated`` reports), so a
    warm worker would report the peak of an earlier test; a CUDA device's peak is torch's to reset."""
    import torch

    if getattr(accelerator, "_name", None) == "cpu":
        accelerator.reset_peak_memory_stats()
    elif torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.reset_peak_memory_stats()
