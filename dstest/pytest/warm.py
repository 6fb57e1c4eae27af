"""Warm sessions: ``pytest --dstest-warm`` hands the invocation to a server that has already imported what
the session needs, so that a developer rerunning one small file does not wait for torch, DeepSpeed and the
process world's fork server to import again.

How it works:

- **The first run is cold.** It runs as without the option, then starts a server in the background (one
  per Python, directory, environment and ``-p`` plugins). The server sets the ``sys.path`` and environment
  the session had once its conftests and plugins were configured, imports pytest and the modules the
  process world's fork server imported (torch, DeepSpeed for ``-p dstest.compat.deepspeed``...), and
  waits on a Unix socket in a directory only this user can read.
- **A later run is forked from it.** Before pytest loads any conftest, the run connects and sends its
  arguments, ``sys.argv``, directory, environment and its standard streams (the file descriptors
  themselves, so that colours, widths and a ``| tee`` behave as in the run's own process). The server forks
  a session process, which first forks the process world's fork server from itself (ready at once), then
  runs ``pytest.main`` with those arguments and that environment; the run's process waits, passes Ctrl-C
  on, and exits with the session's exit status.
- **Never stale code.** Before every fork, the server checks that the file of every module it has imported
  holds the bytes it imported, and that no directory of its ``sys.path`` now holds another copy of a
  top-level module it imported (:mod:`dstest.pytest.warm_sources`: stamps trusted only when they are older
  than the server's start, digests where a stamp changed). Then, in the session process once its conftests
  have run, ``sys.path`` and the environment are compared with those the server was started from. Any
  difference, and the run is cold again, saying why in its header; a server that found a changed file
  stops, and the cold run starts a fresh one. Modules the server did not import (the tests, the
  conftests, what they import) are imported by each session anew, as always.
- **What runs cold anyway:** a run with ``--pdb``, ``--trace`` or ``-s`` (the terminal is the run's
  own process's, not the server's) and ``pytest.main(plugins=[...])`` calls (objects cannot be handed
  over). Modules of pytest plugins installed by entry points are not imported by the server: pytest
  rewrites their assertions as it imports them, which it cannot do to a module already imported.

The header of every ``--dstest-warm`` run says which it was. The server exits after
``DSTEST_WARM_IDLE`` seconds without a run (default 1800); ``python -m dstest.pytest.warm --stop`` stops
this user's servers. Its files (socket, log) are under ``DSTEST_WARM_DIR`` (default
``$TMPDIR/dstest-warm-<uid>``).

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

from dstest.pytest.warm_sources import Sources, resolve

ENV_DIR = "DSTEST_WARM_DIR"
ENV_IDLE = "DSTEST_WARM_IDLE"
_IDLE_DEFAULT = 1800.0
#: Environment variables that change between two shell commands without changing what a run does.
_VOLATILE_ENV = frozenset({"_", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST", "PYTEST_VERSION"})
_MAX_MESSAGE = 1 << 22


@dataclass
class WarmState:
    """What a ``--dstest-warm`` run of this process knows: how it runs and what the server needs."""

    key: str
    why: str  # for the header: why this run is cold
    sys_path: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    origins_at_end: dict[str, str] = field(default_factory=dict)


#: Set in a session process forked from the server, before ``pytest.main`` runs there.
_CHILD: _Child | None = None


# -- where the servers live ------------------------------------------------------------------------------
def state_dir() -> str:
    """This user's directory of servers, created private; refused when another user can write to it."""
    path = os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), f"dstest-warm-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path}: a warm server's directory must be this user's alone (mode 0700)")
    return path


def _plugins_named(args: list[str]) -> list[str]:
    named = []
    for i, arg in enumerate(args):
        if arg == "-p" and i + 1 < len(args):
            named.append(args[i + 1])
        elif arg.startswith("-p") and len(arg) > 2:
            named.append(arg[2:])
    return sorted(named)


