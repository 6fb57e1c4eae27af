"""One pool: ``world_size`` warm workers sharing one process group, serving one run at a time: its lifecycle
(launch, ready, stop, kill) and its runs. A run's traffic with the workers is :mod:`~.gather`'s, its reports
:mod:`~.reports`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing.connection import wait
from typing import Any

import dstest.trace as _trace
from dstest.errors import ForkServerSkipped, InvalidArgument, RankFailure, WorkerDied
from dstest.resets import registered as registered_resets
from dstest.worlds.core.faults import Killed, not_fired_error, not_fired_note
from dstest.worlds.process import board
from dstest.worlds.process.gather import FAILURE_GRACE, Gathering
from dstest.worlds.process.handle import WorkerHandle
from dstest.worlds.process.launch import (
    free_port,
    mp_context,
    settle_fork_server,
    start_fork_server,
    threads_per_rank,
)
from dstest.worlds.process.messages import STOP, Command, FnRef, PoolKey, Reply, WorkerConfig
from dstest.worlds.process.reports import (
    fault_note,
    forward_output,
    raise_incomplete,
    rank_failure,
    take_traces,
    warn_state_left_behind,
)
from dstest.worlds.process.worker import worker_main
from dstest.worlds.request import RunRequest

__all__ = ["FAILURE_GRACE", "POOL_START_TIMEOUT", "Pool"]

#: Seconds a pool may take to start and form its group (a cold fork server imports torch first).
POOL_START_TIMEOUT = 180.0


class Pool:
    """``world_size`` warm workers sharing one process group; serves one run at a time."""

    def __init__(self, key: PoolKey, world_name: str) -> None:
        self.key = key
        self.world_name = world_name
        self.lock = threading.Lock()
        self.workers: list[WorkerHandle] = []
        self.ready = False
        self.closed = False
        self.start_failed = False  # not worth replacing at once: the replacement would fail the same way
        self.run_ids = itertools.count(1)
        self.last_used = time.monotonic()
        self.started_at = 0.0
        self.start_seconds: float | None = None  # measured launch-to-ready time
        self.dir = ""
        self.launcher: threading.Thread | None = None
        self.launch_error: BaseException | None = None
        self.board: board.Board | None = None  # the parent's view of the check board (gloo pools)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> Pool:
        """Launch the workers and return at once; they form the group in the background."""
        self.dir = tempfile.mkdtemp(prefix=f"dstest-{self.key.backend}-ws{self.key.world_size}-")
        configs = _worker_configs(self.key, self.world_name, self.dir)
        if self.key.backend == "gloo" and board.available():  # the cross-rank check's shared board
            path = os.path.join(self.dir, "board")
            try:
                board.create(path, self.key.world_size)
                self.board = board.Board(path, self.key.world_size)
            except OSError:  # no board (a file system that cannot map it): every call goes to the referee
                self.board = None
            else:
                configs = [dataclasses.replace(cfg, board_path=path) for cfg in configs]
        self.started_at = time.monotonic()
        cuda = settle_fork_server()  # a fed server imports what it was fed, then serves this pool's workers
        if cuda is not None:
            warnings.warn(ForkServerSkipped(cuda), stacklevel=2)
        start_fork_server()  # here, not on the launcher thread: it sets an environment variable for a moment
        # Launching blocks while a fresh fork server imports torch; do it off the caller's thread.
        self.launcher = threading.Thread(target=self._launch, args=(configs,), name="dstest-pool-launch", daemon=True)
        self.launcher.start()
        return self

    def _launch(self, configs: list[WorkerConfig]) -> None:
        try:
            ctx = mp_context()
            for cfg in configs:
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                parent_check, child_check = ctx.Pipe(duplex=True)  # the cross-rank check's channel
                process = ctx.Process(
                    target=worker_main,
                    args=(cfg, child_conn, child_check),
                    name=f"dstest-{self.world_name}-rank{cfg.rank}",
                )
                process.start()
                child_conn.close()
                child_check.close()
                self.workers.append(WorkerHandle(cfg.rank, process, parent_conn, cfg, parent_check))
        except BaseException as exc:  # reported by wait_ready
            self.launch_error = exc

    def _join_launcher(self) -> None:
        if self.launcher is not None:
            self.launcher.join(max(0.0, self.started_at + POOL_START_TIMEOUT - time.monotonic()))

    def wait_ready(self) -> None:
        if self.ready:
            return
        self._join_launcher()
        if self.launch_error is not None or len(self.workers) < self.key.world_size:
            self.start_failed = True
            self.kill()
            raise WorkerDied(
                f"{self.label()}: could not launch the workers: {self.launch_error!r}"
            ) from self.launch_error
        deadline = self.started_at + POOL_START_TIMEOUT
        waiting = {w.conn: w for w in self.workers}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = sorted(w.rank for w in waiting.values())
                self.start_failed = True
                self.kill()
                raise WorkerDied(
                    f"{self.label()}: ranks {stuck} did not form the process group within "
                    f"{POOL_START_TIMEOUT:g} s of being spawned\n" + self._logs(stuck)
                )
            sentinels = {w.process.sentinel: w for w in self.workers}
            for obj in wait([*waiting, *sentinels], remaining):
                if obj in waiting:
                    w = waiting.pop(obj)
                    try:
                        w.conn.recv()
                    except (EOFError, OSError):
                        waiting[w.conn] = w  # it died; its sentinel reports it
                elif obj in sentinels:
                    w = sentinels[obj]
                    w.process.join(0)
                    # Described before the kill below closes the process objects.
                    message = (
                        f"{self.label()}: rank {w.rank} (pid {w.pid}) {w.describe_exit()} while starting "
                        f"(importing torch and forming the {self.key.backend} group)\n" + self._logs([w.rank])
                    )
                    self.start_failed = True
                    self.kill()
                    raise WorkerDied(message)
        self.ready = True
        self.start_seconds = time.monotonic() - self.started_at

    def stop(self) -> None:
        """Ask every worker to exit, then make sure they have (killing what does not)."""
        self._join_launcher()
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.conn.send_bytes(STOP)
        self.reap(grace=2.0)

    def kill(self) -> None:
        """Kill every worker at once (they may be blocked in a collective that will never complete)."""
        self._join_launcher()
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
        self.reap(grace=5.0)

    def reap(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the workers to exit, kill what is left, and remove the pool's files."""
        self._join_launcher()
        end = time.monotonic() + grace
        for w in self.workers:
            w.process.join(max(0.0, end - time.monotonic()))
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
                w.process.join(5.0)
            with contextlib.suppress(Exception):
                w.conn.close()
            with contextlib.suppress(Exception):
                w.check.close()
            with contextlib.suppress(Exception):
                w.process.close()
        self.closed = True
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if not self.closed]

    # -- one run -------------------------------------------------------------------------------------------
    def run(self, ref: FnRef, request: RunRequest, recorder: _trace.Recorder) -> list[Any]:
        """Run ``request`` (its function sent as ``ref``) on every worker. On any failure that leaves the pool
        unusable, the pool is closed: the caller replaces it (``self.closed`` tells)."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks in the message, not this frame
        self.wait_ready()
        run_id = next(self.run_ids)
        blob = _command(run_id, ref, request)
        log_starts = {w.rank: w.log_size() for w in self.workers}
        run = Gathering(
            self.workers,
            run_id,
            checked=self.key.backend == "gloo",
            strict_shapes=request.strict_shapes,
            board=self.board,
        )
        try:
            run.run(blob, request.timeout)
        except BaseException:
            self.kill()  # interrupted (Ctrl-C) mid-run: only a fresh pool is in a known state
            raise
        replies, killed = run.replies, run.killed
        for r in sorted(replies):
            forward_output(r, replies[r].output)
        take_traces(replies, recorder)
        warn_state_left_behind(ref, replies)
        if run.dead or len(replies) + len(killed) < self.key.world_size:
            raise_incomplete(self, ref, request.timeout, run, log_starts, recorder)
        unhealthy = {r: rep.unhealthy for r, rep in replies.items() if rep.unhealthy}
        if unhealthy or killed:
            self.stop()  # the caller starts a fresh pool for the next run
        run.tallies.update((r, rep.faults) for r, rep in replies.items())
        if any(not rep.ok for rep in replies.values()):
            note = fault_note(request.faults, killed) + not_fired_note(run.tallies.values())
            replaced = bool(unhealthy or killed)
            raise rank_failure(self.label(), self.key.world_size, replies, {}, pool_replaced=replaced, note=note)
        not_fired = not_fired_error(run.tallies.values())
        if not_fired is not None:
            raise not_fired
        results = self._results(replies, killed)
        self.last_used = time.monotonic()
        return results

    def _results(self, replies: dict[int, Reply], killed: dict[int, Any]) -> list[Any]:
        """Every rank's return value, in rank order (a rank an injected Kill ended: :class:`Killed`)."""
        results: list[Any] = []
        for r in range(self.key.world_size):
            if r in killed:
                results.append(Killed(r, killed[r].at()))
                continue
            try:
                results.append(pickle.loads(replies[r].result or b""))
            except Exception as exc:
                raise RankFailure(
                    f"{self.label()}: the result of rank {r} could not be unpickled in the parent "
                    f"({type(exc).__name__}: {exc})",
                    {r: traceback.format_exc()},
                    {r: exc},
                ) from exc
        return results

    def label(self) -> str:
        return f"{self.world_name} world of {self.key.world_size} ranks ({self.key.backend})"

    def _logs(self, ranks: list[int]) -> str:
        return "".join(f"---- output of rank {r} ----\n{self.workers[r].log_tail()}\n" for r in ranks)


