"""The launched world: this process is one rank of a world that a launcher started (torchrun, torch elastic).

A launcher (``torchrun --nproc-per-node 8 -m pytest -m gpu``, the same under Slurm or Kubernetes across
nodes) starts one pytest per rank and tells each, through the environment, who it is (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and where the rendezvous store is
(``MASTER_ADDR``/``MASTER_PORT``; under torch elastic the agent hosts it, ``TORCHELASTIC_USE_AGENT_STORE``).
dstest starts no process of its own here: every launched pytest collects the same items, runs them in the
same order (:mod:`dstest.pytest.lockstep`) and, for each run of a spec, joins its peers through that store.

One run at world size N of a launch of W ranks:

* N > W: the spec is skipped, with the reason (:meth:`LaunchedWorld.unavailable_reason`).
* N <= W: ranks 0..N-1 form a fresh default process group of N ranks for the run (a subgroup of the
  first N launched ranks when N < W; ranks N..W-1 run nothing and wait for the run's outcome). The group
  is destroyed when the run ends, so no group of one run reaches the next.
* The backend is NCCL when this node has a CUDA device for every local rank (rank r on
  ``cuda:LOCAL_RANK``), gloo on CPU otherwise; ``DSTEST_LAUNCHED_BACKEND=gloo|nccl`` chooses explicitly.
  Items of the launched world carry the ``gpu`` marker on NCCL and ``cpu`` on gloo.
* The body runs on a thread of each rank; the rank's own thread watches the store. A rank whose body
  raises marks the run failed at once, and the ranks still running stop waiting for it (its group is
  torn down, which fails their pending gloo/NCCL calls). A run past its timeout is stopped on every rank
  with each rank's stack. Every participant then posts its outcome, and every rank (participant or not)
  raises the same :class:`~dstest.errors.RankFailure` (every failing rank's traceback) or
  :class:`~dstest.errors.WorldTimeout` (every hung rank's stack), or returns every rank's result.
* A rank that posts nothing within the timeout plus :data:`REPORT_GRACE_S` (its process is stuck with the
  interpreter lock held, or gone) is named in the report as silent.

The store is used only through short calls (set, get, add, check) polled from the rank's own thread, and
the run's process group gets its own connection to it, so a group forming never delays the watching.

torch-internal (through :mod:`dstest.worlds.torch_internals`): the store classes (``TCPStore``,
``PrefixStore``) and, for NCCL, ``abort_process_group`` to unblock a hung NCCL group; otherwise the public
``torch.distributed`` API (``rendezvous``, ``init_process_group``, ``destroy_process_group``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dstest.errors import DstestError, InvalidArgument, InvalidWorldSize, RankFailure, WorldAborted, WorldTimeout
from dstest.worlds import lifecycle
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest

__all__ = [
    "BACKEND_ENV",
    "REPORT_GRACE_S",
    "Launch",
    "LaunchEnvironment",
    "LaunchedWorld",
    "connect",
    "current_launch",
    "launch_environment",
    "shutdown",
]

#: Chooses the launched world's backend: ``gloo`` or ``nccl`` (default: nccl when every local rank has a GPU).
BACKEND_ENV = "DSTEST_LAUNCHED_BACKEND"
#: Seconds a rank waits past a run's timeout for a peer's outcome before naming it silent.
REPORT_GRACE_S = 10.0
#: Seconds the ranks still running get, after a peer failed, to see their own calls fail and return.
ABORT_GRACE_S = 3.0
#: Seconds to connect to the launcher's store at start.
CONNECT_TIMEOUT_S = 120.0
#: The variables that say "this process was launched as one rank of a world".
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class LaunchEnvironment:
    """Who this process is in the launch, read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    #: Distinguishes launches (and torch elastic restarts) that share one store.
    tag: str


def _int_variable(env: dict[str, str], name: str, default: int | None, low: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise InvalidArgument(f"{name} is not set; a launcher (torchrun) sets it for every rank")
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"{name}={text!r}: must be an int >= {low} (the launcher sets it)") from None
    if value < low:
        raise InvalidArgument(f"{name}={text!r}: must be an int >= {low} (the launcher sets it)")
    return value


