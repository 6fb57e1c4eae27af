"""The warm server (``python -m dstest.pytest.warm SPEC``): takes the ``sys.path`` and environment of the
cold run that started it, imports what that run's sessions need, and forks a session for every run that
connects while none of the files it imported has changed.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import pytest

from dstest.pytest.warm import channel
from dstest.pytest.warm.session import run_session
from dstest.pytest.warm.sources import Sources
from dstest.pytest.warm.staleness import imported_files, origins_differ, rewritten_by_pytest, top_level_names
from dstest.worlds.process.launch import cuda_initialized


def serve(spec_path: str) -> int:
    """The server's main loop (``python -m dstest.pytest.warm SPEC``)."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    started = time.time()
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = spec["sys_path"]
    differ = _preload(spec)
    if differ is not None:
        print(f"warm server: {differ}; not serving", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leaves by the finally below
    if threading.active_count() != 1:
        print(f"warm server: importing the preload started threads {threading.enumerate()}; not serving", flush=True)
        return 1
    if cuda_initialized():  # a session forked from this process could not use CUDA
        print("warm server: importing the preload initialized CUDA; not serving", flush=True)
        return 1
    taking = time.monotonic()
    sources = Sources.take(
        imported_files(),
        top_level_names(),
        sys.path,
        spec["since_ns"],
        spec["resolved"],
        entries_before=spec["sys_path"],
    )
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
    try:
        return _serve_runs(listener, sources, spec, started)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _preload(spec: dict[str, Any]) -> str | None:
    """Import what the cold run's sessions need, as that run had it; None, or why the server must not serve
    (a package imported from another copy than the cold run's)."""
    skip = rewritten_by_pytest() - {"dstest"}  # dstest's package opts out (PYTEST_DONT_REWRITE)
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
    return origins_differ(spec["origins"])


def _serve_runs(listener: socket.socket, sources: Sources, spec: dict[str, Any], started: float) -> int:
    """Fork a session for every run that connects, until the server has been idle too long or a file it
    imported changed (that run is declined and goes on cold)."""
    idle = float(os.environ.get(channel.ENV_IDLE, channel.IDLE_DEFAULT))
    watch = float(os.environ.get(channel.ENV_WATCH, channel.WATCH_DEFAULT))
    children: dict[int, socket.socket] = {}
    last = checked = time.monotonic()
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    where = os.stat(listener.getsockname())  # the file, not the socket (fstat would give the socket)
    while True:
        _reap(children)
        now = time.monotonic()
        if not children and now - last > idle:
            print(f"warm server: no run for {idle:g} s ({channel.ENV_IDLE}); stopping", flush=True)
            return 0
        if not children and now - checked > watch:  # idle: the sessions' CPU is left alone
            checked = now
            gone = _gone(listener, where)
            stale = gone or sources.changed()
            if stale is not None:  # no run could be forked from it again: it would only wait for its idle time
                print(f"warm server: {stale}; stopping", flush=True)
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
                for fd in channel.drain_request(conn)[1]:
                    os.close(fd)
                channel.send(conn, {"declined": stale})
            print(f"warm server: {stale}; stopping", flush=True)
            return 0
        pid = os.fork()
        if pid == 0:
            try:
                run_session(conn, listener, spec, started)
            finally:
                os._exit(70)
        children[pid] = conn


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


def _gone(listener: socket.socket, where: os.stat_result) -> str | None:
    """Why no run can reach this server any more (its socket file was removed or replaced), or None."""
    path = listener.getsockname()
    try:
        st = os.stat(path)
    except OSError:
        return f"its socket {path} was removed"
    if (st.st_dev, st.st_ino) != (where.st_dev, where.st_ino):
        return f"its socket {path} was replaced"
    return None


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
                channel.send(conn, {"exit": 128 + sig, "signal": sig})
        conn.close()