def _command(run_id: int, ref: FnRef, request: RunRequest) -> bytes:
    """The run as the workers get it, pickled; a clear error when its arguments do not pickle."""
    command = Command(
        run_id,
        ref,
        tuple(request.args),
        request.call_kwargs(),
        request.seed,
        request.setup,
        registered_resets(),
        request.watch_modules,
        tuple(request.faults),
        request.strict_shapes,
    )
    try:
        return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise InvalidArgument(
            f"the process world sends args and kwargs to its workers by pickle; those of "
            f"{ref.qualname} do not pickle ({type(exc).__name__}: {exc})"
        ) from exc


def _worker_configs(key: PoolKey, world_name: str, directory: str) -> list[WorkerConfig]:
    """What each worker of a new pool starts with: its rank, its files in ``directory``, its environment."""
    store_path = os.path.join(directory, "store")
    port = free_port()
    threads = threads_per_rank(key.world_size)
    # The parent's environment as it is now, as a spawned child would get it (a forkserver child
    # would otherwise get the environment of the moment the fork server started).
    base_env = dict(os.environ)
    configs = []
    for rank in range(key.world_size):
        env = base_env | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(key.world_size),
            "LOCAL_WORLD_SIZE": str(key.world_size),
            "MASTER_ADDR": "127.0.0.1",  # for code that reads them (DeepSpeed); rendezvous uses the store
            "MASTER_PORT": str(port),
        }
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        configs.append(
            WorkerConfig(
                key=key,
                rank=rank,
                world_name=world_name,
                store_path=store_path,
                log_path=os.path.join(directory, f"rank{rank}.log"),
                stack_path=os.path.join(directory, f"rank{rank}.stack"),
                parent_pid=os.getpid(),
                env=env,
            )
        )
    return configs