def server_key(args: list[str], cwd: str, env: dict[str, str]) -> str:
    """One server per Python (and its flags), directory, environment and ``-p`` plugins."""
    payload = {
        "python": sys.executable,
        "flags": repr(sys.flags),
        "warnoptions": sys.warnoptions,
        "xoptions": sorted(map(str, sys._xoptions.items())),
        "cwd": cwd,
        "env": sorted((k, v) for k, v in env.items() if k not in _VOLATILE_ENV),
        "plugins": _plugins_named(args),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _socket_path(key: str) -> str:
    return os.path.join(state_dir(), f"{key}.sock")


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


# -- the run's own process (the client) ------------------------------------------------------------------
def _cold_reason(config: Any) -> str | None:
    """Why this run cannot be handed over, or None."""
    ns = config.known_args_namespace
    if getattr(ns, "usepdb", False) or getattr(ns, "trace", False):
        return "--pdb/--trace read the terminal, which only this process has"
    if getattr(ns, "capture", "fd") == "no":
        return "-s: the tests may read the terminal, which only this process has"
    if config.invocation_params.plugins:
        return "pytest.main(plugins=...) objects cannot be handed to a server"
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return f"file descriptor {fd} is closed"
    return None


def hand_over(config: Any) -> WarmState:
    """In a ``--dstest-warm`` run, before any conftest: run in a warm server's session if one takes it (this
    process then exits with its status and this function does not return); else the run goes on here, cold,
    with the returned state saying why."""
    args = [str(a) for a in config.invocation_params.args]
    cwd = os.getcwd()
    env = dict(os.environ)
    key = server_key(args, cwd, env)
    reason = _cold_reason(config)
    if reason is not None:
        return WarmState(key, reason)
    try:
        path = _socket_path(key)
    except OSError as exc:
        return WarmState(key, str(exc))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return WarmState(key, "no warm server for this directory, environment and plugins yet")
    stdio = [[getattr(s, "encoding", None), getattr(s, "errors", None)] for s in (sys.stdin, sys.stdout, sys.stderr)]
    # sys.path as at start-up: pytest.main puts the ini's ``pythonpath`` in front again in the session.
    inserted = [str(p) for p in config.getini("pythonpath")]
    if sys.path[: len(inserted)] != inserted:
        return WarmState(key, "sys.path does not start with the ini's pythonpath as pytest put it")
    path_at_start = sys.path[len(inserted) :]
    request = {"args": args, "argv": sys.argv, "cwd": cwd, "env": env, "stdio": stdio, "sys_path": path_at_start}
    with sock, sock.makefile("rb") as replies:
        try:
            _send(sock, request, [0, 1, 2])
            reply = _read(replies)
        except OSError as exc:
            return WarmState(key, f"the warm server did not answer ({exc})")
        if "closed" in reply:
            return WarmState(key, "the warm server closed the connection")
        if "declined" in reply:
            return WarmState(key, str(reply["declined"]))
        pid = int(reply["pid"])
        forwarded = {}

        def forward(signum: int, frame: Any) -> None:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            forwarded[sig] = signal.signal(sig, forward)
        while True:
            try:
                reply = _read(replies)
            except InterruptedError:
                continue
            if "declined" in reply:  # the session saw a difference before it wrote anything
                for sig, handler in forwarded.items():
                    signal.signal(sig, handler)
                return WarmState(key, str(reply["declined"]))
            if "closed" in reply:
                print("dstest warm: the session process ended without an exit status", file=sys.stderr, flush=True)
                os._exit(3)
            if "exit" in reply:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(int(reply["exit"]))


def _read(replies: Any) -> dict[str, Any]:
    line = replies.readline(_MAX_MESSAGE)
    if not line:
        return {"closed": True}
    message = json.loads(line)
    if not isinstance(message, dict):
        raise OSError(f"unexpected message from the warm server: {line[:200]!r}")
    return message


def record_configured(state: WarmState) -> None:
    """At the end of configuration of a cold run: the ``sys.path`` and environment the server will import
    with, those the conftests and plugins left."""
    state.sys_path = list(sys.path)
    state.env = dict(os.environ)
    state.origins = _loaded_origins()


def _loaded_origins() -> dict[str, str]:
    """The file of every top-level module imported now: which copy of a package this process uses (a
    plugin may have imported the installed one before a conftest put a checkout on ``sys.path``)."""
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." not in name and not name.startswith("__") and isinstance(path, str):
            found[name] = os.path.abspath(path)
    return found


def _preload_of_this_run() -> list[str]:
    names: list[str] = []
    if "dstest.worlds.process.launch" in sys.modules:  # this run's process world listed a preload
        from dstest.worlds.process.byref import fork_server_preload

        names = fork_server_preload()
    if "torch" in sys.modules and "torch" not in names:
        names.append("torch")
    return [n for n in names if n != "__main__"]


def start_server(state: WarmState) -> str:
    """After a cold run: start its server in the background unless one already serves its key. Returns a
    line for the terminal."""
    try:
        path = _socket_path(state.key)
    except OSError as exc:
        return f"no warm server started: {exc}"
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(path)
        return "a warm server is already running for the next run"
    rewritten = _rewritten_by_pytest() - {"dstest"}
    # Before the server reads any file: the time its stamps must be older than to be trusted, and where each
    # top-level module of this run would be found, the baseline for another copy appearing on sys.path.
    since_ns = time.time_ns()
    resolved = resolve(_top_level_names(), state.sys_path)
    spec = {
        "key": state.key,
        "since_ns": since_ns,
        "resolved": resolved,
        "cwd": os.getcwd(),
        "sys_path": state.sys_path,
        "env": state.env,
        "preload": _preload_of_this_run(),
        "origins": state.origins,
        # what pytest rewrote in this run of the packages of plugins installed by entry point (hypothesis)
        "rewritten": sorted(n for n in rewritten if n in sys.modules and n in state.origins_at_end),
    }
    directory = os.path.dirname(path)
    spec_path = os.path.join(directory, f"{state.key}.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    with open(os.path.join(directory, f"{state.key}.log"), "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "dstest.pytest.warm", spec_path],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=state.env,
            close_fds=True,
        )
    return "a warm server is starting for the next run (--dstest-warm)"


