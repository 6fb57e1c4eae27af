"""The parent's handle on one worker process: its process, its two pipes (runs and replies; the cross-rank
check's posts and verdicts), and what it printed (its log file), read for failure reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from dstest.worlds.process.messages import WorkerConfig


class WorkerHandle:
    """The parent's side of one worker of a pool (made when the pool launches it)."""

    def __init__(self, rank: int, process: Any, conn: Connection, cfg: WorkerConfig, check: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.cfg = cfg
        self.check = check  # calls to check and verdicts (gloo pools; unused by NCCL ones)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "is still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def log_size(self) -> int:
        """Where the worker's log ends now: what it prints from here on belongs to the next run."""
        return file_size(self.cfg.log_path)

    def output_since(self, offset: int, limit: int = 8000) -> str:
        """What this worker printed from ``offset`` of its log on (the last ``limit`` bytes of it)."""
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(offset, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, limit: int = 4000) -> str:
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
