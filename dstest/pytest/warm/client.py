"""The run's own process (the client): hands the invocation to a warm server's session and exits with its
status, or runs cold and, at its end, starts a server for the next run.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from dstest.pytest.warm.channel import read, send, server_key, socket_path
from dstest.pytest.warm.sources import resolve
from dstest.pytest.warm.staleness import loaded_origins, rewritten_by_pytest, top_level_names


@dataclass
class WarmState:
    """What a ``--dstest-warm`` run of this process knows: how it runs and what the server needs."""

    key: str
    why: str  # for the header: why this run is cold
    sys_path: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    origins_at_end: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # the invocation's arguments


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
        return WarmState(key, reason, args=args)
    try:
        path = socket_path(key)
    except OSError as exc:
        return WarmState(key, str(exc), args=args)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return WarmState(key, "no warm server for this directory, environment and plugins yet", args=args)
    request = _request(config, args, cwd, env)
    if isinstance(request, str):
        sock.close()
        return WarmState(key, request, args=args)
    with sock, sock.makefile("rb") as replies:
        try:
            send(sock, request, [0, 1, 2])
            reply = read(replies)
        except OSError as exc:
            return WarmState(key, f"the warm server did not answer ({exc})", args=args)
        if "closed" in reply:
            return WarmState(key, "the warm server closed the connection", args=args)
        if "declined" in reply:
            return WarmState(key, str(reply["declined"]), args=args)
        return WarmState(key, _follow(replies, int(reply["pid"])), args=args)


def _request(config: Any, args: list[str], cwd: str, env: dict[str, str]) -> dict[str, Any] | str:
    """What the server's session needs to run this invocation; or why it cannot be handed over."""
    stdio = [[getattr(s, "encoding", None), getattr(s, "errors", None)] for s in (sys.stdin, sys.stdout, sys.stderr)]
    # sys.path as at start-up: pytest.main puts the ini's ``pythonpath`` in front again in the session.
    inserted = [str(p) for p in config.getini("pythonpath")]
    if sys.path[: len(inserted)] != inserted:
        return "sys.path does not start with the ini's pythonpath as pytest put it"
    path_at_start = sys.path[len(inserted) :]
    return {"args": args, "argv": sys.argv, "cwd": cwd, "env": env, "stdio": stdio, "sys_path": path_at_start}


def _follow(replies: Any, pid: int) -> str:
    """While the session ``pid`` runs: pass this process's signals on to it, then exit with its status (this
    function then does not return). Returns why, when the session declined before it wrote anything."""
    forwarded = {}

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        forwarded[sig] = signal.signal(sig, forward)
    while True:
        try:
            reply = read(replies)
        except InterruptedError:
            continue
        if "declined" in reply:  # the session saw a difference before it wrote anything
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
            return str(reply["declined"])
        if "closed" in reply:
            print("dstest warm: the session process ended without an exit status", file=sys.stderr, flush=True)
            os._exit(3)
        if "exit" in reply:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(int(reply["exit"]))


def record_configured(state: WarmState) -> None:
    """At the end of configuration of a cold run: the ``sys.path`` and environment the server will import
    with, those the conftests and plugins left."""
    state.sys_path = list(sys.path)
    state.env = dict(os.environ)
    state.origins = loaded_origins()


def _preload_of_this_run() -> list[str]:
    names: list[str] = []
    if "dstest.worlds.process.launch" in sys.modules:  # this run's process world listed a preload
        from dstest.worlds.process.byref import fork_server_preload

        names = fork_server_preload()
    if "torch" in sys.modules and "torch" not in names:
        names.append("torch")
    return [n for n in names if n != "__main__"]


def _pools_of_this_run() -> list[int]:
    """The world sizes of the process world's gloo pools alive now (at the end of a cold run: those its
    tests used)."""
    if "dstest.worlds.process.pool_cache" not in sys.modules:
        return []
    from dstest.worlds.process.pool_cache import pool_pids

    return sorted(ws for backend, ws in pool_pids() if backend == "gloo")


def start_server(state: WarmState) -> str:
    """After a cold run: start its server in the background unless one already serves its key. Returns a
    line for the terminal."""
    try:
        path = socket_path(state.key)
    except OSError as exc:
        return f"no warm server started: {exc}"
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(path)
        return "a warm server is already running for the next run"
    rewritten = rewritten_by_pytest() - {"dstest"}
    # Before the server reads any file: the time its stamps must be older than to be trusted, and where each
    # top-level module of this run would be found, the baseline for another copy appearing on sys.path.
    since_ns = time.time_ns()
    resolved = resolve(top_level_names(), state.sys_path)
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
        # the process world's pools this run used, which a later run with the same arguments starts at once
        "args": state.args,
        "pools": _pools_of_this_run(),
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