# -- the server ------------------------------------------------------------------------------------------
def _rewritten_by_pytest() -> set[str]:
    """Top-level names pytest rewrites on import in every session: those of distributions that install a
    pytest plugin by entry point. The server leaves them to the session."""
    import importlib.metadata

    names: set[str] = set()
    for dist in importlib.metadata.distributions():
        if not any(ep.group == "pytest11" for ep in dist.entry_points):
            continue
        for file in dist.files or []:
            parts = file.parts
            if len(parts) == 1 and parts[0].endswith(".py"):
                names.add(parts[0][:-3])
            elif len(parts) == 2 and parts[1] == "__init__.py" and ".dist-info" not in parts[0]:
                names.add(parts[0])
    return names


def _imported_files() -> list[str]:
    """The file of every module imported now: those a loader read (their spec has a location), and any other
    module's ``__file__`` that is a file (``torch.ops`` names a ``_ops.py`` that is not one)."""
    files = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        if getattr(getattr(module, "__spec__", None), "has_location", False) or os.path.isfile(path):
            files.append(path)
    return files


def _top_level_names() -> list[str]:
    """The top-level modules imported now that a file provides, whose lookup on ``sys.path`` must not change."""
    names = []
    for name in sorted({n.partition(".")[0] for n in sys.modules}):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is not None and name != "__main__":
            names.append(name)
    return names


@dataclass
class _Child:
    """The session process's link to the run that asked for it."""

    conn: socket.socket
    spec: dict[str, Any]
    started: float
    server_started: float
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        with self.lock, contextlib.suppress(OSError):
            _send(self.conn, message)


def serve(spec_path: str) -> int:
    """The server's main loop (``python -m dstest.pytest.warm SPEC``)."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    started = time.time()
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = spec["sys_path"]
    import pytest  # noqa: F401  (the session's first import)

    skip = _rewritten_by_pytest() - {"dstest"}  # dstest's package opts out (PYTEST_DONT_REWRITE)
    preload = [n for n in spec["preload"] if n.partition(".")[0] not in skip]
    with warnings.catch_warnings(record=True) as caught:  # given here once; a session does not see them
        warnings.simplefilter("always")
        # The packages pytest rewrites (hypothesis) first, through its rewriting, before the preload can
        # import them plainly (torch's test bases import hypothesis); the empty session that does it imports
        # the entry-point plugins, of which only dstest is not rewritten, and this server already runs it.
        if spec.get("rewritten"):
            _import_rewritten(spec["rewritten"])
        for name in preload:
            try:
                _import_as_recorded(name, spec["origins"])
            except Exception as exc:  # the session imports it again and reports what fails
                print(f"warm server: {name} not preloaded: {type(exc).__name__}: {exc}", flush=True)
    spec["import_warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})
    differ = _origins_differ(spec["origins"])
    if differ is not None:
        print(f"warm server: {differ}; not serving", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leaves by the finally below
    if threading.active_count() != 1:
        print(f"warm server: importing the preload started threads {threading.enumerate()}; not serving", flush=True)
        return 1
    taking = time.monotonic()
    sources = Sources.take(_imported_files(), _top_level_names(), sys.path, spec["since_ns"], spec["resolved"])
    taken = time.monotonic() - taking
    # What the server imported lives as long as every session: out of the collector's sight, so that a
    # session's collections (pytest collects twice at its end) walk only the session's own objects, and do
    # not touch, and so copy, the pages it shares with the server.
    gc.collect()
    gc.freeze()
    path = os.path.join(os.path.dirname(spec_path), f"{spec['key']}.sock")
    listener = _bind(path)
    if listener is None:
        return 0
    print(
        f"warm server {os.getpid()}: {len(sources.files)} files (stamped in {taken:.2f} s), serving {path} after "
        f"{time.time() - started:.1f} s",
        flush=True,
    )
    idle = float(os.environ.get(ENV_IDLE, _IDLE_DEFAULT))
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    try:
        while True:
            _reap(children)
            if not children and time.monotonic() - last > idle:
                return 0
            listener.settimeout(1.0)
            try:
                conn, _ = listener.accept()
            except (TimeoutError, InterruptedError):
                continue
            last = time.monotonic()
            conn.settimeout(None)
            stale = sources.changed()
            if stale is not None:
                with conn, contextlib.suppress(OSError):
                    for fd in _drain_request(conn)[1]:
                        os.close(fd)
                    _send(conn, {"declined": stale})
                print(f"warm server: {stale}; stopping", flush=True)
                return 0
            pid = os.fork()
            if pid == 0:
                try:
                    _session(conn, listener, spec, started)
                finally:
                    os._exit(70)
            children[pid] = conn
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


class _ImportRewritten:
    """The plugin of the server's one empty pytest session: imports packages while pytest's assertion
    rewriting is installed, so that pytest rewrites them as it does in every session."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.failed: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        for name in self.names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # the session imports it again and reports what fails
                self.failed[name] = f"{type(exc).__name__}: {exc}"