def launch_environment(env: dict[str, str] | None = None) -> LaunchEnvironment | None:
    """This process's place in a launch, or None when no launcher started it (no ``RANK``/``WORLD_SIZE``).

    Imports no torch. A launch that sets some of the variables, or values that are not ranks, raises
    :class:`~dstest.errors.InvalidArgument` naming the variable, the value and what is allowed.
    """
    env = dict(os.environ if env is None else env)
    present = [name for name in _LAUNCH_VARIABLES if env.get(name)]
    if not present and not env.get("TORCHELASTIC_RUN_ID"):
        return None
    missing = [name for name in _LAUNCH_VARIABLES if not env.get(name)]
    if missing:
        raise InvalidArgument(
            f"launched world: {', '.join(present) or 'TORCHELASTIC_RUN_ID'} set but {', '.join(missing)} not; "
            "start pytest with a launcher that sets all of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
            "(torchrun does), or unset them to run without one"
        )
    world_size = _int_variable(env, "WORLD_SIZE", None, 1)
    rank = _int_variable(env, "RANK", None, 0)
    if rank >= world_size:
        raise InvalidArgument(f"RANK={rank}: must be < WORLD_SIZE={world_size}")
    local_world_size = _int_variable(env, "LOCAL_WORLD_SIZE", 1, 1)
    local_rank = _int_variable(env, "LOCAL_RANK", 0, 0)
    if local_rank >= local_world_size:
        raise InvalidArgument(f"LOCAL_RANK={local_rank}: must be < LOCAL_WORLD_SIZE={local_world_size}")
    port = _int_variable(env, "MASTER_PORT", None, 1)
    if port > 65535:
        raise InvalidArgument(f"MASTER_PORT={port}: must be a TCP port, 1-65535")
    tag = f"{env.get('TORCHELASTIC_RUN_ID', 'static')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return LaunchEnvironment(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=env["MASTER_ADDR"],
        master_port=port,
        tag=tag,
    )


