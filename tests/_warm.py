"""Waiting for a ``--dstest-warm`` server and stopping them, for the tests that start one (imported by name:
``tests/`` is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def wait_for_server(warm_dir: Path, timeout: float = 180.0) -> None:
    """Until a server in ``warm_dir`` listens (its socket is there); its log in the error if none does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(warm_dir.glob("*.sock")):
            return
        time.sleep(0.2)
    logs = "\n".join(p.read_text() for p in warm_dir.glob("*.log"))
    raise AssertionError(f"no warm server came up in {timeout} s; its log:\n{logs}")


def settled(path: Path) -> None:
    """Until ``path`` changed longer ago than the warm server's margin: a server that starts importing it later
    knows which version it imported (a change within the margin is one it cannot date, ``MARGIN_NS``). A fresh
    child session takes longer than the margin to start one; a forked one does not."""
    from dstest.pytest.warm.sources import MARGIN_NS

    while (left := path.stat().st_ctime_ns + MARGIN_NS - time.time_ns()) > 0:
        time.sleep(left / 1e9 + 0.01)


def stop_servers() -> None:
    """Stop the warm servers of ``DSTEST_WARM_DIR`` (``python -m dstest.pytest.warm --stop``)."""
    subprocess.run(
        [sys.executable, "-m", "dstest.pytest.warm", "--stop"], env=dict(os.environ), capture_output=True, timeout=60
    )