def _import_rewritten(names: list[str]) -> None:
    """Import the packages of entry-point plugins that the cold run imported (hypothesis, when a conftest
    asks for its header) the way a session does: through pytest's assertion rewriting, which a session then
    finds done (it warns about a package imported without it). Without this each run rewrites them anew,
    about 1.6 s for hypothesis where ``PYTHONDONTWRITEBYTECODE`` keeps pytest from caching the result. The
    session is empty: an empty directory, its own ini file, no ``PYTEST_ADDOPTS``. What it imported stays
    imported (pytest's own modules, the plugins' modules): the sessions configure those plugins afresh."""
    saved_env = {k: os.environ.pop(k) for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS") if k in os.environ}
    plugin = _ImportRewritten(names)
    out = io.StringIO()
    try:
        with tempfile.TemporaryDirectory() as empty, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ini = os.path.join(empty, "pytest.ini")
            with open(ini, "w", encoding="utf-8") as f:
                f.write("[pytest]\n")
            code = pytest.main(
                ["-c", ini, "--rootdir", empty, "-p", "no:cacheprovider", "-q", "--co", empty], plugins=[plugin]
            )
    finally:
        os.environ.update(saved_env)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) or plugin.failed:
        print(f"warm server: the empty session to import {names} ended with {code}; {plugin.failed}", flush=True)
        print(out.getvalue()[-4000:], flush=True)


def _import_as_recorded(name: str, origins: dict[str, str]) -> None:
    """Import ``name`` from the copy the cold run had: a ``sys.path`` entry that holds another copy of its
    top-level package before the recorded one is left out while the package itself is imported."""
    top = name.partition(".")[0]
    want = origins.get(top)
    if top not in sys.modules and want is not None:
        root = os.path.dirname(os.path.dirname(want)) if want.endswith("__init__.py") else os.path.dirname(want)
        saved = list(sys.path)
        try:
            sys.path[:] = [e for e in saved if os.path.abspath(e or ".") == root or not _holds(e, top)]
            importlib.import_module(top)
        finally:
            sys.path[:] = saved
    importlib.import_module(name)


def _holds(entry: str, top: str) -> bool:
    base = os.path.join(entry or ".", top)
    return os.path.isdir(base) or os.path.exists(base + ".py")


def _origins_differ(recorded: dict[str, str]) -> str | None:
    now = _loaded_origins()
    for name, path in sorted(now.items()):
        if name in recorded and recorded[name] != path:
            return f"module {name!r} is {path} here, {recorded[name]} in the cold run"
    return None


def _bind(path: str) -> socket.socket | None:
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(path)
    except OSError:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(path)
            listener.close()
            return None  # another server already serves this key
        os.unlink(path)
        listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(8)
    return listener


