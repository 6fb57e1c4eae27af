"""The process world: ranks are warm OS processes joined by a real backend (gloo on CPU, NCCL on GPUs).

For code with process-global state (DeepSpeed caches its groups in module globals), which threads cannot
host. A *pool* of worker processes per (backend, device, world size) has already imported torch and formed
its process group, so a spec costs milliseconds instead of the seconds of a fresh spawn:

    parent                                      worker r (one per rank, started once per pool)
    run(fn, W) --- pickled (reference to fn, args) ---> resolve fn by module + qualname (+ file path)
                                                        fn(RankContext(rank=r, ...)) under a fresh store prefix
               <-- pickled result | traceback, output -- destroy the groups fn created

Functions travel by reference, so they must be module-level (a ``@dstest.spec`` body, a test module's
function, a benchmark's ``__main__`` function); arguments and results travel by pickle.

Failures never leave a broken pool behind. gloo cannot abort a rank blocked in a collective, so when a
rank fails and the others do not finish within a short grace, when a worker dies, or when the run passes
its timeout (stacks taken with faulthandler first), the pool is killed and a replacement is started at
once; the run raises :class:`RankFailure`, :class:`WorkerDied` or :class:`WorldTimeout` naming the ranks.
Rendezvous goes through a ``FileStore`` in a private temporary directory (no fixed ports: ``pytest -n``
works). No worker outlives the session: :func:`shutdown_all` runs from the plugin's ``pytest_unconfigure``
and at interpreter exit, and an idle worker whose parent is gone exits by itself.

Workers are forked from multiprocessing's fork server, which imports torch once (see ``_mp_context``):
a pool of 8 starts in well under a second once that server runs, and a replaced pool costs little. Where
there is no fork server, workers are spawned. This module imports neither torch nor the target at import
time; a worker sets its environment (``RANK``, ``OMP_NUM_THREADS``, ...) before it touches torch.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from dstest.errors import InvalidArgument, RankFailure, WorkerDied, WorldAborted, WorldTimeout
from dstest.worlds.protocol import check_run_arguments

__all__ = ["FAILURE_GRACE", "POOL_START_TIMEOUT", "ProcessWorld", "pool_pids", "shutdown_all"]

#: Seconds a pool may take to start and form its group (a cold fork server imports torch first).
POOL_START_TIMEOUT = 180.0
#: After one rank fails, seconds the others get to finish before the pool counts as poisoned (they are
#: probably blocked in a collective that the failed rank will never join) and is replaced.
FAILURE_GRACE = 1.0
#: The backend's own collective timeout. The parent enforces the run's timeout by killing the pool, so
#: this only has to be longer than any run; a shorter one would turn hangs into confusing backend errors.
_BACKEND_TIMEOUT_S = 6 * 3600
#: Seconds to wait for faulthandler's dump after signalling a worker.
_STACK_WAIT_S = 1.0
#: At most this many worker processes stay warm; least recently used pools are closed beyond it.
_MAX_WORKERS = max(32, 4 * (os.cpu_count() or 1))
_OUTPUT_LIMIT = 1 << 20  # bytes of one rank's output forwarded per run
_STOP = b"stop"


# ------------------------------------------------------------------------------------------------------
# Messages between parent and workers
# ------------------------------------------------------------------------------------------------------


class _FnRef(NamedTuple):
    """How a worker finds the function: ``module.qualname``, loaded from ``path`` if needed."""

    module: str
    qualname: str
    path: str | None
    rewrite_asserts: bool  # the parent's module was assertion-rewritten by pytest: do the same


class _Command(NamedTuple):
    run_id: int
    ref: _FnRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int
    target: str


class _Reply(NamedTuple):
    run_id: int
    rank: int
    ok: bool
    result: bytes | None  # pickled return value (ok)
    traceback: str  # formatted traceback (not ok)
    exception: bytes | None  # pickled exception, if it pickles (not ok)
    output: str  # what the rank printed during the run (stdout and stderr, interleaved)
    unhealthy: str | None  # why this worker cannot serve another run (it destroyed the world group, ...)


@dataclass(frozen=True)
class _PoolKey:
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    world_size: int


@dataclass(frozen=True)
class _WorkerConfig:
    key: _PoolKey
    rank: int
    world_name: str
    store_path: str
    log_path: str
    stack_path: str
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)


class RemoteRankError(Exception):
    """Stands in for an exception of a worker that did not survive pickling; the message keeps its type."""


# ------------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------------


def _worker_main(cfg: _WorkerConfig, conn: Connection) -> None:
    """Entry point of a worker process: form the group once, then serve runs until told to stop."""
    os.environ.update(cfg.env)  # before torch is imported: OMP_NUM_THREADS, RANK, ...
    log_fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for stream in (sys.stdout, sys.stderr):  # a hung rank's last prints must reach the file
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    read_fd = os.open(cfg.log_path, os.O_RDONLY)

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

    import datetime

    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" in cfg.env:
        torch.set_num_threads(int(cfg.env["OMP_NUM_THREADS"]))
    key = cfg.key
    if key.device == "cuda":
        device = torch.device("cuda", cfg.rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from torch._C import _distributed_c10d as c10d_store  # where the store classes live (and are typed)

    dist.init_process_group(
        key.backend,
        store=c10d_store.FileStore(cfg.store_path, key.world_size),
        rank=cfg.rank,
        world_size=key.world_size,
        timeout=datetime.timedelta(seconds=_BACKEND_TIMEOUT_S),
        device_id=device if key.device == "cuda" else None,  # NCCL: form the communicator now
    )
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # connect and warm the backend so the first spec pays nothing
    if key.device == "cuda":
        torch.cuda.synchronize()
    # Imported once here rather than by the first spec.
    import dstest.context
    import dstest.specification  # noqa: F401

    conn.send(("ready", os.getpid()))
    server = _Server(cfg, device, read_fd)
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if blob == _STOP:
            break
        reply = server.serve(blob)
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


class _Server:
    """One worker's state across runs: resolved functions, the world group's store, the log offsets."""

    def __init__(self, cfg: _WorkerConfig, device: Any, read_fd: int) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.cfg = cfg
        self.device = device
        self.read_fd = read_fd
        self.functions: dict[_FnRef, Callable[..., Any]] = {}
        self.default_pg = c10d._get_default_group()
        self.backend_name, self.base_store = c10d._world.pg_map[self.default_pg]
        self.group_count = c10d._world.group_count

    def serve(self, blob: bytes) -> _Reply:
        import random

        import torch

        from dstest.context import RankContext, rank_seed

        rank = self.cfg.rank
        start = self._log_offset()
        ok, result, tb, exc_blob = False, None, "", None
        run_id = -1
        try:
            cmd: _Command = pickle.loads(blob)
            run_id = cmd.run_id
            fn = self._resolve(cmd.ref)
            self._begin_run(run_id)
            ctx = RankContext(
                rank=rank,
                world_size=self.cfg.key.world_size,
                world=self.cfg.world_name,
                device=self.device,
                seed=cmd.seed,
                target_name=cmd.target,
            )
            # Processes, unlike threads, own their global RNGs: seed them too, so that a spec drawing from
            # torch.randn is as deterministic as one using ctx.generator (E5).
            torch.manual_seed(rank_seed(cmd.seed, rank))
            random.seed(rank_seed(cmd.seed, rank))
            token = ctx.bind()
            try:
                value = fn(ctx, *cmd.args, **cmd.kwargs)
            finally:
                RankContext.unbind(token)
            try:
                result = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"rank {rank} returned {type(value).__name__} {value!r:.200}, which cannot be pickled "
                    f"back to the parent ({type(exc).__name__}: {exc}); return picklable values"
                ) from exc
            ok = True
        except BaseException as exc:  # the parent reports every rank's outcome, so catch all
            tb = "".join(traceback.format_exception(exc))
            exc_blob = _pickle_exception(exc)
        unhealthy = self._end_run()
        return _Reply(run_id, rank, ok, result, tb, exc_blob, self._output_since(start), unhealthy)

    # -- finding the function ------------------------------------------------------------------------
    def _resolve(self, ref: _FnRef) -> Callable[..., Any]:
        fn = self.functions.get(ref)
        if fn is None:
            module = _import_module(ref)
            obj: Any = module
            for part in ref.qualname.split("."):
                obj = getattr(obj, part)
            from dstest.specification import spec_info

            info = spec_info(obj)
            fn = info.fn if info is not None else obj
            self.functions[ref] = fn
        return fn

    # -- groups of one run -------------------------------------------------------------------------------
    def _begin_run(self, run_id: int) -> None:
        """Give the run fresh store keys and the group names a fresh world would have.

        torch 2.13 names groups "1", "2", ... from ``_world.group_count`` and keeps their rendezvous keys
        in the default store under that name; a second run reusing a name would read the keys of a dead
        group. Each run therefore sees the default store under its own prefix (all ranks get the same
        run id), and every run starts counting names where a fresh world does, so ranks stay in sync
        even after a run in which they created different numbers of groups.
        """
        from torch._C import _distributed_c10d as c10d_store
        from torch.distributed import distributed_c10d as c10d

        prefixed = c10d_store.PrefixStore(f"dstest-run{run_id}/", self.base_store)
        c10d._world.pg_map[self.default_pg] = (self.backend_name, prefixed)
        c10d._world.group_count = self.group_count

    def _end_run(self) -> str | None:
        """Destroy the groups the run created; say why this worker is unusable, if it is."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized() or c10d._get_default_group() is not self.default_pg:
            return "the run destroyed or replaced the default process group"
        problem = None
        for pg in list(c10d._world.pg_map):
            if pg is self.default_pg:
                continue
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:
                problem = f"could not destroy a process group the run created: {type(exc).__name__}: {exc}"
        c10d._world.pg_map[self.default_pg] = (self.backend_name, self.base_store)
        c10d._world.group_count = self.group_count
        return problem

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