def backend_name(local_world_size: int = 1) -> str:
    """``gloo`` or ``nccl``: :data:`BACKEND_ENV` if set, else nccl when this node has a GPU per local rank."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise InvalidArgument(f"{BACKEND_ENV}={chosen!r}: allowed values are 'gloo' and 'nccl'")
        return chosen
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


@dataclass
class Launch:
    """This rank's connection to a launch: the store, the run counter, the ranks known lost.

    One per process (a process is one rank of one launch); :func:`connect` makes it.
    """

    env: LaunchEnvironment
    backend: str
    store: Any  # the launcher's store, used by this rank's own thread only
    pg_store: Any  # a second connection, for the process groups of runs
    device: Any
    prefix: str
    item: tuple[int, str] = (-1, "")
    runs_in_item: int = 0
    lost: dict[int, str] = field(default_factory=dict)
    broken: str | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def begin_item(self, index: int, nodeid: str) -> None:
        """The pytest item now running on every rank (run keys are per item, so a rank that skipped a
        run, a failed setup say, never pairs its next run with a peer's earlier one)."""
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:12]
        self.item = (index, digest)
        self.runs_in_item = 0

    def next_run_key(self) -> str:
        index, digest = self.item
        self.runs_in_item += 1
        return self.key("run", f"{index}-{digest}", self.runs_in_item) + "/"

    # -- short store calls ---------------------------------------------------------------------------
    def post(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def get(self, key: str) -> bytes:
        value: bytes = self.store.get(key)
        return value

    def count(self, key: str, add: int = 0) -> int:
        value: int = self.store.add(key, add)
        return value

    def wait_for(self, keys: Sequence[str], deadline: float, stop: Callable[[], bool] | None = None) -> list[str]:
        """Poll until every key exists or ``deadline`` (monotonic) passes; returns the keys still missing."""
        pending = list(keys)
        pause = 0.001
        while pending and not self.store.check(pending):
            if time.monotonic() >= deadline or (stop is not None and stop()):
                return [k for k in pending if not self.has(k)]
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return []


_LOCK = threading.Lock()
_LAUNCH: list[Launch] = []


def current_launch() -> Launch | None:
    """The launch this process is connected to, if :func:`connect` ran."""
    return _LAUNCH[0] if _LAUNCH else None


def connect(timeout: float = CONNECT_TIMEOUT_S) -> Launch:
    """Join the launcher's rendezvous store (once per process); raises if no launcher started this process."""
    with _LOCK:
        if _LAUNCH:
            return _LAUNCH[0]
        env = launch_environment()
        if env is None:
            raise InvalidWorldSize(
                "the launched world needs a launcher: start pytest under torchrun "
                "(torchrun --nproc-per-node 2 -m pytest ...), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        import datetime

        import torch
        from torch.distributed.rendezvous import rendezvous

        from dstest.worlds.torch_internals import tcp_client_store

        backend = backend_name(env.local_world_size)
        if backend == "nccl":
            device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        wait = datetime.timedelta(seconds=timeout)
        # env:// makes rank 0 host the store unless the torch elastic agent already does; the second
        # connection is a plain client of whichever it is.
        store, _, _ = next(rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=wait))
        pg_store = tcp_client_store(env.master_addr, env.master_port, wait)
        launch = Launch(
            env=env, backend=backend, store=store, pg_store=pg_store, device=device, prefix=f"dstest/{env.tag}/"
        )
        _LAUNCH.append(launch)
        lifecycle.keep("launch", shutdown)
        return launch


def shutdown() -> None:
    """Forget the launch (the store connections close with their objects)."""
    with _LOCK:
        _LAUNCH.clear()


class LaunchedWorld:
    """Runs a function on the first ``world_size`` ranks of the launch this process belongs to."""

    name = "launched"
    #: The launcher's processes run the backend as it is: dstest checks, poisons and injects nothing there.
    capabilities = Capabilities()

    @property
    def marker(self) -> str:
        env = launch_environment()
        return "gpu" if backend_name(env.local_world_size if env else 1) == "nccl" else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        env = launch_environment()
        if env is None:
            return (
                "the launched world needs a launcher: run pytest under torchrun "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set)"
            )
        if world_size > env.world_size:
            return f"needs {world_size} launched ranks, the launcher started {env.world_size}"
        return None

    def close(self) -> None:
        """Forget the launch this process belongs to (its store connections close with it)."""
        shutdown()

    def run(self, request: RunRequest) -> list[Any]:
        self.capabilities.refuse(request, self.name)
        world_size, timeout = request.world_size, request.timeout
        launch = connect()
        if world_size > launch.world_size:
            raise InvalidWorldSize(
                f"world_size={world_size!r}: the launcher started {launch.world_size} ranks; run with "
                f"--nproc-per-node (times nodes) >= {world_size}"
            )
        key = launch.next_run_key()
        if launch.broken is not None:
            raise LaunchBroken(f"launched world on rank {launch.rank}: {launch.broken}")
        lost = sorted(r for r in launch.lost if r < world_size)
        if lost:
            raise LaunchBroken(f"launched world: ranks {lost} stopped answering earlier ({launch.lost[lost[0]]})")
        label = f"launched world of {world_size} of {launch.world_size} ranks ({launch.backend})"
        __tracebackhide__ = True
        if launch.rank < world_size:
            _Run(launch, key, request).execute()
        return _combine(launch, key, world_size, timeout, label)


class LaunchBroken(DstestError, RuntimeError):
    """The launched world cannot run more: a rank stopped answering, or a run's group could not be torn down."""


# -- one run on this rank ----------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class _Outcome:
    """What a participant posts for a run: ``ok`` with its pickled result, or its traceback and exception."""

    rank: int
    ok: bool
    result: bytes | None = None
    traceback: str = ""
    exception: bytes | None = None
    kind: str = "failed"  # failed | timeout | aborted

    def __repr__(self) -> str:
        return f"<rank {self.rank}: {'ok' if self.ok else self.kind}>"


