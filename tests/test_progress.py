"""Progress of the `dstest` command: a live bar with counts and an ETA on a terminal, plain lines in logs."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys

import pytest

from dstest import cli
from dstest.report.progress import LiveBar, PlainLines, for_stream

pytestmark = pytest.mark.cpu

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_logs_get_a_line_per_tenth_of_the_run_and_one_at_its_end() -> None:
    """What CI logs have always shown: `dstest: N/TOTAL runs done` at each tenth and at the end, nothing else."""
    out = io.StringIO()
    lines = PlainLines(out)
    lines.start(25)
    for done in range(1, 26):
        lines.advance("pass", done)
    lines.close()
    assert out.getvalue().splitlines() == [f"dstest: {n}/25 runs done" for n in (*range(2, 25, 2), 25)]


def test_the_command_prints_the_plain_lines_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from impl.ops import load_extension

    # On a fresh machine the impl target builds its native ops before the first spec and says so on stderr
    # (docs/worlds.md#build-locks): built first, stderr holds the progress lines alone.
    load_extension()
    assert cli.main(["-k", "A1"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "".join(f"dstest: {n}/3 runs done\n" for n in (1, 2, 3))
    assert "test_a1_none_is_absent" in captured.out and "3 passed, 0 failed" in captured.out


def test_the_bar_shows_counts_of_each_outcome_and_an_eta() -> None:
    from rich.console import Console

    out = io.StringIO()
    bar = LiveBar(out, "mytarget", console=Console(file=out, force_terminal=True, width=150, color_system=None))
    bar.start(8)
    first = _ANSI.sub("", out.getvalue())
    assert "mytarget" in first and "0/8" in first and "0 pass" in first
    for done, status in enumerate(["pass", "pass", "deviation", "fail", "skip", "pass", "deviation", "pass"], 1):
        bar.advance(status, done)
    bar.close()
    frames = [f for f in _ANSI.sub("", out.getvalue()).split("\r") if f.strip()]
    assert len(frames) >= 9  # redrawn in place: the first frame and one per finished case
    assert "3/8" in frames[3] and "2 pass 0 FAIL 1 DEV 0 skip" in frames[3]
    last = frames[-1]
    assert "8/8" in last and "4 pass 1 FAIL 2 DEV 1 skip" in last
    assert re.search(r"elapsed, ETA \d+:\d\d:\d\d", last)


def test_only_a_terminal_gets_the_bar() -> None:
    assert isinstance(for_stream(io.StringIO()), PlainLines)
    main, side = os.openpty()
    with os.fdopen(side, "w") as terminal:
        try:
            assert isinstance(for_stream(terminal), LiveBar)
        finally:
            os.close(main)


def test_the_command_draws_the_bar_on_a_terminal() -> None:
    """The real entry point with stderr on a pseudo-terminal (as in a shell); stdout still gets the table."""
    main, side = os.openpty()
    env = {**os.environ, "COLUMNS": "150", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dstest", "-k", "A1"], stdout=subprocess.PIPE, stderr=side, env=env, text=True
    )
    os.close(side)
    shown = b""
    while True:  # read as it comes: a full pseudo-terminal buffer would block the run
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the other side closed
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    text = _ANSI.sub("", shown.decode("utf-8", "replace"))
    assert "runs done" not in text
    frames = [f for f in text.replace("\n", "\r").split("\r") if f.strip()]
    assert any("0/3" in f for f in frames) and any("2/3" in f for f in frames)
    assert "3/3" in frames[-1] and "3 pass 0 FAIL 0 DEV 0 skip" in frames[-1] and "ETA" in frames[-1]
    assert "test_a1_none_is_absent" in out and "3 passed, 0 failed" in out
