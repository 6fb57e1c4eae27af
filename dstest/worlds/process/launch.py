"""How workers are started: multiprocessing's fork server (which has imported torch once), else spawn;
the rendezvous port and the threads each rank gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from typing import Any, NoReturn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's choice; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_per_rank(world_size: int) -> int | None:
    """Intra-op threads per worker, as torchrun does: unless the user chose, share the cores, so that W
    processes do not each start one OpenMP thread per core and spin against each other."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


#: The first, ``dstest._fork_server_path``, gives the server the starting process's ``sys.path``.
_PRELOAD = [
    "dstest._fork_server_path",
    "__main__",
    "torch",
    "torch.distributed",
    "dstest.context",
    "dstest.specification",
    "dstest.worlds.process",
]
_CONTEXT: Any = None
_FORKED_HERE = False  # the fork server is a fork of this process (fork_server_from_here)


@dataclasses.dataclass
class _Feed:
    """This process's fork server's feed (:func:`start_fork_server_fed`)."""

    path: str  # the file the modules are named in; the server writes how it ended beside it (``.end``)
    names: list[str] = dataclasses.field(default_factory=list)  # fed so far, in order
    open: bool = True  # until end_fork_server_feed
    settled: bool = False  # once settle_fork_server has waited for the server's end

    def cuda(self) -> str | None:
        """The fed module whose import initialized CUDA in the server, as the server's end file says (None
        where none did, or the server has not ended its feed)."""
        try:
            with open(self.path + ".end", encoding="utf-8") as f:
                cuda = json.load(f).get("cuda")
        except (OSError, ValueError, AttributeError):
            return None
        return cuda if isinstance(cuda, str) else None


_FEED: _Feed | None = None


def preload_in_fork_server(*modules: str) -> bool:
    """Have the fork server import ``modules`` too, so that every worker starts with them imported (a
    library whose import takes seconds, paid once instead of once per worker). Effective only before the
    server starts, that is before the first pool of this process; returns whether it can still take effect.
    The server passes over a module that raises ImportError; any other error ends the server, so name a
    module whose import can only fail that way.
    """
    for name in modules:
        if name not in _PRELOAD:
            _PRELOAD.append(name)
    if _CONTEXT is None:
        return True
    if _CONTEXT.get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        return False
    _CONTEXT.set_forkserver_preload(_PRELOAD)
    return True


def fork_server_preload() -> list[str]:
    """The modules the fork server imports (or imported, once started), in order: its preloads, then those it
    was fed (:func:`feed_fork_server`), up to one whose import initialized CUDA there, where one did (a warm
    server imports the same, so that its sessions, and their workers, start with them)."""
    fed = list(_FEED.names) if _FEED is not None else []
    cuda = _FEED.cuda() if _FEED is not None else None
    if cuda in fed:
        fed = fed[: fed.index(cuda)]
    return list(_PRELOAD) + [name for name in fed if name not in _PRELOAD]


def mp_context() -> Any:
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


def start_fork_server(env: dict[str, str] | None = None) -> bool:
    """Start the fork server now, without waiting for it: it imports torch and the preloaded modules in its
    own process while this one goes on (a pytest session collecting its tests), so the first pool forks
    from a server that is ready. ``env``: variables the server's preload modules read (and remove), set in
    this process only while the server starts. Returns whether a fork server is used here."""
    ctx = mp_context()
    if ctx.get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    # The server imports its preloads with this process's sys.path (dstest._fork_server_path reads it).
    given = {"DSTEST_FORK_SERVER_SYS_PATH": json.dumps(sys.path), **(env or {})}
    os.environ.update(given)
    try:
        forkserver.ensure_running()
    finally:
        for name in given:
            os.environ.pop(name, None)
    return True


def cuda_initialized() -> bool:
    """Whether this process has initialized CUDA (where torch is imported): a process forked from it could not
    use CUDA, so a fork server, or the warm server sessions are forked from, must not have."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch.cuda.is_initialized()) if torch is not None else False
    except Exception:
        return False


def fork_server_pid() -> int | None:
    """The pid of this process's running fork server, or None."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)  # private, hence the care
    return pid if isinstance(pid, int) else None


def start_fork_server_fed(feed: str) -> bool:
    """:func:`start_fork_server`, the server then importing, after its preloads, the modules this process
    names with :func:`feed_fork_server` as it goes on (a pytest session: what its collection imports, test
    module by test module), until :func:`end_fork_server_feed`, which a pool calls before it forks its first
    worker from the server (:mod:`dstest._fork_server_modules`). ``feed``: a file path of this process's
    choosing, in a directory it owns, that does not exist yet. Returns whether the server is fed: not where
    no fork server is used, or one runs already (a warm session's, a fork of this process, which has
    imported what the session imports)."""
    global _FEED
    if fork_server_pid() is not None or _FORKED_HERE:
        start_fork_server()
        return False
    if mp_context().get_start_method() != "forkserver":
        return False
    with open(feed, "x", encoding="utf-8"):
        pass
    preload_in_fork_server("dstest._fork_server_modules")
    if not start_fork_server({"DSTEST_FORK_SERVER_FEED": feed}) or fork_server_pid() is None:
        return False
    _FEED = _Feed(feed)
    return True


