"""The suite's child pytest sessions, forked from a warm interpreter instead of started fresh (issue 44, item 6).

Many tests run pytest in a subprocess (``pytester.runpytest_subprocess``): a fresh interpreter each, which
imports torch and pytest again (about 1 s of CPU on this project's 2-core machines) before the child session
does what the test is about. Here each test process keeps one server that imported them once; a child session
is a fork of it, given the child's working directory, environment, arguments and standard streams, and run as
``python -m pytest`` runs it (runpy with ``alter_sys``), and ends as an interpreter ends (its threads joined,
its atexit functions run, its streams flushed) without the teardown of its modules.

What a fork cannot give as a fresh interpreter does is what was read from the environment while torch, numpy
and pytest were imported. A child whose environment differs from the server's in such a variable
(:data:`READ_AT_IMPORT`) runs fresh, as does every child of a test marked ``fresh_interpreter`` (one about a
cold start, about which modules a session imports, about its process tree or about what an interpreter's
teardown does) and every child when ``DSTEST_SUITE_FORK=0``; ``DSTEST_SUITE_FORK_LOG=PATH`` appends, per child,
whether it was forked. The server imports neither dstest nor any other pytest plugin: pytest rewrites the
asserts of its plugins' modules, and warns about one imported before the session began.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

#: Variables read while the server imports torch, numpy and pytest (or by the interpreter at its start): a
#: child whose value of one differs from the server's runs in a fresh interpreter (but see READ_AT_USE).
READ_AT_IMPORT = (
    "PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL", "OPENBLAS", "NPY_", "CUDA", "NVIDIA", "LD_",
    "MALLOC", "LC_", "LANG", "TMP", "TEMP", "TRITON", "KINETO",
)  # fmt: skip

#: Among those, variables read when used, not at import: torch itself sets the first two (to their defaults)
#: in a test process that compiled something, and a forked child's ``sys.path`` is made from its PYTHONPATH.
READ_AT_USE = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTHONPATH"})

_ENABLED = os.environ.get("DSTEST_SUITE_FORK", "1") != "0"
_lock = threading.Lock()
_server: _Server | None = None
#: The environment the test process had when this module was imported (conftest): the server's, whatever a
#: test has set by the time the first child starts.
_SNAPSHOT = dict(os.environ)


def differs_at_import(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """The variables read at import (:data:`READ_AT_IMPORT`) whose value in ``env`` is not that in ``base``."""
    names = {k for k in (*env, *base) if k.startswith(READ_AT_IMPORT) and k not in READ_AT_USE}
    return sorted(k for k in names if env.get(k) != base.get(k))


# -- the server (its own interpreter: ``python tests/_forked_children.py SOCKET``) -------------------------
def _serve(path: str) -> None:
    import selectors
    import signal

    import numpy  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    from _pytest.config import default_plugins

    for name in default_plugins:  # pytest's own plugins, as every session imports them (not rewritten)
        __import__(f"_pytest.{name}")
    if threading.active_count() != 1:
        raise RuntimeError(f"the server has threads after its imports: {threading.enumerate()}")
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = sys.path[len(pythonpath) :]  # PYTHONPATH, then the interpreter's own (its script's folder gone)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # EOF: the test process is gone
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.buffer.read1(1 << 16):
                    os._exit(0)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for fd in (listener.fileno(), wake_r, wake_w, conn.fileno(), *children.values()):
                        _close(fd)  # the server's descriptors, and its connections to the other children
                    _become_child(json.loads(message), fds, base_path)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                children[pid] = conn
            else:
                os.read(wake_r, 4096)
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    done = children.pop(pid, None)
                    if done is not None:
                        try:
                            done.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                        except OSError:
                            pass  # the test process stopped waiting
                        done.close()


def _close(fd: Any) -> None:
    try:
        os.close(fd if isinstance(fd, int) else fd.fileno())
    except OSError:
        pass


def _become_child(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """In the forked child: become ``python -m pytest ARGS`` run in ``cwd`` with ``env``, and end as an
    interpreter ends (:func:`_exit_as_at_the_end`)."""
    import importlib
    import random
    import runpy
    import signal

    import numpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *pythonpath, *base_path]  # as `python -m` makes it in cwd
    sys.argv = [sys.argv[0], *request["args"]]
    importlib.invalidate_caches()
    random.seed()  # a fresh interpreter's seeds, not the server's state shared by every child
    numpy.random.seed()
    try:
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _exit_as_at_the_end(None)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # an interpreter ends by the signal it did not handle
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit_as_at_the_end(code)


def _exit_code(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit_as_at_the_end(code: int | None) -> None:
    """What an interpreter does at its end, less the teardown of its modules: join its threads, run its atexit
    functions, flush its streams. The teardown (0.35 s of a child session's 0.9 s with torch 2.13, more with
    2.15) only frees what the process's end frees anyway."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    if code is not None:
        os._exit(code)