class _Run:
    def __init__(
        self,
        launch: Launch,
        key: str,
        request: RunRequest,
    ) -> None:
        self.launch, self.key, self.request = launch, key, request
        self.world_size, self.timeout, self.seed = request.world_size, request.timeout, request.seed
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.formed = False

    def execute(self) -> None:
        launch, rank = self.launch, self.launch.rank
        thread = threading.Thread(target=self._body, name=f"dstest-launched-r{rank}", daemon=True)
        deadline = time.monotonic() + self.timeout
        thread.start()
        failed_key = self.key + "failed"
        stopped = ""
        pause = 0.001
        while not self.done.wait(pause):
            pause = min(pause * 2, 0.05)
            if launch.has(failed_key):
                stopped = "aborted"
                break
            if time.monotonic() >= deadline:
                stopped = "timeout"
                break
        if not stopped and self.error is not None and launch.has(failed_key):
            # The body ended with an error after a peer had failed: the peer posts its failure before it
            # tears its group down, which is what failed this rank's pending call (gloo). A consequence.
            outcome = _failure(rank, self.error, "aborted", note=f"rank {rank} stopped because another rank failed\n")
        elif not stopped:
            if self.error is not None:
                launch.post(failed_key, str(rank).encode())
            outcome = self._finished()
        else:
            outcome = self._stop(thread, stopped)
        self._teardown(thread)
        launch.post(self.key + f"out/{rank}", pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))

    def _body(self) -> None:
        import datetime
        import random

        import torch
        import torch.distributed as dist

        from dstest.context import RankContext, rank_seed

        launch, rank = self.launch, self.launch.rank
        try:
            from dstest.worlds.torch_internals import prefix_store

            store = prefix_store(self.key + "pg/", launch.pg_store)
            dist.init_process_group(
                launch.backend,
                store=store,
                rank=rank,
                world_size=self.world_size,
                # Past the run's timeout the watching thread has already reported; the backend's own
                # timeout only has to end calls that nothing else ends.
                timeout=datetime.timedelta(seconds=self.timeout + REPORT_GRACE_S),
                device_id=launch.device if launch.backend == "nccl" else None,
            )
            self.formed = True
            ctx = RankContext(
                rank=rank, world_size=self.world_size, world="launched", device=launch.device, seed=self.seed
            )
            # A process owns its global RNGs: seed them as the process world does (E5).
            torch.manual_seed(rank_seed(self.seed, rank))
            random.seed(rank_seed(self.seed, rank))
            token = ctx.bind()
            try:
                self.value = self.request.rank_call(ctx)
            finally:
                RankContext.unbind(token)
        except BaseException as exc:  # every outcome is reported to the peers
            self.error = exc
        finally:
            self.done.set()

    def _finished(self) -> _Outcome:
        rank = self.launch.rank
        if self.error is None:
            try:
                blob = pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                err = TypeError(
                    f"rank {rank} returned {type(self.value).__name__} {self.value!r:.200}, which cannot be "
                    f"pickled to the other ranks ({type(exc).__name__}: {exc}); return picklable values"
                )
                self.launch.post(self.key + "failed", str(rank).encode())
                return _failure(rank, err, "failed")
            return _Outcome(rank, True, result=blob)
        return _failure(rank, self.error, "failed")

    def _stop(self, thread: threading.Thread, why: str) -> _Outcome:
        """The run ended for this rank without its body finishing: a peer failed, or the timeout passed."""
        from dstest.worlds.stopping import stacks_of

        rank = self.launch.rank
        if why == "aborted":
            # The failed peer tears its group down, which fails this rank's pending call: give the body
            # the chance to return by itself before it is reported as stopped.
            self._abort_group()
            if self.done.wait(ABORT_GRACE_S):
                err = self.error if self.error is not None else WorldAborted("a peer failed")
                return _failure(rank, err, "aborted", note=f"rank {rank} stopped because another rank failed\n")
        stack = stacks_of([thread]).get(0, "(no stack: the thread ended)\n")
        if why == "timeout":
            text = f"rank {rank} was still running after the run's timeout of {self.timeout:g} s; its stack:\n{stack}"
        else:
            text = f"rank {rank} did not stop within {ABORT_GRACE_S:g} s of another rank's failure; its stack:\n{stack}"
        return _Outcome(rank, False, traceback=text, exception=None, kind=why)

    def _abort_group(self) -> None:
        """Make the run's pending NCCL calls return (gloo calls fail when a peer's group closes)."""
        if self.launch.backend != "nccl" or not self.formed:
            return
        from dstest.worlds.torch_internals import abort_process_group

        with contextlib.suppress(Exception):
            abort_process_group()

    def _teardown(self, thread: threading.Thread) -> None:
        """Destroy the run's groups; a body still running is interrupted and its group abandoned."""
        from dstest.worlds.stopping import reap

        if thread.is_alive():
            self._abort_group()
            reap([thread], ABORT_GRACE_S)  # WorldAborted is raised into it when it next runs Python code
        closer = threading.Thread(target=_destroy_groups, name="dstest-launched-teardown", daemon=True)
        closer.start()
        closer.join(ABORT_GRACE_S + REPORT_GRACE_S)
        if closer.is_alive():
            self.launch.broken = (
                "the process group of an earlier run could not be destroyed (a rank's thread is still inside "
                "one of its calls); later runs cannot form a group"
            )


