"""The patched launch of DeepSpeed's harness, in the pytest process (:mod:`dstest.compat.deepspeed`).

At collection the plugin finds the harness's executor class (``DistributedExec`` of the checkout's
``tests/unit/common.py``) and replaces its launch step, ``_launch_with_file_store``, with one that pickles
the test instance and runs it on dstest's warm process world, by the warm run every compat plugin shares
(:mod:`dstest.compat._warm_run`; :mod:`dstest.compat._deepspeed_rank` is what each rank runs); a test that
asks for DeepSpeed's own launcher gets the original. The process world is reached only through its public API for compat plugins
(:mod:`dstest.worlds.process.byref`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from dstest.compat._deepspeed_rank import RANK_ENTRY, rank_main
from dstest.compat._warm_run import Elsewhere, PoolSeen, WarmState, patch, restore, run_warm

__all__ = ["LAUNCH", "OWN_WORLD_ATTR", "OWN_WORLD_MARK", "LaunchState", "patch_executors", "restore_executors"]

#: A class attribute (a reason string) that sends a DistributedTest class to DeepSpeed's own launcher.
OWN_WORLD_ATTR = "dstest_own_world"
#: The marker that does the same for one test: ``@pytest.mark.dstest_own_world("why")``.
OWN_WORLD_MARK = "dstest_own_world"

LAUNCH = "_launch_with_file_store"  # DistributedExec._launch_with_file_store(self, request, world_size)


@dataclass
class LaunchState(WarmState):
    """What the plugin keeps for one pytest session, beyond every compat plugin's: the launches on a world the
    test formed itself, and the ports."""

    hidden: list[Elsewhere] = field(default_factory=list)  # ran warm on a world the test formed itself
    ports: dict[int, tuple[int, PoolSeen]] = field(default_factory=dict)  # world size -> (port, its pool)
    given: set[int] = field(default_factory=set)  # every MASTER_PORT this session gave ranks


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


def _executor_of(cls: type) -> type | None:
    """The class in ``cls``'s MRO that defines the harness's launch step, if any."""
    for base in cls.__mro__:
        if LAUNCH in base.__dict__ and RANK_ENTRY in vars(base):
            return base
    return None


def _check_shape(base: type) -> None:
    import inspect

    expected = {LAUNCH: ["self", "request", "world_size"], RANK_ENTRY: ["self", "local_rank", "num_procs"]}
    for name, params in expected.items():
        got = list(inspect.signature(getattr(base, name)).parameters)
        if got[: len(params)] != params:
            raise pytest.UsageError(
                f"dstest.compat.deepspeed adapts to {base.__module__}.{base.__qualname__}.{name}"
                f"({', '.join(params)}, ...), but this checkout's takes ({', '.join(got)}); run without "
                "-p dstest.compat.deepspeed, or with a DeepSpeed checkout whose tests/unit/common.py has that shape"
            )


def patch_executors(state: LaunchState, items: list[pytest.Item]) -> None:
    """Find the harness's executor class (from the collected test classes and the loaded modules) and
    replace its launch step; a DistributedTest whose bases lack the harness's two steps is refused."""
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(cls, "is_dist_test", False) and _executor_of(cls) is None:
            raise pytest.UsageError(
                f"dstest.compat.deepspeed: {item.nodeid} is a DistributedTest, but no class of "
                f"{cls.__qualname__}'s bases defines both {LAUNCH}(self, request, world_size) and "
                f"{RANK_ENTRY}(self, local_rank, num_procs, ...), the two steps of DeepSpeed's harness "
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
            patch(state, base, {LAUNCH: _make_launch(state, base.__dict__[LAUNCH])})


def restore_executors(state: LaunchState) -> None:
    """Put every patched class's own launch step back, and remove the shared-memory segments DeepSpeed's
    ranks left for the ports this session gave them."""
    restore(state)
    _remove_shm_segments(state.given)


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


def _make_launch(state: LaunchState, original: Callable[..., Any]) -> Callable[..., Any]:
    def _launch_with_file_store(self: Any, request: Any, world_size: Any) -> None:
        __tracebackhide__ = True
        sizes = [world_size] if isinstance(world_size, int) else list(world_size)
        nodeid = getattr(getattr(request, "node", None), "nodeid", "?")
        for procs in sizes:
            if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
                raise pytest.UsageError(f"{nodeid}: world_size={world_size!r}: give an int >= 1 or a list of them")
            why = _own_world_reason(self, request)
            if why is not None:
                state.own.append(Elsewhere(nodeid, why, procs))
                with _local_size_at_least(procs):
                    original(self, request, procs)
                continue
            _run_warm(state, self, nodeid, procs)

    return _launch_with_file_store


def _port_for(state: LaunchState, world_size: int) -> int:
    """A MASTER_PORT per pool: DeepSpeed's CPU shared-memory op names its segments after it, so two pools
    alive at once must not share one; a replaced pool gets a new one."""
    from dstest.worlds.process.byref import free_port

    now = PoolSeen.now(world_size)
    known = state.ports.get(world_size)
    if known is None or (known[1].token is not None and known[1].replaced(now)):
        port = free_port()
    else:  # the same pool, or the first one, started during the run that chose the port
        port = known[0]
    state.ports[world_size] = (port, now)
    return port


def _run_warm(state: LaunchState, test: Any, nodeid: str, procs: int) -> None:
    __tracebackhide__ = True
    from dstest.errors import RankFailure, WorkerDied, WorldTimeout
    from dstest.specification import SKIP_LOCATION_ATTR
    from dstest.worlds.process.byref import free_port, module_ref

    try:
        payload = pickle.dumps(test, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{nodeid}: the test instance and its fixture values must pickle to reach the ranks, as they must "
            f"for DeepSpeed's own pool ({type(exc).__name__}: {exc})"
        ) from exc
    module = sys.modules[type(test).__module__]
    ref = module_ref(module)  # the worker imports it as pytest did (its file, assertion rewriting)
    hide = _forms_its_world(test)
    if hide:  # the test's own TCPStore: a port of its own, as the harness gives every launch
        port = free_port()
        state.hidden.append(Elsewhere(nodeid, "forms its own world", procs))
    else:
        port = _port_for(state, procs)
    state.given.add(port)
    try:
        results = run_warm(
            state,
            nodeid,
            rank_main,
            procs,
            (payload, ref, list(sys.path), port, hide),
            timeout=float(getattr(test, "exec_timeout", 600)),
            watch="deepspeed",  # what a test leaves in DeepSpeed's module globals is put back, named
            fresh_after=hide,  # a world of its own always gets fresh workers after
        )
    except (RankFailure, WorldTimeout, WorkerDied) as exc:
        setattr(exc, "_dstest_ds_report", _failure_text(nodeid, exc))  # noqa: B010 (read back by makereport)
        raise
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


def _failure_text(nodeid: str, exc: BaseException) -> str:
    """The report of a failed launch: its first line and each rank's traceback, then what the run's report
    adds (each rank's last calls, where its flight-recorder dumps went), as a spec's report ends."""
    from dstest.trace import run_notes

    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [f"---- rank {r} ----\n{tb}" for r, tb in sorted(failures.items())]
        head = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        notes = run_notes(exc)
        return f"{nodeid}: {head}\n" + "\n".join(parts) + (f"\n{notes}" if notes else "")
    return f"{nodeid}: {type(exc).__name__}: {exc}"
