"""The worker process: its entry point (:func:`worker_main`, started by multiprocessing by reference, so it
must stay importable here), the parent watch, and :class:`_Server`, which serves one run after another.

torch-internal: :class:`_Server` reads and resets ``distributed_c10d._world`` (``pg_map``,
``group_count``) and wraps the default store in a ``PrefixStore`` per run (see ``_begin_run``), so that
the groups of one run never meet those of the next.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dstest.resets import apply as apply_resets
from dstest.worlds.process.checked import install_checking
from dstest.worlds.process.checker import Checker
from dstest.worlds.process.messages import STOP, Command, FnRef, Reply, WorkerConfig, pickle_exception
from dstest.worlds.process.refs import import_ref
from dstest.worlds.protocol import rank_function_of

#: The backend's own collective timeout. The parent enforces the run's timeout by killing the pool, so
#: this only has to be longer than any run; a shorter one would turn hangs into confusing backend errors.
_BACKEND_TIMEOUT_S = 6 * 3600


_OUTPUT_LIMIT = 1 << 20  # bytes of one rank's output forwarded per run


def worker_main(cfg: WorkerConfig, conn: Connection, check_conn: Connection) -> None:
    """Entry point of a worker process: form the group once, then serve runs until told to stop."""
    os.environ.update(cfg.env)  # before torch is imported: OMP_NUM_THREADS, RANK, ...
    read_fd = _redirect_output(cfg)
    _watch(cfg)
    device, checker = _form_group(cfg, check_conn)
    conn.send(("ready", os.getpid()))
    server = _Server(cfg, device, read_fd, checker)
    heap = _Heap()
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if blob == STOP:
            break
        reply = server.serve(blob)
        # Before the reply, not after: the parent hands out the next run when every rank replied, so no
        # rank starts it (and destroys the groups of this one) while another still collects.
        heap.after_run()
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except (EOFError, OSError):
            break
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # No teardown of the group: the parent is stopping every rank at once, and a collective shutdown
    # could wait for ranks that are already gone. The parent removes the store's directory.
    os._exit(0)


def _redirect_output(cfg: WorkerConfig) -> int:
    """This process's stdout and stderr, into the rank's log file (line-buffered); returns a reader of it."""
    log_fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for stream in (sys.stdout, sys.stderr):  # a hung rank's last prints must reach the file
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    return os.open(cfg.log_path, os.O_RDONLY)


def _watch(cfg: WorkerConfig) -> None:
    """Stacks on SIGUSR1 (the parent asks for them at a timeout), exit when the parent is gone, a process
    name, and Ctrl-C left to the parent."""
    import faulthandler

    stack_file = open(cfg.stack_path, "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(
        target=_watch_parent, args=(cfg.parent_pid, os.getppid()), name="dstest-parent-watch", daemon=True
    ).start()
    _name_process(f"dstest-r{cfg.rank}")
    # Ctrl-C in a terminal reaches the whole process group; the parent handles it (and kills the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _form_group(cfg: WorkerConfig, check_conn: Connection) -> tuple[Any, Checker | None]:
    """Import torch, form the world group (checked on gloo) and warm the backend; returns (device, checker)."""
    import datetime

    import torch
    import torch.distributed as dist

    # Imported before this worker's world forms: torch binds `group=group.WORLD` in its functions'
    # defaults when the module is imported, so a first import later binds the group alive then, and a
    # test that forms its own world (torch's bases, DeepSpeed's) would leave it bound for every later test
    # on this worker ("Group ... is not registered"). Here the default is None: the default group of the
    # call, as in a process that imports it before init_process_group.
    import torch.distributed.nn.functional

    if "OMP_NUM_THREADS" in cfg.env:
        torch.set_num_threads(int(cfg.env["OMP_NUM_THREADS"]))
    key = cfg.key
    if key.device == "cuda":
        device = torch.device("cuda", cfg.rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from dstest.worlds.torch_internals import file_store

    checker = None
    if key.backend == "gloo":
        checker = Checker(check_conn, cfg.rank, key.world_size)
        if cfg.board_path:
            # Without the board (it cannot be mapped here) this rank posts every call to the referee; its peers'
            # calls with it then reach the referee too, once they waited the quiet wait for its entry.
            with contextlib.suppress(OSError):
                checker.attach_board(cfg.board_path)
        install_checking(checker)
    dist.init_process_group(
        key.backend,
        store=file_store(cfg.store_path, key.world_size),
        rank=cfg.rank,
        world_size=key.world_size,
        timeout=datetime.timedelta(seconds=_BACKEND_TIMEOUT_S),
        device_id=device if key.device == "cuda" else None,  # NCCL: form the communicator now
    )
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # connect and warm the backend so the first spec pays nothing
    if key.device == "cuda":
        torch.cuda.synchronize()
    # Imported once here rather than by the first run.
    import dstest.context  # noqa: F401

    return device, checker


_REPLACE_AFTER_RUN: list[str] = []


def replace_after_this_run(why: str) -> None:
    """On a rank of the process world, during a run: have this worker replaced once the run ends.

    The run's result is reported as usual; its pool is then stopped and the next run gets fresh
    processes. For code that leaves behind what no reset can take back (a test that formed a world of its
    own leaves its TCPStore listening on its port for as long as anything refers to it).
    """
    _REPLACE_AFTER_RUN.append(why)


class _Heap:
    """Keeps what a warm worker holds for good out of the cyclic collector's scans.

    Every full collection, automatic or a ``gc.collect()`` in the code under test (DeepSpeed calls it in
    ``offload_states``, ``defragment``, ...), scans every tracked object: in a worker that imported
    deepspeed and torch._dynamo some 300,000 of them, 0.2-0.3 s a collection here. Imported modules,
    their functions and classes live as long as the worker, so after a run that imported new modules
    the worker collects the run's garbage once and freezes what is left (``gc.freeze``); later
    collections scan only what later runs create. Whatever a run still holds at that moment (a cache
    in a module) is frozen too: if it later becomes cyclic garbage, its memory stays with the worker
    until the pool is replaced. Reference counting frees everything else as before.
    """

    def __init__(self) -> None:
        gc.freeze()  # the warm-up's imports: torch, torch.distributed, dstest
        self.modules = len(sys.modules)

    def after_run(self) -> None:
        if len(sys.modules) != self.modules:
            gc.collect()
            gc.freeze()
            self.modules = len(sys.modules)


def _watch_parent(parent_pid: int, launcher_pid: int) -> None:
    """Exit when the parent is gone (killed with SIGKILL, say), even if this rank is stuck in a collective.

    ``launcher_pid`` is this worker's own parent: the parent itself, or the fork server, which exits
    with it.
    """
    while True:
        time.sleep(0.5)
        if os.getppid() != launcher_pid:
            os._exit(3)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except OSError:
            pass


def _name_process(name: str) -> None:
    """Show workers as ``dstest-r<rank>`` in ps/top and /proc/<pid>/comm (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` (every run seeds each rank's torch RNG, E5), at a fraction of its cost where
    no accelerator is available.

    ``torch.manual_seed`` also queues the seed for each accelerator module not initialised yet (CUDA, XPU,
    MTIA), formatting the caller's stack for each: 0.3-0.7 ms a run on every rank, measured as most of the
    CPU time of a spec that calls nothing (issue 44 item 4). Where no accelerator is available none of those
    modules can come up in this process, so the queued seeds could never be applied: the CPU generator is
    seeded alone, as ``torch.manual_seed`` seeds it. With an accelerator, torch's own call."""
    import torch

    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class _Server:
    """One worker's state across runs: resolved functions, the world group's store, the log offsets."""

    def __init__(self, cfg: WorkerConfig, device: Any, read_fd: int, checker: Checker | None) -> None:
        from dstest.worlds.torch_internals import FreshRunState

        self.cfg = cfg
        self.checker = checker
        self.device = device
        self.read_fd = read_fd
        self.functions: dict[FnRef, Callable[..., Any]] = {}
        self.fresh = FreshRunState()  # also keeps the world group, which every run must leave in place
        self.unusable: str | None = None  # why this worker must be replaced after the run
        self.watches: dict[tuple[str, ...], Any] = {}  # module prefixes -> their ModuleStateWatch

    def serve(self, blob: bytes) -> Reply:
        """One run on this rank: its function called, then what it left behind checked; the reply."""
        from dstest.context import RankContext

        start = self._log_offset()
        run_id = -1
        cmd: Command | None = None
        failure: BaseException | None = None
        value: Any = None
        checking = False
        try:
            cmd = pickle.loads(blob)
            run_id = cmd.run_id
            if self.checker is not None:
                # before anything can fail: the referee hears of every end
                self.checker.begin(run_id, cmd.faults, cmd.strict_shapes)
                checking = True
            fn, ctx = self._prepare(cmd)
            token = ctx.bind()
            try:
                if cmd.setup is not None:  # e.g. the spec layer binding the system under test (RunRequest.setup)
                    cmd.setup(ctx)
                value = fn(ctx, *cmd.args, **cmd.kwargs)
            finally:
                RankContext.unbind(token)
        except BaseException as exc:  # the parent reports every rank's outcome, so catch all
            failure = exc
        left_behind = self._check_state(cmd.watch, cmd.resets) if cmd is not None and run_id >= 0 else []
        check_unhealthy = None
        if checking:
            failure, check_unhealthy = self._end_check(failure)
        result = None
        if failure is None:
            result, failure = self._pickled(value)
        return self._reply(run_id, start, result, failure, check_unhealthy, left_behind)

    def _prepare(self, cmd: Command) -> tuple[Callable[..., Any], Any]:
        """Before the run's function: find it, give the run fresh groups, put back process-global state, start
        watching the run's modules; returns the function and the rank's context, the RNGs seeded."""
        import random

        from dstest.context import RankContext, rank_seed

        rank = self.cfg.rank
        fn = self._resolve(cmd.ref)
        self._begin_run(cmd.run_id)
        try:  # what the previous run left in process-global state (dstest.resets)
            apply_resets(cmd.resets)
        except BaseException:
            self.unusable = "a reset of process-global state failed before the run (dstest.resets)"
            raise
        self._watch(cmd.watch)
        ctx = RankContext(
            rank=rank,
            world_size=self.cfg.key.world_size,
            world=self.cfg.world_name,
            device=self.device,
            seed=cmd.seed,
        )
        if self.checker is not None:
            ctx.attach_comm(self.checker.recorder.view(rank))
        # Processes, unlike threads, own their global RNGs: seed them too, so that a spec drawing from
        # torch.randn is as deterministic as one using ctx.generator (E5).
        seed_torch(rank_seed(cmd.seed, rank))
        random.seed(rank_seed(cmd.seed, rank))
        return fn, ctx

    def _end_check(self, failure: BaseException | None) -> tuple[BaseException | None, str | None]:
        """Close the run's cross-rank check: the run's failure (or what the check left unfinished, when the
        function itself did not fail), and why the worker is unusable after it, if it is."""
        assert self.checker is not None
        try:
            left, check_unhealthy = self.checker.end(failure)
        except Exception as exc:
            left, check_unhealthy = None, f"closing the run's check failed: {type(exc).__name__}: {exc}"
        return failure or left, check_unhealthy

    def _pickled(self, value: Any) -> tuple[bytes | None, BaseException | None]:
        """The function's return value pickled for the parent; or the error that says it does not pickle."""
        try:
            try:
                return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), None
            except Exception as exc:
                raise TypeError(
                    f"rank {self.cfg.rank} returned {type(value).__name__} {value!r:.200}, which cannot be pickled "
                    f"back to the parent ({type(exc).__name__}: {exc}); return picklable values"
                ) from exc
        except TypeError as exc:
            return None, exc

    def _reply(
        self,
        run_id: int,
        start: int,
        result: bytes | None,
        failure: BaseException | None,
        check_unhealthy: str | None,
        left_behind: list[str],
    ) -> Reply:
        """The run's reply to the parent; the run's groups are left for the next run to destroy."""
        rank = self.cfg.rank
        tb, exc_blob = "", None
        if failure is not None:
            tb = "".join(traceback.format_exception(failure))
            exc_blob = pickle_exception(failure)
        unhealthy = self._end_run() or check_unhealthy
        trace = self.checker.recorder.export(rank) if self.checker is not None else None
        output = self._output_since(start)
        tally = self.checker.faults if self.checker is not None else None  # which faults fired (contract G5)
        ok = failure is None
        return Reply(run_id, rank, ok, result, tb, exc_blob, output, unhealthy, trace, tuple(left_behind), tally)

    def _watch(self, prefixes: tuple[str, ...]) -> None:
        """Start watching the module-level state of ``prefixes`` (at the first run that names them)."""
        if prefixes and prefixes not in self.watches:
            from dstest.worlds.process.state_watch import ModuleStateWatch

            self.watches[prefixes] = ModuleStateWatch(prefixes)

    def _check_state(self, prefixes: tuple[str, ...], resets: tuple[str, ...]) -> list[str]:
        """After a run: the hand-kept resets first (the fast path: what they put back is not reported), then
        put back what the run changed in the watched modules; a failure makes the worker unusable."""
        watch = self.watches.get(prefixes)
        if watch is None:
            return []
        try:
            apply_resets(resets)
        except BaseException as exc:
            self.unusable = self.unusable or f"a reset of process-global state failed after the run: {exc}"
            return []
        found: list[str]
        found, unusable = watch.check_and_restore()
        if unusable is not None:
            self.unusable = self.unusable or unusable
        return found

    # -- finding the function ------------------------------------------------------------------------
    def _resolve(self, ref: FnRef) -> Callable[..., Any]:
        fn = self.functions.get(ref)
        if fn is None:
            module = import_ref(ref)
            obj: Any = module
            for part in ref.qualname.split("."):
                obj = getattr(obj, part)
            fn = rank_function_of(obj)
            self.functions[ref] = fn
        return fn

    # -- groups of one run -------------------------------------------------------------------------------
    def _begin_run(self, run_id: int) -> None:
        """Destroy the groups the previous run created, then give this run fresh store keys and the group
        names a fresh world would have (FreshRunState).

        Here rather than when that run ended: the parent hands out a run only once every rank has replied
        to the one before, so no rank is still forming one of those groups. A rank that finished early and
        destroyed its end of a group at once could cut off a slower peer still connecting to it.
        """
        import torch.distributed as dist

        from dstest.worlds.torch_internals import c10d_state

        for pg in list(c10d_state().pg_map):
            if pg is not self.fresh.default_pg:
                try:
                    dist.destroy_process_group(pg)
                except Exception as exc:
                    self.unusable = f"could not destroy a process group the previous run created: {exc}"
                    raise RuntimeError(self.unusable) from exc
        self.fresh.begin(run_id)

    def _end_run(self) -> str | None:
        """Put the world's store and group count back; say why this worker is unusable, if it is. The run's
        groups stay until the next run begins (see _begin_run)."""
        import torch.distributed as dist

        from dstest.worlds.torch_internals import default_group

        if not dist.is_initialized() or default_group() is not self.fresh.default_pg:
            return "the run destroyed or replaced the default process group"
        self.fresh.end()
        if _REPLACE_AFTER_RUN and self.unusable is None:
            self.unusable = "; ".join(_REPLACE_AFTER_RUN)
        _REPLACE_AFTER_RUN.clear()
        return self.unusable

    # -- output --------------------------------------------------------------------------------------------
    def _log_offset(self) -> int:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        return os.lseek(1, 0, os.SEEK_CUR)

    def _output_since(self, start: int) -> str:
        end = self._log_offset()
        if end <= start:
            return ""
        size = min(end - start, _OUTPUT_LIMIT)
        data = os.pread(self.read_fd, size, end - size)
        skipped = end - start - size
        text = data.decode(errors="replace")
        return f"[... {skipped} bytes of output cut ...]\n{text}" if skipped else text
