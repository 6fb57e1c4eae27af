"""A session process, forked from the warm server for one run: it becomes that run (its standard streams,
directory, environment, ``sys.argv``), forks the process world's fork server from itself, and runs
``pytest.main``; once its conftests have run it checks that it still fits the server's imports, and
declines (the run goes on cold) when it does not.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dstest.pytest.warm import channel
from dstest.pytest.warm.staleness import session_differs


@dataclass
class Child:
    """The session process's link to the run that asked for it."""

    conn: socket.socket
    spec: dict[str, Any]
    started: float
    server_started: float
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        with self.lock, contextlib.suppress(OSError):
            channel.send(self.conn, message)


#: Set in a session process forked from the server, before ``pytest.main`` runs there.
_CHILD: Child | None = None


def forked() -> Child | None:
    """This process's link to its run when it is a session forked from a warm server; None otherwise."""
    return _CHILD


def run_session(conn: socket.socket, listener: socket.socket, spec: dict[str, Any], server_started: float) -> None:
    """The forked session process: becomes the run that asked, then runs pytest."""
    global _CHILD
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = channel.drain_request(conn)
    if len(fds) != 3:
        channel.send(conn, {"declined": "the run's standard streams did not arrive"})
        return
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    encodings = request.get("stdio") or [[None, None]] * 3
    sys.stdin, sys.stdout, sys.stderr = (_text_stream(fd, *encodings[fd]) for fd in range(3))
    from dstest.worlds.process.byref import fork_server_from_here

    # The process world's fork server: a fork of this process before pytest touches it, with the server's
    # imports, sys.path and environment, as a fresh fork server would have after importing them, and the
    # run's standard streams, as a fork server started by the run would have.
    fork_server_from_here(spec["preload"], close_in_server=[conn.fileno()])
    os.chdir(request["cwd"])
    if request["args"] == spec.get("args"):
        _prestart_pools(spec.get("pools") or [], spec["env"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[:] = request["sys_path"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _CHILD = Child(conn, spec, time.time(), server_started)
    _CHILD.send({"pid": os.getpid()})
    threading.Thread(target=_watch_run, args=(conn,), name="dstest-warm-watch", daemon=True).start()
    import pytest

    code = 1
    try:
        code = int(pytest.main(list(request["args"])))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        _CHILD.send({"exit": code})
        os._exit(code)


def _prestart_pools(world_sizes: list[int], env: dict[str, str]) -> None:
    """Start the pools the cold run's tests used, without waiting, for a run of the same arguments: their
    workers form their groups while pytest starts, configures and collects, instead of in the first test
    that needs them. A pool's workers take the environment of the moment it starts: the one the cold run
    had once configured, which this session must still have once configured (else it declines, and the
    pools end with it)."""
    if not world_sizes:
        return
    from dstest.worlds.process import ProcessWorld

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        ProcessWorld().prestart(world_sizes)
    except Exception as exc:  # the first test starts its pool, as without this, and reports what fails
        print(f"dstest warm: the pools of {world_sizes} ranks were not started ahead: {exc!r}", file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _text_stream(fd: int, encoding: str | None, errors: str | None) -> Any:
    """A standard stream on ``fd`` with the run's encoding, line-buffered on a terminal as at start-up."""
    mode = "r" if fd == 0 else "w"
    return open(  # lives as long as the process
        fd,
        mode,
        buffering=1 if mode == "w" and os.isatty(fd) else -1,
        encoding=encoding or "utf-8",
        errors=errors or ("backslashreplace" if fd == 2 else "strict"),
        closefd=False,
    )


def _watch_run(conn: socket.socket) -> None:
    """The run's process went away (killed, its terminal closed): interrupt the session as Ctrl-C would."""
    with contextlib.suppress(OSError):
        while conn.recv(1 << 12):
            pass
    os.kill(os.getpid(), signal.SIGINT)


def check_session(config: Any) -> str | None:
    """In a forked session, once conftests and plugins are configured: None when ``sys.path`` and the
    environment are those the server imported with; else the difference (the session then declines)."""
    if _CHILD is None:
        return None
    return session_differs(_CHILD.spec, config)


def decline(reason: str) -> None:
    """In a forked session that found a difference before writing anything: the run goes on cold."""
    assert _CHILD is not None
    _CHILD.send({"declined": reason})
    os._exit(0)