# -- the test process's side ----------------------------------------------------------------------------
class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dstest-forked-children-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_SNAPSHOT,
            cwd=Path(__file__).parent.parent,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the forked-children server did not start (it wrote {line!r})")

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the server's EOF
        self.proc.stdout.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _get_server() -> _Server:
    global _server, _ENABLED
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            try:
                _server = _Server()
            except RuntimeError:
                _ENABLED = False  # the rest of this test process's children run fresh
                raise
            atexit.register(_server.stop)
        return _server


class ForkedSession:
    """What ``Pytester.run`` asks of a ``Popen``: ``pid``, ``stdin``, ``wait``, ``poll``, ``kill``."""

    stdin = None
    stdout = None
    stderr = None

    def __init__(self, args: list[str], conn: socket.socket, pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def _read(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            message = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):  # a timeout of 0 (poll) makes the socket non-blocking
            return None
        self._conn.close()
        # an empty message: the server is gone before it reaped the child (the test process's end)
        self.returncode = json.loads(message)["returncode"] if message else -9
        return self.returncode

    def poll(self) -> int | None:
        return self._read(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)

    def __enter__(self) -> ForkedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


def start(args: list[str], cwd: str, env: dict[str, str], stdin: int, stdout: int, stderr: int) -> ForkedSession:
    """``python -m pytest *args`` forked from the server, its standard streams the given descriptors."""
    server = _get_server()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(server.path)
    message = json.dumps({"args": args, "cwd": cwd, "env": env}).encode()
    socket.send_fds(conn, [message], [stdin, stdout, stderr])
    pid = json.loads(conn.recv(4096))["pid"]
    return ForkedSession([sys.executable, "-mpytest", *args], conn, pid)


#: Whether the running test lets its child sessions be forked (tests/conftest.py sets it per test).
allowed = True
#: ``Pytester.popen``'s default standard input: a pipe closed at once.
CLOSE_STDIN = pytest.Pytester.CLOSE_STDIN


def forking_popen(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Pytester.popen``, forking a child pytest session where it can (see the module's docstring)."""

    def popen(
        self: Any,
        cmdargs: Any,
        stdout: Any = subprocess.PIPE,
        stderr: Any = subprocess.PIPE,
        stdin: Any = CLOSE_STDIN,
        **kw: Any,
    ) -> Any:
        def fresh() -> Any:
            return original(self, cmdargs, stdout=stdout, stderr=stderr, stdin=stdin, **kw)

        args = [os.fspath(a) for a in cmdargs]
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        differs = differs_at_import(env, _SNAPSHOT)
        eligible = (
            _ENABLED
            and allowed
            and not kw
            and args[:2] == [sys.executable, "-mpytest"]
            and (stdin is CLOSE_STDIN or isinstance(stdin, bytes))
            and hasattr(stdout, "fileno")
            and hasattr(stderr, "fileno")
            and hasattr(socket, "send_fds")
            and sys.platform == "linux"
            and not differs
        )
        log = os.environ.get("DSTEST_SUITE_FORK_LOG")
        if log:  # for measuring: which child sessions were forked, which ran fresh and why
            why = "forked" if eligible else f"fresh {differs or ''} {args[:2]} {sorted(kw)}"
            with open(log, "a") as f:
                f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{why}\n")
        if not eligible:
            return fresh()
        stdout.flush()
        stderr.flush()
        read_end, write_end = os.pipe()
        try:
            session = start(args[2:], os.getcwd(), env, read_end, stdout.fileno(), stderr.fileno())
        except (OSError, RuntimeError):  # no server (tests/test_forked_children.py fails then): a fresh child
            os.close(write_end)
            return fresh()
        finally:
            os.close(read_end)
        with os.fdopen(write_end, "wb") as to_child:
            if isinstance(stdin, bytes):
                to_child.write(stdin)
        return session

    popen.forks = True  # type: ignore[attr-defined]
    return popen


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder (tests/): the server imports nothing of the suite's
    _serve(sys.argv[1])
