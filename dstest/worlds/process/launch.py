"""How workers are started: multiprocessing's fork server (which has imported torch once), else spawn;
the rendezvous port and the threads each rank gets.
"""

from __future__ import annotations

import contextlib
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
    """The modules the fork server imports (or imported, once started), in order."""
    return list(_PRELOAD)


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


def restart_fork_server(modules: list[str]) -> bool:
    """Replace a fork server that has not forked a worker yet by one that also imports ``modules`` (in this
    order; each error passed over, see :mod:`dstest._fork_server_modules`), so that every worker starts with
    them imported instead of importing them itself. For a pytest session whose collection imported a heavy
    library the server was started without (the server starts while pytest collects). Returns whether it
    did: not where no module is named, no fork server is used, or the server is a fork of this process (a
    warm session's, which has imported what the session imports). Call it before this process's first pool.
    """
    if not modules or _FORKED_HERE:
        return False
    if _CONTEXT is None or _CONTEXT.get_start_method() != "forkserver":
        return False
    stop_fork_server()
    preload_in_fork_server("dstest._fork_server_modules")
    return start_fork_server({"DSTEST_FORK_SERVER_MODULES": json.dumps(modules)})


def fork_server_pid() -> int | None:
    """The pid of this process's running fork server, or None."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)  # private, hence the care
    return pid if isinstance(pid, int) else None


def start_fork_server_reporting(report: str) -> bool:
    """:func:`start_fork_server`, the server writing the names of the modules it imported to the file
    ``report`` once its preloads are done (:mod:`dstest._fork_server_modules`; read it with
    :func:`read_fork_server_report`). Returns whether this call started a server that will write it: False
    where no fork server is used or one runs already (a warm session's, a fork of this process)."""
    if fork_server_pid() is not None or _FORKED_HERE:
        start_fork_server()
        return False
    preload_in_fork_server("dstest._fork_server_modules")
    return start_fork_server({"DSTEST_FORK_SERVER_REPORT": report}) and fork_server_pid() is not None


def read_fork_server_report(report: str, timeout: float = 60.0) -> set[str] | None:
    """The modules the server started by :func:`start_fork_server_reporting` imported, once it has written
    them to ``report``: waited for while the server lives, up to ``timeout`` seconds (a first pool would
    wait for its imports anyway); None where it never wrote them (it died, or the time ran out)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(report) and time.monotonic() < deadline and _fork_server_alive():
        time.sleep(0.05)
    try:
        with open(report, encoding="utf-8") as f:
            return set(json.load(f))
    except (OSError, ValueError):
        return None


def _fork_server_alive() -> bool:
    pid = fork_server_pid()
    if pid is None:
        return False
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
