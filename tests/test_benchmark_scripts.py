"""The scripts of ``ci/bench`` keep running against the current API: the one that broke runs here once
in its smallest setting and must exit 0 with its report. (``bench_pytest_session.py`` called
``ThreadedWorld.run`` with the signature it had before ``RunRequest``, and every one of its ``world`` tests
failed; nothing but a full ``bash ci/bench`` would have shown it.) What the figures are is the benchmarks'
business, not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cpu


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_pytest_session_benchmark_runs_every_kind_of_test(tmp_path: Path) -> None:
    report = _run("bench_pytest_session.py", "--tests", "2", "--sizes", "2", tmp_path=tmp_path)
    (row,) = report["rows"]
    assert row["world_size"] == 2
    assert all(row[k] > 0 for k in ("dstest_s", "torch_s", "world_run_s", "pytest_plain_s"))
