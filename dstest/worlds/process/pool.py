"""One pool: ``world_size`` warm workers sharing one process group, serving one run at a time, and what a
run's failure reports (tracebacks, stacks, the output of dead ranks).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import selectors
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import dstest.trace as _trace
from dstest.errors import (
    InvalidArgument,
    RankFailure,
    StateLeftBehind,
    WorkerDied,
    WorldAborted,
    WorldTimeout,
)
from dstest.resets import registered as registered_resets
from dstest.worlds import build_locks
from dstest.worlds.core.faults import Killed, not_fired_error, not_fired_note
from dstest.worlds.process.launch import _free_port, _mp_context, _threads_per_rank, start_fork_server
from dstest.worlds.process.messages import _STOP, _Command, _FnRef, _PoolKey, _Reply, _unpickle_exception, _WorkerConfig
from dstest.worlds.process.referee import _Referee
from dstest.worlds.process.worker import _worker_main
from dstest.worlds.request import RunRequest
from dstest.worlds.stopping import format_stacks

#: Seconds a pool may take to start and form its group (a cold fork server imports torch first).
POOL_START_TIMEOUT = 180.0
#: After one rank fails, seconds the others get to finish before the pool counts as poisoned (they are
#: probably blocked in a collective that the failed rank will never join) and is replaced.
FAILURE_GRACE = 1.0


#: Seconds to wait for faulthandler's dump after signalling a worker.
_STACK_WAIT_S = 1.0


# ------------------------------------------------------------------------------------------------------
# Parent side: the pools
# ------------------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, rank: int, process: Any, conn: Connection, cfg: _WorkerConfig, check: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.cfg = cfg
        self.check = check  # calls to check and verdicts (gloo pools; unused by NCCL ones)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "is still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def output_since(self, offset: int, limit: int = 8000) -> str:
        """What this worker printed from ``offset`` of its log on (the last ``limit`` bytes of it)."""
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(offset, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, limit: int = 4000) -> str:
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class _Pool:
    """``world_size`` warm workers sharing one process group; serves one run at a time."""

    def __init__(self, key: _PoolKey, world_name: str) -> None:
        self.key = key
        self.world_name = world_name
        self.lock = threading.Lock()
        self.workers: list[_Worker] = []
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

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> _Pool:
        """Launch the workers and return at once; they form the group in the background."""
        self.dir = tempfile.mkdtemp(prefix=f"dstest-{self.key.backend}-ws{self.key.world_size}-")
        store_path = os.path.join(self.dir, "store")
        port = _free_port()
        threads = _threads_per_rank(self.key.world_size)
        # The parent's environment as it is now, as a spawned child would get it (a forkserver child
        # would otherwise get the environment of the moment the fork server started).
        base_env = dict(os.environ)
        configs = []
        for rank in range(self.key.world_size):
            env = base_env | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.key.world_size),
                "LOCAL_WORLD_SIZE": str(self.key.world_size),
                "MASTER_ADDR": "127.0.0.1",  # for code that reads them (DeepSpeed); rendezvous uses the store
                "MASTER_PORT": str(port),
            }
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            configs.append(
                _WorkerConfig(
                    key=self.key,
                    rank=rank,
                    world_name=self.world_name,
                    store_path=store_path,
                    log_path=os.path.join(self.dir, f"rank{rank}.log"),
                    stack_path=os.path.join(self.dir, f"rank{rank}.stack"),
                    parent_pid=os.getpid(),
                    env=env,
                )
            )
        self.started_at = time.monotonic()
        start_fork_server()  # here, not on the launcher thread: it sets an environment variable for a moment
        # Launching blocks while a fresh fork server imports torch; do it off the caller's thread.
        self.launcher = threading.Thread(target=self._launch, args=(configs,), name="dstest-pool-launch", daemon=True)
        self.launcher.start()
        return self

    def _launch(self, configs: list[_WorkerConfig]) -> None:
        try:
            ctx = _mp_context()
            for cfg in configs:
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                parent_check, child_check = ctx.Pipe(duplex=True)  # the cross-rank check's channel
                process = ctx.Process(
                    target=_worker_main,
                    args=(cfg, child_conn, child_check),
                    name=f"dstest-{self.world_name}-rank{cfg.rank}",
                )
                process.start()
                child_conn.close()
                child_check.close()
                self.workers.append(_Worker(cfg.rank, process, parent_conn, cfg, parent_check))
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
                f"{self._label()}: could not launch the workers: {self.launch_error!r}"
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
                    f"{self._label()}: ranks {stuck} did not form the process group within "
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
                        f"{self._label()}: rank {w.rank} (pid {w.pid}) {w.describe_exit()} while starting "
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
                w.conn.send_bytes(_STOP)
        self._reap(grace=2.0)

    def kill(self) -> None:
        """Kill every worker at once (they may be blocked in a collective that will never complete)."""
        self._join_launcher()
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
        self._reap(grace=5.0)

    def _reap(self, grace: float) -> None:
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
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if not self.closed]

    # -- one run -------------------------------------------------------------------------------------------
    def run(self, ref: _FnRef, request: RunRequest, recorder: _trace.Recorder) -> list[Any]:
        """Run ``request`` (its function sent as ``ref``) on every worker. On any failure that leaves the pool
        unusable, the pool is closed: the caller replaces it (``self.closed`` tells)."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks in the message, not this frame
        self.wait_ready()
        run_id = next(self.run_ids)
        command = _Command(
            run_id,
            ref,
            tuple(request.args),
            request.call_kwargs(),
            request.seed,
            request.setup,
            registered_resets(),
            request.watch_modules,
            tuple(request.faults),
        )
        try:
            blob = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise InvalidArgument(
                f"the process world sends args and kwargs to its workers by pickle; those of "
                f"{ref.qualname} do not pickle ({type(exc).__name__}: {exc})"
            ) from exc
        W = self.key.world_size
        log_starts = {w.rank: _file_size(w.cfg.log_path) for w in self.workers}
        killed: dict[int, Any] = {}  # ranks an injected Kill ended -> the fault (contract G5)
        tallies: dict[int, Any] = {}  # their fault counters (RankFaults) when they died
        try:
            replies, dead, first_failure = self._exchange(
                run_id, blob, request.timeout, request.strict_shapes, killed, tallies
            )
        except BaseException:
            self.kill()  # interrupted (Ctrl-C) mid-run: only a fresh pool is in a known state
            raise
        for r in sorted(replies):
            _forward_output(r, replies[r].output)
        _take_traces(replies, recorder)
        _warn_state_left_behind(ref, replies)
        if dead or len(replies) + len(killed) < W:
            self._raise_incomplete(ref, request.timeout, replies, dead, first_failure, log_starts, recorder)
        unhealthy = {r: rep.unhealthy for r, rep in replies.items() if rep.unhealthy}
        if unhealthy or killed:
            self.stop()  # the caller starts a fresh pool for the next run
        tallies.update((r, rep.faults) for r, rep in replies.items())
        if any(not rep.ok for rep in replies.values()):
            note = _fault_note(request.faults, killed) + not_fired_note(tallies.values())
            raise _rank_failure(self._label(), W, replies, {}, pool_replaced=bool(unhealthy or killed), note=note)
        not_fired = not_fired_error(tallies.values())
        if not_fired is not None:
            raise not_fired
        results: list[Any] = []
        for r in range(W):
            if r in killed:
                results.append(Killed(r, killed[r].at()))
                continue
            try:
                results.append(pickle.loads(replies[r].result or b""))
            except Exception as exc:
                raise RankFailure(
                    f"{self._label()}: the result of rank {r} could not be unpickled in the parent "
                    f"({type(exc).__name__}: {exc})",
                    {r: traceback.format_exc()},
                    {r: exc},
                ) from exc
        self.last_used = time.monotonic()
        return results

    def _raise_incomplete(
        self,
        ref: _FnRef,
        timeout: float,
        replies: dict[int, _Reply],
        dead: list[Any],
        first_failure: Any,
        log_starts: dict[int, int],
        recorder: _trace.Recorder,
    ) -> None:
        """A run some worker did not answer: a worker died (:class:`WorkerDied`), or ranks ran past the
        timeout or stayed blocked after a failure; the pool is killed either way."""
        __tracebackhide__ = True
        W = self.key.world_size
        label = self._label()
        if dead:
            for d in dead:
                d.process.join(1.0)
            others = self._collect_quietly(replies)
            _take_traces({r: rep for r, rep in others.items() if r not in replies}, recorder)
            names = ", ".join(f"rank {d.rank} (pid {d.pid}) {d.describe_exit()}" for d in dead)
            outputs = "".join(
                f"---- output of rank {d.rank} during the run ----\n{d.output_since(log_starts[d.rank])}\n"
                for d in dead
            )
            failed = {r: rep.traceback for r, rep in others.items() if not rep.ok}
            detail = "".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(failed.items()))
            self.kill()
            raise WorkerDied(f"{label}: {names} while running {ref.qualname}; the pool was replaced\n{outputs}{detail}")
        missing = [w for w in self.workers if w.rank not in replies]
        if missing:  # always, when no worker died
            stacks = self._stacks(missing)
            # Ranks waiting on a torch extension's build lock or building: surveyed while they live (to name a
            # holder by rank), reported after the kill, which releases the locks they held (issue 40).
            builds = build_locks.survey(stacks, pids={w.rank: w.pid for w in self.workers})
            for w in missing:
                out = w.output_since(log_starts[w.rank])
                if out:
                    stacks[w.rank] = stacks.get(w.rank, "(no stack)\n") + f"-- output during the run --\n{out}"
            self.kill()
            headline = "" if builds is None else f"; {builds.headline()}"
            notes = "" if builds is None else builds.report(stopped=True) + "\n"
            if first_failure is None:
                raise WorldTimeout(
                    f"{label} ran {ref.qualname} past its timeout of {timeout:g} s; ranks still running: "
                    f"{[w.rank for w in missing]}; the pool was replaced{headline}\n{notes}" + format_stacks(stacks),
                    stacks,
                )
            aborted = {
                w.rank: (
                    f"rank {w.rank} did not finish within {FAILURE_GRACE:g} s of the failure (blocked in a "
                    f"collective the failed rank never joined?) and was stopped{headline}; its stack:\n"
                    + notes
                    + stacks.get(w.rank, "(no stack)\n")
                )
                for w in missing
            }
            raise _rank_failure(label, W, replies, aborted, pool_replaced=True)

    def _exchange(
        self,
        run_id: int,
        blob: bytes,
        timeout: float,
        strict_shapes: bool,
        killed: dict[int, Any],
        tallies: dict[int, Any],
    ) -> tuple[dict[int, _Reply], list[_Worker], float | None]:
        """Send the run to every worker and gather replies until all came, one died, the run timed out, or
        the others had FAILURE_GRACE seconds after a failure. A worker that an injected Kill ended (it told
        the referee first) goes into ``killed``, not ``dead``: the run goes on without it; its fault counters
        go into ``tallies``."""
        deadline = time.monotonic() + timeout
        replies: dict[int, _Reply] = {}
        dead: list[_Worker] = []
        first_failure: float | None = None
        for w in self.workers:
            try:
                w.conn.send_bytes(blob)
            except (EOFError, OSError):
                dead.append(w)
        referee = None
        # One selector for the whole run (multiprocessing's wait() builds and fills one per call, 3 W
        # registrations for every message the referee gets): its check channels, then each worker's reply
        # pipe and process sentinel until that worker replied.
        with selectors.DefaultSelector() as sel:
            if self.key.backend == "gloo":  # its workers' groups post every call to this run's referee
                referee = _Referee(
                    run_id,
                    len(self.workers),
                    [w.check for w in self.workers],
                    strict_shapes=strict_shapes,
                )
                for w in self.workers:
                    sel.register(w.check, selectors.EVENT_READ, ("check", w))
            for w in self.workers:
                if w not in dead:
                    sel.register(w.conn, selectors.EVENT_READ, ("reply", w))
                    sel.register(w.process.sentinel, selectors.EVENT_READ, ("exit", w))
            while len(replies) + len(killed) < len(self.workers) and not dead:
                limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE)
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    break
                ready = [key.data for key, _ in sel.select(remaining)]
                for kind, w in ready:  # the referee first: a verdict may be what a reply waits for
                    if kind == "check" and referee is not None:
                        self._referee_messages(referee, w)
                for kind, w in ready:
                    if kind != "reply" or w.rank in replies:
                        continue
                    try:
                        reply: _Reply = pickle.loads(w.conn.recv_bytes())
                    except (EOFError, OSError):
                        continue
                    if reply.run_id != run_id:
                        continue  # cannot happen while pools are killed on interruption; never mix runs up
                    replies[w.rank] = reply
                    sel.unregister(w.conn)
                    sel.unregister(w.process.sentinel)
                    if not reply.ok and first_failure is None:
                        first_failure = time.monotonic()
                for kind, w in ready:
                    if kind == "exit" and w.rank not in replies and w not in dead and w.rank not in killed:
                        if referee is not None:
                            self._referee_messages(referee, w)  # its last words: an injected Kill?
                        if referee is not None and w.rank in referee.killed:
                            killed[w.rank] = referee.killed[w.rank]
                            if w.rank in referee.tallies:
                                tallies[w.rank] = referee.tallies[w.rank]
                            sel.unregister(w.conn)
                            sel.unregister(w.process.sentinel)
                        else:
                            dead.append(w)
        return replies, dead, first_failure

    @staticmethod
    def _referee_messages(referee: _Referee, w: _Worker) -> None:
        """Hand the referee everything worker ``w`` has posted so far."""
        try:
            while w.check.poll(0):
                referee.handle(w.rank, w.check.recv_bytes())
        except (EOFError, OSError):
            pass  # the worker died: its sentinel reports it

    def _collect_quietly(self, replies: dict[int, _Reply]) -> dict[int, _Reply]:
        """Replies that other ranks had already sent when one died (for the report)."""
        out = dict(replies)
        for w in self.workers:
            if w.rank in out:
                continue
            with contextlib.suppress(Exception):
                if w.conn.poll(0.2):
                    out[w.rank] = pickle.loads(w.conn.recv_bytes())
        return out

    def _stacks(self, workers: list[_Worker]) -> dict[int, str]:
        """Every listed worker's Python stacks, dumped by faulthandler on SIGUSR1."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        sizes = {}
        for w in workers:
            sizes[w.rank] = _file_size(w.cfg.stack_path)
            with contextlib.suppress(OSError):
                os.kill(w.pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_WAIT_S
        stacks: dict[int, str] = {}
        last: dict[int, int] = {}
        while time.monotonic() < end and len(stacks) < len(workers):
            time.sleep(0.05)
            for w in workers:
                if w.rank in stacks:
                    continue
                size = _file_size(w.cfg.stack_path)
                if size > sizes[w.rank] and last.get(w.rank) == size:  # grew, then stayed put: dump done
                    with open(w.cfg.stack_path, "rb") as f:
                        f.seek(sizes[w.rank])
                        stacks[w.rank] = _without_watcher(f.read().decode(errors="replace"))
                last[w.rank] = size
        return stacks

    def _label(self) -> str:
        return f"{self.world_name} world of {self.key.world_size} ranks ({self.key.backend})"

    def _logs(self, ranks: list[int]) -> str:
        return "".join(f"---- output of rank {r} ----\n{self.workers[r].log_tail()}\n" for r in ranks)


def _rank_failure(
    label: str,
    world_size: int,
    replies: dict[int, _Reply],
    aborted: dict[int, str],
    *,
    pool_replaced: bool,
    note: str = "",
) -> RankFailure:
    failed = {r: rep for r, rep in replies.items() if not rep.ok}
    exceptions: dict[int, BaseException] = {}
    for r, rep in failed.items():
        exceptions[r] = _unpickle_exception(rep)
    for r, text in aborted.items():
        exceptions[r] = WorldAborted(text.splitlines()[0])
    # The first real error first: ranks that were only aborted because of it come after it.
    order = sorted(failed, key=lambda r: (isinstance(exceptions[r], WorldAborted), r))
    head = "; ".join(f"rank {r}: {type(exceptions[r]).__name__}: {exceptions[r]}".splitlines()[0] for r in order)
    body = "\n".join(f"---- rank {r} ----\n{failed[r].traceback}" for r in order)
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{text}" for r, text in sorted(aborted.items()))
    if pool_replaced:
        tail += "\nthe worker pool was replaced"
    tail += note
    tracebacks = {r: rep.traceback for r, rep in failed.items()} | aborted
    return RankFailure(
        f"{len(failed)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )


def _warn_state_left_behind(ref: _FnRef, replies: dict[int, _Reply]) -> None:
    """One :class:`StateLeftBehind` warning for what the run changed in watched modules, on any rank."""
    found = sorted({item for rep in replies.values() for item in rep.left_behind})
    if found:
        import warnings

        warnings.warn(
            StateLeftBehind(
                f"{ref.qualname} left module-level state behind in the warm workers (put back before the next "
                "run; a fresh process would not have seen it): " + "; ".join(found)
            ),
            stacklevel=2,
        )


def _fault_note(faults: Any, killed: dict[int, Any]) -> str:
    """For a failure report: the run's injected faults (contract G5), and the ranks a Kill ended."""
    if not faults:
        return ""
    dead = f" (ranks {sorted(killed)} were killed)" if killed else ""
    return "\ninjected faults of the run: " + "; ".join(f.describe() for f in faults) + dead


def _take_traces(replies: dict[int, _Reply], recorder: _trace.Recorder) -> None:
    """The ranks' collective records, into the recorder of the run (see ``_trace.world_run``)."""
    for r, rep in sorted(replies.items()):
        if rep.trace is not None:
            records, totals = rep.trace
            recorder.merge(r, records, totals)


def _forward_output(rank: int, text: str) -> None:
    """What a rank printed, to this process's stdout (pytest captures it per test, as in the threaded world)."""
    if not text:
        return
    lines = text.splitlines()
    sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in lines))


def _without_watcher(dump: str) -> str:
    """A faulthandler dump without the worker's own parent-watch thread (noise in a report)."""
    blocks = dump.split("\n\n")
    return "\n\n".join(b for b in blocks if "in _watch_parent" not in b).strip() + "\n"


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
