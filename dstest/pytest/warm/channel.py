"""Where this user's warm servers live, which server a run belongs to, and the messages between a run, its
server and the sessions the server forks: one JSON object a line over a Unix socket, the run's standard
streams passed beside the request as file descriptors.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
from typing import Any

ENV_DIR = "DSTEST_WARM_DIR"
ENV_IDLE = "DSTEST_WARM_IDLE"
IDLE_DEFAULT = 1800.0
ENV_WATCH = "DSTEST_WARM_WATCH"
#: Seconds between two checks of an idle server's files: a server whose sources changed stops within this
#: long, not at the next run (each check costs 20-60 ms of one core over torch's ~2,300 files).
WATCH_DEFAULT = 10.0
#: Environment variables that change between two shell commands without changing what a run does.
VOLATILE_ENV = frozenset({"_", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST", "PYTEST_VERSION"})
MAX_MESSAGE = 1 << 22


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
        "env": sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV),
        "plugins": _plugins_named(args),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def socket_path(key: str) -> str:
    return os.path.join(state_dir(), f"{key}.sock")


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def read(replies: Any) -> dict[str, Any]:
    """The next message on ``replies`` (a file over the socket); ``{"closed": True}`` at its end."""
    line = replies.readline(MAX_MESSAGE)
    if not line:
        return {"closed": True}
    message = json.loads(line)
    if not isinstance(message, dict):
        raise OSError(f"unexpected message from the warm server: {line[:200]!r}")
    return message


def drain_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A run's request and the first three file descriptors that came with it (its standard streams)."""
    data = b""
    fds: list[int] = []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            raise OSError("the run closed the connection before its request was complete")
        data += chunk
        fds += more
        if len(data) > MAX_MESSAGE:
            raise OSError("request too large")
    for fd in fds[3:]:
        os.close(fd)
    return json.loads(data), fds[:3]
