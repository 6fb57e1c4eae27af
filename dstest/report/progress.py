"""Progress of a conformance run on stderr: a live bar on a terminal, a few plain lines in logs.

On a terminal the ``dstest`` command redraws one bar per target (rich): runs done of the total, the
counts so far (pass / FAIL / DEV / skip), the time elapsed and an estimate of the time left. Where stderr
is not a terminal (CI logs, a redirect), it prints ``dstest: N/TOTAL runs done`` at each tenth of the run
and at its end, as it always has, so logs read the same.

rich is imported only for the bar, when stderr is a terminal.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, TextIO

__all__ = ["LiveBar", "PlainLines", "Progress", "for_stream"]

#: Outcome -> the field of the bar that counts it.
_FIELDS = {"pass": "passed", "fail": "failed", "deviation": "deviations", "skip": "skipped"}


class Progress(Protocol):
    """What the conformance report tells its progress display."""

    def start(self, total: int) -> None:
        """The run of ``total`` cases begins (collection is done)."""

    def advance(self, status: str, done: int) -> None:
        """One more case finished with ``status`` (pass, fail, deviation, skip); ``done`` so far."""

    def close(self) -> None:
        """The run is over, or stopped: leave the display as it is, the cursor on a new line."""


class PlainLines:
    """A line at each tenth of the run and at its end, for logs: ``dstest: 69/693 runs done``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.total = 0

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, status: str, done: int) -> None:
        if done == self.total or done % max(1, self.total // 10) == 0:
            print(f"dstest: {done}/{self.total} runs done", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class LiveBar:
    """A redrawn bar with counts and an estimate of the time left (rich), for a terminal.

    The bar is redrawn only when a case finishes, never from a thread of its own: pytest captures the
    file descriptors while a spec runs, and a redraw from a background thread would land in the
    captured output of whatever spec was running.
    """

    def __init__(self, stream: TextIO, label: str, *, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        counts = (
            "[green]{task.fields[passed]} pass[/] [red]{task.fields[failed]} FAIL[/] "
            "[yellow]{task.fields[deviations]} DEV[/] [dim]{task.fields[skipped]} skip[/]"
        )
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(counts),
            TimeElapsedColumn(),
            TextColumn("elapsed, ETA"),
            TimeRemainingColumn(),
            console=console if console is not None else Console(file=stream, highlight=False),
            auto_refresh=False,
            redirect_stdout=False,  # pytest swaps sys.stdout and sys.stderr while specs run
            redirect_stderr=False,
        )
        self._counts: dict[str, Any] = dict.fromkeys(_FIELDS.values(), 0)
        self._task = self._bar.add_task(label, total=None, start=False, **self._counts)
        self._live = False

    def start(self, total: int) -> None:
        self._bar.update(self._task, total=total)
        self._bar.start_task(self._task)  # the clock of the elapsed time and the estimate
        self._bar.start()  # draws the first frame
        self._live = True

    def advance(self, status: str, done: int) -> None:
        field = _FIELDS.get(status)
        if field is not None:
            self._counts[field] += 1
        self._bar.update(self._task, completed=done, **self._counts)
        if self._live:
            self._bar.refresh()

    def close(self) -> None:
        if self._live:
            self._bar.stop()  # draws the last frame and moves to a new line
            self._live = False


def for_stream(stream: TextIO | None = None, label: str = "") -> Progress:
    """The display for ``stream`` (default: stderr): :class:`LiveBar` on a terminal, else :class:`PlainLines`."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return LiveBar(stream, label)
    return PlainLines(stream)