def _reap(children: dict[int, socket.socket]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if not done:
            continue
        conn = children.pop(pid)
        if os.WIFSIGNALED(status):  # the session could not say so itself
            sig = os.WTERMSIG(status)
            with contextlib.suppress(OSError):
                _send(conn, {"exit": 128 + sig, "signal": sig})
        conn.close()


def _drain_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data = b""
    fds: list[int] = []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            raise OSError("the run closed the connection before its request was complete")
        data += chunk
        fds += more
        if len(data) > _MAX_MESSAGE:
            raise OSError("request too large")
    for fd in fds[3:]:
        os.close(fd)
    return json.loads(data), fds[:3]


def _session(conn: socket.socket, listener: socket.socket, spec: dict[str, Any], server_started: float) -> None:
    """The forked session process: becomes the run that asked, then runs pytest."""
    global _CHILD
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = _drain_request(conn)
    if len(fds) != 3:
        _send(conn, {"declined": "the run's standard streams did not arrive"})
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
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[:] = request["sys_path"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _CHILD = _Child(conn, spec, time.time(), server_started)
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
    spec = _CHILD.spec
    differ = _origins_differ(spec["origins"])
    if differ is not None:
        return differ
    if spec.get("import_warnings") and _warnings_are_errors(config):
        return (
            f"warnings are errors in this run and the warm server's imports gave {len(spec['import_warnings'])} "
            f"warnings that it would not see (first: {spec['import_warnings'][0]})"
        )
    if list(sys.path) != list(spec["sys_path"]):
        return f"sys.path after configuration differs from the warm server's: {sys.path} != {spec['sys_path']}"
    env = dict(os.environ)
    names = sorted(
        k for k in set(env) | set(spec["env"]) if k not in _VOLATILE_ENV and env.get(k) != spec["env"].get(k)
    )
    if names:
        return f"the environment after configuration differs from the warm server's in {', '.join(names)}"
    return None


def _warnings_are_errors(config: Any) -> bool:
    """Whether a warning filter of this run (``-W``, the ini's ``filterwarnings``, ``PYTHONWARNINGS``) makes
    some warning an error: an import-time warning the server saw would then fail a cold run's collection."""
    filters = [*sys.warnoptions, *(config.known_args_namespace.pythonwarnings or []), *config.getini("filterwarnings")]
    return any(str(f).strip().startswith("error") for f in filters)


def decline(reason: str) -> None:
    """In a forked session that found a difference before writing anything: the run goes on cold."""
    assert _CHILD is not None
    _CHILD.send({"declined": reason})
    os._exit(0)


# -- the hooks (a plugin of dstest's: ``pytest_plugins`` of dstest.pytest.plugin) --------------------------
_STATE = pytest.StashKey[WarmState]()


@pytest.hookimpl(wrapper=True, tryfirst=True)  # before pytest's capture starts: the streams handed over are the run's
def pytest_load_initial_conftests(early_config: pytest.Config) -> Any:
    # An xdist worker finds no server: its environment holds the run's PYTEST_XDIST_TESTRUNUID, new each run.
    if getattr(early_config.known_args_namespace, "dstest_warm", False) and _CHILD is None:
        early_config.stash[_STATE] = hand_over(early_config)
    return (yield)


@pytest.hookimpl(trylast=True)  # after the conftests' and the other plugins' configuration
def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("dstest_warm", False):
        return
    if _CHILD is not None:
        reason = check_session(config)
        if reason is not None:
            decline(reason)
        return
    state = config.stash.get(_STATE, None)
    if state is not None:
        record_configured(state)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption("dstest_warm", False):
        return None
    if _CHILD is not None:
        age = _CHILD.started - _CHILD.server_started
        return f"dstest warm: forked from a warm server (pid {os.getppid()}, started {age:.0f} s before this run)"
    state = config.stash.get(_STATE, None)
    return None if state is None else f"dstest warm: cold run ({state.why})"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    worker = hasattr(config, "workerinput")  # an xdist worker's run is its controller's
    if state is not None and _CHILD is None and state.env and not worker:
        state.origins_at_end = _loaded_origins()
        terminalreporter.write_line(f"dstest warm: {start_server(state)}")


def stop_all() -> list[int]:
    """Stop this user's warm servers; returns their pids."""
    import glob

    stopped = []
    for path in glob.glob(os.path.join(state_dir(), "*.sock")):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(path)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = int.from_bytes(creds[:4], sys.byteorder)
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
    return stopped


def main(argv: list[str]) -> int:
    if argv == ["--stop"]:
        pids = stop_all()
        print(f"stopped {len(pids)} warm server(s) {pids}")
        return 0
    if len(argv) != 1:
        print("usage: python -m dstest.pytest.warm SPEC.json | --stop", file=sys.stderr)
        return 2
    return serve(argv[0])


if __name__ == "__main__":  # run as ``-m``: serve from the module the plugin imports, not from ``__main__``
    from dstest.pytest.warm import main as _main

    sys.exit(_main(sys.argv[1:]))