def feed_fork_server(modules: list[str]) -> bool:
    """Have the fed fork server (:func:`start_fork_server_fed`) import ``modules`` too, in this order, with
    this process's ``sys.path`` of now; those it has imported already are passed over. Returns whether the
    feed is open (False, doing nothing, once it has ended or where the server is not fed)."""
    if _FEED is None or not _FEED.open:
        return False
    if modules:
        _FEED.names.extend(name for name in modules if name not in _FEED.names)
        line = json.dumps({"path": [p for p in sys.path if isinstance(p, str)], "modules": list(modules)})
        with open(_FEED.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return True


def end_fork_server_feed() -> None:
    """End the fed server's feed: once it has imported what the feed named, it serves workers."""
    if _FEED is None or not _FEED.open:
        return
    _FEED.open = False
    with contextlib.suppress(OSError), open(_FEED.path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"done": True}) + "\n")


#: How long :func:`settle_fork_server` waits for a fed server to end its imports (a first worker would wait
#: as long for the server to serve it).
SETTLE_TIMEOUT_S = 300.0


def settle_fork_server(timeout: float = SETTLE_TIMEOUT_S) -> str | None:
    """Before the first worker is forked from a fed server: end its feed and wait until it has imported what
    it was fed. Where a fed module initialized CUDA in the server (every worker forked from it could not use
    CUDA), the server is replaced by one that imports its preloads only, and that module's name returned
    (each worker imports it itself, as without the feed); else None. Does nothing after its first call or
    where the server is not fed."""
    end_fork_server_feed()
    feed = _FEED
    if feed is None or feed.settled:
        return None
    feed.settled = True
    deadline = time.monotonic() + timeout
    while not os.path.exists(feed.path + ".end") and time.monotonic() < deadline and _fork_server_alive():
        time.sleep(0.01)
    cuda = feed.cuda()
    if cuda is None:
        return None
    stop_fork_server()
    start_fork_server()
    return cuda


def _fork_server_alive() -> bool:
    """Whether the server runs: not where it has exited, though not reaped yet (multiprocessing reaps it)."""
    pid = fork_server_pid()
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_fork_server() -> None:
    """Stop the fork server the pools used, so that it is not orphaned when this process exits.

    Killed rather than asked: asked, it finalizes torch on its way out, which takes seconds on a busy
    machine (long enough for pytest-xdist to interrupt its worker's shutdown). It holds no state.
    """
    global _CONTEXT
    end_fork_server_feed()
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


def fork_server_from_here(preload: list[str] | tuple[str, ...] = (), close_in_server: list[int] | None = None) -> bool:
    """Make this process's fork server a fork of this process, made now.

    For a process that has already imported what the workers need and has run nothing (a warm session's
    process, forked from :mod:`dstest.pytest.warm`'s server before pytest starts): the server is ready at
    once instead of importing torch for seconds. It imports those of ``preload`` (and of the modules given to
    :func:`preload_in_fork_server`) that are not imported yet, as a started server does. Call it while this
    process has one thread only. Returns False, changing nothing, where it cannot be done: no fork server
    start method, a server already running, or a Python whose fork server keeps other state than the one
    this function knows (its address, "alive" pipe and pid; an authentication key where the Python has one).
    ``close_in_server``: file descriptors of this process the server (and so every worker) must not hold.
    """
    from multiprocessing import connection, resource_tracker, util

    for name in preload:
        if name not in _PRELOAD:
            _PRELOAD.append(name)
    server = _unstarted_fork_server()
    if server is None:
        return False
    keyed = hasattr(server, "_forkserver_authkey")
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    key_r, key_w = os.pipe() if keyed else (-1, -1)
    authkey = os.urandom(32) if keyed else b""
    modules = [m for m in _PRELOAD if m != "__main__"]
    pid = os.fork()
    if pid == 0:
        _serve_as_fork_server(listener, (alive_r, alive_w), (key_r, key_w) if keyed else None, modules, close_in_server)
    os.close(alive_r)
    listener.close()
    if keyed:
        os.close(key_r)
        os.write(key_w, authkey)
        os.close(key_w)
        server._forkserver_authkey = authkey
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    global _FORKED_HERE
    _FORKED_HERE = True
    return True


def _unstarted_fork_server() -> Any:
    """CPython's fork server (a private singleton, hence the care) when this process may make it a fork of
    itself now: the fork server start method, one thread, no server running, and the state it keeps known."""
    import inspect
    import threading
    from multiprocessing import forkserver

    ctx = mp_context()
    if ctx.get_start_method() != "forkserver" or threading.active_count() != 1:
        return None
    server = getattr(forkserver, "_forkserver", None)
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if server is None or not all(hasattr(server, f) for f in fields) or server._forkserver_pid is not None:
        return None
    params = inspect.signature(forkserver.main).parameters
    if hasattr(server, "_forkserver_authkey") and "authkey_r" not in params:
        return None
    return server


def _serve_as_fork_server(
    listener: socket.socket,
    alive: tuple[int, int],
    key: tuple[int, int] | None,
    modules: list[str],
    close_in_server: list[int] | None,
) -> NoReturn:
    """The forked child: the fork server, serving until every holder of the "alive" pipe has gone."""
    from multiprocessing import forkserver

    code = 0
    try:
        os.close(alive[1])
        for fd in close_in_server or ():
            os.close(fd)
        extra: dict[str, Any] = {}
        if key is not None:
            os.close(key[1])
            extra["authkey_r"] = key[0]
        forkserver.main(listener.fileno(), alive[0], modules, **extra)
    except SystemExit:
        pass
    except BaseException:
        code = 1
    finally:
        os._exit(code)