def _pickle_exception(exc: BaseException) -> bytes | None:
    outcome = _pytest_outcome(exc)
    try:
        return pickle.dumps(outcome or exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _pytest_outcome(exc: BaseException) -> tuple[str, str, str] | None:
    """pytest.skip/fail/xfail raise classes that claim to live in ``builtins`` and so do not pickle."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is None:
        return None
    for kind in ("Skipped", "XFailed", "Failed", "Exit"):
        cls = getattr(outcomes, kind, None)
        if cls is not None and isinstance(exc, cls):
            return ("pytest-outcome", kind, str(getattr(exc, "msg", None) or exc))
    return None


def _import_module(ref: _FnRef) -> Any:
    """The module ``ref`` names: already imported, importable by name, or loaded from its file."""
    module = sys.modules.get(ref.module)
    if module is not None and (ref.path is None or _same_file(getattr(module, "__file__", None), ref.path)):
        return module
    if ref.path is None:
        return importlib.import_module(ref.module)
    # Make the module's own imports work as they do under pytest's default import mode: the first
    # directory above it that is not a package goes on sys.path.
    base = os.path.dirname(os.path.abspath(ref.path))
    while os.path.isfile(os.path.join(base, "__init__.py")):
        base = os.path.dirname(base)
    if base not in sys.path:
        sys.path.insert(0, base)
    if not ref.rewrite_asserts:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(ref.module)
            if _same_file(getattr(module, "__file__", None), ref.path):
                return module
    return _load_from_path(ref.module, ref.path, ref.rewrite_asserts)


def _load_from_path(name: str, path: str, rewrite_asserts: bool) -> Any:
    """Load ``path`` as module ``name``, with pytest's assertion rewriting when the parent had it."""
    parent = name.rpartition(".")[0]
    if parent:
        with contextlib.suppress(ImportError):
            importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load module {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as f:
        source = f.read()
    code = None
    if rewrite_asserts:
        try:
            import ast

            from _pytest.assertion.rewrite import rewrite_asserts as rewrite

            tree = ast.parse(source, filename=path)
            rewrite(tree, source, path)
            code = compile(tree, path, "exec", dont_inherit=True)
        except Exception:
            code = None  # plain asserts still work, with less detail
    if code is None:
        code = compile(source, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------------
# Parent side: the pools
# ------------------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, rank: int, process: Any, conn: Connection, cfg: _WorkerConfig) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.cfg = cfg

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
            if self.key.device == "cpu":
                env["DS_ACCELERATOR"] = "cpu"
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
        # Launching blocks while a fresh fork server imports torch; do it off the caller's thread.
        self.launcher = threading.Thread(target=self._launch, args=(configs,), name="dstest-pool-launch", daemon=True)
        self.launcher.start()
        return self

    def _launch(self, configs: list[_WorkerConfig]) -> None:
        try:
            ctx = _mp_context()
            for cfg in configs:
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=_worker_main, args=(cfg, child_conn), name=f"dstest-{self.world_name}-rank{cfg.rank}"
                )
                process.start()
                child_conn.close()
                self.workers.append(_Worker(cfg.rank, process, parent_conn, cfg))
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
                    self.start_failed = True
                    self.kill()
                    raise WorkerDied(
                        f"{self._label()}: rank {w.rank} (pid {w.pid}) {w.describe_exit()} while starting "
                        f"(importing torch and forming the {self.key.backend} group)\n" + self._logs([w.rank])
                    )
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
                w.process.close()
        self.closed = True
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if not self.closed]

    # -- one run -------------------------------------------------------------------------------------------
    def run(
        self, ref: _FnRef, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float, seed: int, target: str
    ) -> list[Any]:
        """Run on every worker. On any failure that leaves the pool unusable, the pool is closed: the
        caller replaces it (``self.closed`` tells)."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks in the message, not this frame
        self.wait_ready()
        run_id = next(self.run_ids)
        try:
            blob = pickle.dumps(
                _Command(run_id, ref, tuple(args), kwargs, seed, target), protocol=pickle.HIGHEST_PROTOCOL
            )
        except Exception as exc:
            raise InvalidArgument(
                f"the process world sends args and kwargs to its workers by pickle; those of "
                f"{ref.qualname} do not pickle ({type(exc).__name__}: {exc})"
            ) from exc
        W = self.key.world_size
        log_starts = {w.rank: _file_size(w.cfg.log_path) for w in self.workers}
        try:
            replies, dead, first_failure = self._exchange(run_id, blob, timeout)
        except BaseException:
            self.kill()  # interrupted (Ctrl-C) mid-run: only a fresh pool is in a known state
            raise
        for r in sorted(replies):
            _forward_output(r, replies[r].output)

        label = self._label()
        if dead:
            for d in dead:
                d.process.join(1.0)
            others = self._collect_quietly(replies)
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
        if missing:
            stacks = self._stacks(missing)
            for w in missing:
                out = w.output_since(log_starts[w.rank])
                if out:
                    stacks[w.rank] = stacks.get(w.rank, "(no stack)\n") + f"-- output during the run --\n{out}"
            self.kill()
            if first_failure is None:
                raise WorldTimeout(
                    f"{label} ran {ref.qualname} past its timeout of {timeout:g} s; ranks still running: "
                    f"{[w.rank for w in missing]}; the pool was replaced\n" + _format_stacks(stacks),
                    stacks,
                )
            aborted = {
                w.rank: (
                    f"rank {w.rank} did not finish within {FAILURE_GRACE:g} s of the failure (blocked in a "
                    f"collective the failed rank never joined?) and was stopped; its stack:\n"
                    + stacks.get(w.rank, "(no stack)\n")
                )
                for w in missing
            }
            raise _rank_failure(label, W, replies, aborted, pool_replaced=True)

        unhealthy = {r: rep.unhealthy for r, rep in replies.items() if rep.unhealthy}
        if unhealthy:
            self.stop()  # the caller starts a fresh pool for the next run
        if any(not rep.ok for rep in replies.values()):
            raise _rank_failure(label, W, replies, {}, pool_replaced=bool(unhealthy))
        results = []
        for r in range(W):
            try:
                results.append(pickle.loads(replies[r].result or b""))
            except Exception as exc:
                raise RankFailure(
                    f"{label}: the result of rank {r} could not be unpickled in the parent "
                    f"({type(exc).__name__}: {exc})",
                    {r: traceback.format_exc()},
                    {r: exc},
                ) from exc
        self.last_used = time.monotonic()
        return results

    def _exchange(
        self, run_id: int, blob: bytes, timeout: float
    ) -> tuple[dict[int, _Reply], list[_Worker], float | None]:
        """Send the run to every worker and gather replies until all came, one died, the run timed out, or
        the others had FAILURE_GRACE seconds after a failure."""
        deadline = time.monotonic() + timeout
        replies: dict[int, _Reply] = {}
        dead: list[_Worker] = []
        first_failure: float | None = None
        for w in self.workers:
            try:
                w.conn.send_bytes(blob)
            except (EOFError, OSError):
                dead.append(w)
        by_conn = {w.conn: w for w in self.workers}
        while len(replies) < len(self.workers) and not dead:
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            pending = [w for w in self.workers if w.rank not in replies]
            by_sentinel = {w.process.sentinel: w for w in pending}
            ready = wait([*(w.conn for w in pending), *by_sentinel], remaining)
            for obj in ready:
                w = by_conn.get(obj)  # type: ignore[call-overload]
                if w is None:
                    continue  # a sentinel: handled below, after reading what the worker sent first
                try:
                    reply: _Reply = pickle.loads(w.conn.recv_bytes())
                except (EOFError, OSError):
                    continue
                if reply.run_id != run_id:
                    continue  # cannot happen while pools are killed on interruption; never mix runs up
                replies[w.rank] = reply
                if not reply.ok and first_failure is None:
                    first_failure = time.monotonic()
            for obj in ready:
                gone = by_sentinel.get(obj)
                if gone is not None and gone.rank not in replies:
                    dead.append(gone)
        return replies, dead, first_failure

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
    label: str, world_size: int, replies: dict[int, _Reply], aborted: dict[int, str], *, pool_replaced: bool
) -> RankFailure:
    failed = {r: rep for r, rep in replies.items() if not rep.ok}
    exceptions: dict[int, BaseException] = {}
    for r, rep in failed.items():
        exceptions[r] = _unpickle_exception(rep)
    for r, text in aborted.items():
        exceptions[r] = WorldAborted(text.splitlines()[0])
    head = "; ".join(
        f"rank {r}: {type(e).__name__}: {e}".splitlines()[0] for r, e in sorted(exceptions.items()) if r in failed
    )
    body = "\n".join(f"---- rank {r} ----\n{rep.traceback}" for r, rep in sorted(failed.items()))
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{text}" for r, text in sorted(aborted.items()))
    if pool_replaced:
        tail += "\nthe worker pool was replaced"
    tracebacks = {r: rep.traceback for r, rep in failed.items()} | aborted
    return RankFailure(
        f"{len(failed)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )


def _unpickle_exception(rep: _Reply) -> BaseException:
    if rep.exception is not None:
        try:
            exc = pickle.loads(rep.exception)
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            return exc
        if isinstance(exc, tuple) and len(exc) == 3 and exc[0] == "pytest-outcome":
            from _pytest import outcomes

            cls = getattr(outcomes, exc[1])
            outcome: BaseException = cls(exc[2]) if exc[1] != "Exit" else cls(exc[2], 1)
            return outcome
    last = rep.traceback.strip().splitlines()[-1] if rep.traceback.strip() else "unknown error"
    return RemoteRankError(last)


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


def _format_stacks(stacks: dict[int, str]) -> str:
    return "\n".join(f"---- rank {r} stack ----\n{s}" for r, s in sorted(stacks.items()))


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads_per_rank(world_size: int) -> int | None:
    """Intra-op threads per worker, as torchrun does: unless the user chose, share the cores, so that W
    processes do not each start one OpenMP thread per core and spin against each other."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


_PRELOAD = ["__main__", "torch", "torch.distributed", "dstest.context", "dstest.specification", "dstest.worlds.process"]
_CONTEXT: Any = None


def _mp_context() -> Any:
    """Where workers come from: a fork server that has imported torch once, else plain spawn.

    A spawned worker imports torch itself (seconds each, and W of them share the cores); a worker forked
    from the fork server starts in milliseconds with torch already imported, yet, like a spawned one,
    carries none of this process's state (the server never ran a test, never touched CUDA or OpenMP).
    """
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            # Takes effect when the server starts (here, unless some other code started it already).
            ctx.set_forkserver_preload(_PRELOAD)
            _CONTEXT = ctx
        else:
            _CONTEXT = multiprocessing.get_context("spawn")
    return _CONTEXT


# ------------------------------------------------------------------------------------------------------
# The pools of this process
# ------------------------------------------------------------------------------------------------------

# The pools are process-wide on purpose: keeping workers warm across World objects and tests is the whole
# point. They are reached only through _pool_for / shutdown_all, under _POOLS_LOCK.
_POOLS: dict[_PoolKey, _Pool] = {}
_POOLS_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _pool_for(key: _PoolKey, world_name: str) -> _Pool:
    global _ATEXIT_REGISTERED
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            _evict_for(key.world_size)
            pool = _POOLS[key] = _Pool(key, world_name).start()
        if not _ATEXIT_REGISTERED:
            atexit.register(shutdown_all)
            _ATEXIT_REGISTERED = True
        pool.last_used = time.monotonic()
        return pool


def _evict_for(extra: int) -> None:
    """Close least recently used idle pools so that at most _MAX_WORKERS workers stay warm."""
    live = sorted((p for p in _POOLS.values() if not p.closed), key=lambda p: p.last_used)
    total = sum(p.key.world_size for p in live) + extra
    for pool in live:
        if total <= _MAX_WORKERS:
            break
        if pool.lock.acquire(blocking=False):
            try:
                pool.stop()
            finally:
                pool.lock.release()
            total -= pool.key.world_size


def _replace(pool: _Pool) -> None:
    """Start a fresh pool in place of a closed one, now, so that it warms up while other tests run."""
    with _POOLS_LOCK:
        if _POOLS.get(pool.key) is pool and not pool.start_failed:
            _POOLS[pool.key] = _Pool(pool.key, pool.world_name).start()


def shutdown_all() -> None:
    """Stop every worker of every pool of this process (the plugin calls it at session end; atexit too)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:  # ask all at once, then wait: a pool's workers exit in parallel with the others'
        for w in pool.workers:
            with contextlib.suppress(Exception):
                w.conn.send_bytes(_STOP)
    for pool in pools:
        if not pool.closed:
            pool._reap(grace=2.0)
    _stop_fork_server()


def _stop_fork_server() -> None:
    """Stop the fork server the pools used, so that it is not orphaned when this process exits.

    Killed rather than asked: asked, it finalizes torch on its way out, which takes seconds on a busy
    machine (long enough for pytest-xdist to interrupt its worker's shutdown). It holds no state.
    """
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT.get_start_method() != "forkserver":
        return
    _CONTEXT = None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # CPython's singleton; private, hence the care
    pid = getattr(server, "_forkserver_pid", None)
    stop = getattr(server, "_stop", None)
    if not isinstance(pid, int) or stop is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        stop()  # closes its pipe, reaps it, removes its socket


def pool_pids() -> dict[tuple[str, int], list[int]]:
    """The worker pids of every live pool, by (backend, world size); for tests that check no process leaks."""
    with _POOLS_LOCK:
        return {(k.backend, k.world_size): p.pids() for k, p in _POOLS.items() if not p.closed}


# ------------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------------


def _reference(fn: Callable[..., Any]) -> _FnRef:
    """How workers will find ``fn``; raises InvalidArgument when they could not."""
    from dstest.specification import spec_info

    info = spec_info(fn)
    body = info.fn if info is not None else fn
    module_name = getattr(body, "__module__", None)
    qualname = getattr(body, "__qualname__", None)
    how = (
        "the process world sends functions to its worker processes by reference (module and name); "
        "define the function at module level"
    )
    if not module_name or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise InvalidArgument(f"fn={fn!r} cannot be found by name in another process: {how}")
    module = sys.modules.get(module_name)
    if module_name == "__main__" and not getattr(module, "__file__", None):
        raise InvalidArgument(f"fn={fn!r} lives in a __main__ without a file (python -c, a REPL): {how}")
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = None
    found = spec_info(obj).fn if spec_info(obj) is not None else obj  # type: ignore[union-attr]
    if module is None or found is not body:
        raise InvalidArgument(f"fn={fn!r} is not reachable as {module_name}.{qualname}: {how}")
    path = getattr(module, "__file__", None)
    return _FnRef(module_name, qualname, os.path.abspath(path) if path else None, "@py_builtins" in vars(module))


class ProcessWorld:
    """Runs a function on every rank as warm worker processes over a real backend (gloo on CPU by default).

    ``fn(ctx, *args, **kwargs)`` runs in worker ``ctx.rank`` with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set); ``run`` returns the
    per-rank results in rank order, or raises :class:`RankFailure` (every failing rank's traceback),
    :class:`WorldTimeout` (every running rank's stack) or :class:`WorkerDied`. ``fn`` must be a
    module-level function; args, kwargs and results must pickle. Groups a run creates are destroyed after
    it; the world group, imported modules and other process state persist across runs of the same pool.
    """

    def __init__(self, *, backend: str = "gloo", device: str = "cpu", name: str = "process") -> None:
        self.name = name
        self.backend = backend
        self.device = device

    @property
    def marker(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return "torch was built without torch.distributed"
        if self.backend == "gloo" and not dist.is_gloo_available():
            return "the process world needs gloo, which this torch build lacks"
        if self.backend == "nccl" and not dist.is_nccl_available():
            return "the nccl world needs NCCL, which this torch build lacks"
        return None

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = 60.0,
        seed: int = 0,
        target: str = "impl",
    ) -> list[Any]:
        check_run_arguments(world_size, timeout)
        __tracebackhide__ = True
        ref = _reference(fn)
        pool = _pool_for(_PoolKey(self.backend, self.device, world_size), self.name)
        with pool.lock:
            try:
                return pool.run(ref, tuple(args), dict(kwargs or {}), timeout, seed, target)
            finally:
                if pool.closed:
                    _replace(pool)

    def prestart(self, world_sizes: Sequence[int]) -> None:
        """Start the pools of these world sizes without waiting: they warm up while other work runs."""
        for ws in world_sizes:
            _pool_for(_PoolKey(self.backend, self.device, ws), self.name)

    def warm(self, world_size: int) -> float:
        """Start (if needed) and wait for the pool of ``world_size`` ranks; returns its launch-to-ready seconds."""
        pool = _pool_for(_PoolKey(self.backend, self.device, world_size), self.name)
        with pool.lock:
            try:
                pool.wait_ready()
            finally:
                if pool.closed:
                    _replace(pool)
        return pool.start_seconds or 0.0
