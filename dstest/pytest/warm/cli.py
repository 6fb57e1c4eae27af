"""``python -m dstest.pytest.warm SPEC.json | --stop``: serve as the warm server ``SPEC.json`` describes (a
cold run starts it so), or stop this user's servers.

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sys

from dstest.pytest.warm.channel import state_dir
from dstest.pytest.warm.server import serve


def stop_all() -> list[int]:
    """Stop this user's warm servers; returns their pids."""
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