def _destroy_groups() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure(rank: int, exc: BaseException, kind: str, note: str = "") -> _Outcome:
    from dstest.worlds.process.messages import pickle_exception

    text = note + "".join(traceback.format_exception(exc))
    return _Outcome(rank, False, traceback=text, exception=pickle_exception(exc), kind=kind)


def _exception_of(outcome: _Outcome) -> BaseException:
    from dstest.worlds.process.messages import Reply, unpickle_exception

    if outcome.kind != "failed":
        return WorldAborted(outcome.traceback.splitlines()[0] if outcome.traceback else outcome.kind)
    reply = Reply(0, outcome.rank, False, None, outcome.traceback, outcome.exception, "", None)
    return unpickle_exception(reply)


def _combine(launch: Launch, key: str, world_size: int, timeout: float, label: str) -> list[Any]:
    """Every participant's outcome of the run (waited for on every rank): the results, or one error.

    The error is built from the posted outcomes only, so every rank raises the same one (and pytest, which
    hides these frames, shows the same report on every rank).
    """
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout + REPORT_GRACE_S
    keys = [key + f"out/{r}" for r in range(world_size)]
    missing = launch.wait_for(keys, deadline)
    outcomes: dict[int, _Outcome] = {}
    for r in range(world_size):
        if keys[r] in missing:
            continue
        outcome = pickle.loads(launch.get(keys[r]))
        outcomes[r] = outcome
    silent = {
        r: (
            f"rank {r} posted no outcome within {timeout + REPORT_GRACE_S:g} s (the run's timeout plus "
            f"{REPORT_GRACE_S:g} s): its process is stuck outside Python or gone; no stack"
        )
        for r in range(world_size)
        if keys[r] in missing
    }
    for r in silent:
        launch.lost[r] = f"rank {r} went silent in a run"
    return _results_or_error(outcomes, silent, world_size, timeout, label)


def _results_or_error(
    outcomes: dict[int, _Outcome], silent: dict[int, str], world_size: int, timeout: float, label: str
) -> list[Any]:
    __tracebackhide__ = True
    bad = {r: o for r, o in outcomes.items() if not o.ok}
    if not bad and not silent:
        return [pickle.loads(outcomes[r].result or b"") for r in range(world_size)]
    failed = {r: o for r, o in bad.items() if o.kind == "failed"}
    hung = {r: o.traceback for r, o in bad.items() if o.kind == "timeout"} | silent
    if not failed and hung:
        stacks = {r: text for r, text in sorted(hung.items())}
        raise WorldTimeout(
            f"{label} ran past its timeout of {timeout:g} s; ranks still running: {sorted(hung)}\n"
            + "\n".join(f"---- rank {r} ----\n{text}" for r, text in stacks.items()),
            stacks,
        )
    exceptions = {r: _exception_of(o) for r, o in bad.items()} | {r: WorldAborted(t) for r, t in silent.items()}
    primary = sorted(failed) or sorted(exceptions)
    consequences = sorted(set(exceptions) - set(primary))
    tracebacks = {r: o.traceback for r, o in bad.items()} | silent
    head = "; ".join(f"rank {r}: {type(exceptions[r]).__name__}: {exceptions[r]}".splitlines()[0] for r in primary)
    body = "\n".join(f"---- rank {r} ----\n{tracebacks[r]}" for r in primary)
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{tracebacks[r]}" for r in consequences)
    raise RankFailure(
        f"{len(primary)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )
