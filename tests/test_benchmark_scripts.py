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
from typing import Any

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


def test_run_floor_benchmark_runs_both_sides(tmp_path: Path) -> None:
    report = _run("bench_run_floor.py", "--sizes", "2", "--runs", "5", "--rounds", "1", tmp_path=tmp_path)
    (row,) = report["rows"]
    assert row["world_size"] == 2
    assert row["floor_s"] > 0 and row["dstest_s"] > 0


def test_upstream_suites_benchmark_says_what_it_could_not_measure(tmp_path: Path, monkeypatch) -> None:
    """Without checkouts of torch's and torchtitan's tests (CI has none) nothing runs and each side says why;
    a checkout without the files says which are missing."""
    monkeypatch.delenv("DSTEST_TORCH_TESTS", raising=False)
    monkeypatch.delenv("DSTEST_TORCHTITAN", raising=False)
    report = _run("bench_upstream_suites.py", tmp_path=tmp_path)
    assert report["torch"] == {"measured": False, "why": "no checkout of torch's tests (--torch-tests)"}
    assert report["torchtitan"] == {"measured": False, "why": "no checkout of torchtitan (--torchtitan)"}
    report = _run("bench_upstream_suites.py", "--torch-tests", str(tmp_path), "--torchtitan", str(tmp_path),
                  tmp_path=tmp_path)  # fmt: skip
    assert not report["torch"]["measured"] and "test_c10d_object_collectives.py is not there" in report["torch"]["why"]
    assert not report["torchtitan"]["measured"] and "tests/unit_tests/test_loss.py" in report["torchtitan"]["why"]


def _passing_figures(d: Path) -> None:
    """Figures that meet every goal of benchmarks/goals.py, in the shapes the scripts write."""
    small = [{"world_size": 4, "collective": "all_reduce", "seconds": 1.4e-4, "floor_seconds": 1e-4,
              "torch_seconds": 3e-4, "ratio_dstest_to_floor": 1.4, "ratio_torch_to_dstest": 3e-4 / 1.4e-4}]
    (d / "threaded.json").write_text(json.dumps({"small": small, "load_at_start": [1.0, 1.0, 1.0]}))
    rows = [{"world_size": 4, "dstest_s": 9e-4, "torch_s": 5e-3, "ratio_torch_to_dstest": 5e-3 / 9e-4}]
    (d / "pytest_session.json").write_text(json.dumps({"rows": rows, "load": [1.0, 1.0, 1.0]}))
    med = {"wall": 2.0, "start": 1.0, "body": 1.0, "end": 0.0, "spread": 1.5}
    cases = {c: {"median": {"this": dict(med)}} for c in ("all_gather_into_tensor:4096", "list_all_gather:1024")}
    (d / "scale.json").write_text(json.dumps({"cases": cases, "load_at_start": [1.0, 1.0, 1.0]}))
    (d / "spec_overhead.json").write_text(json.dumps({"results": {"4": {"process": 1.9e-3}}}))
    (d / "suite.json").write_text(json.dumps({"xdist2_seconds": 140.0, "xdist2": "10 passed"}))
    torch_file = {"measured": True, "items": 8, "upstream": {"seconds": 60.0}, "warm_median_s": 1.9,
                  "warm": [{"seconds": 1.9}] * 3, "warm_forked": 3, "ratio_upstream_to_warm": 60.0 / 1.9, "differ": []}
    titan = {"measured": True, "items": 108, "upstream": {"seconds": 430.0}, "plugin": {"seconds": 17.0},
             "ratio_upstream_to_plugin": 430.0 / 17.0, "differ": []}
    upstream = {"torch": torch_file, "torchtitan": titan, "load_at_start": [1.0, 1.0, 1.0]}
    (d / "upstream_suites.json").write_text(json.dumps(upstream))


def _goals() -> Any:
    """benchmarks/goals.py, imported from its directory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import goals
    finally:
        sys.path.pop(0)
    return goals


def _upstream_figures(d: Path, side: str, *, replace: bool = False, **changes: Any) -> None:
    """The passing figures with ``side``'s entry of upstream_suites.json changed (``replace``: the entry
    replaced by ``changes``)."""
    _passing_figures(d)
    data = json.loads((d / "upstream_suites.json").read_text())
    data[side] = changes if replace else data[side] | changes
    (d / "upstream_suites.json").write_text(json.dumps(data))


# (file, a path into its JSON, a value that misses the goal): each one alone must turn its goal to "not met"
_MISSES = [
    ("threaded.json", ("small", 0, "ratio_dstest_to_floor"), 1.51),
    ("threaded.json", ("small", 0, "ratio_torch_to_dstest"), 1.99),
    ("pytest_session.json", ("rows", 0, "dstest_s"), 1.01e-3),
    ("pytest_session.json", ("rows", 0, "ratio_torch_to_dstest"), 4.9),
    ("scale.json", ("cases", "all_gather_into_tensor:4096", "median", "this", "wall"), 3.0),
    ("scale.json", ("cases", "list_all_gather:1024", "median", "this", "wall"), 5.0),
    ("scale.json", ("cases", "list_all_gather:1024", "median", "this", "spread"), 2.01),
    ("spec_overhead.json", ("results", "4", "process"), 2.01e-3),
    ("suite.json", ("xdist2_seconds",), 151.0),
    ("upstream_suites.json", ("torch", "ratio_upstream_to_warm"), 29.9),
    ("upstream_suites.json", ("torch", "differ"), ["TestCase::test_one_item"]),  # faster, other verdicts
    ("upstream_suites.json", ("torchtitan", "ratio_upstream_to_plugin"), 24.9),
    ("upstream_suites.json", ("torchtitan", "differ"), ["TestCase::test_one_item"]),
]


@pytest.mark.parametrize("case", range(len(_MISSES)))
def test_goals_are_met_only_when_every_figure_meets_them(tmp_path: Path, case: int) -> None:
    """benchmarks/goals.py (issue 44): figures inside every goal are all met; one figure past its goal turns
    that goal, and only that one, to "not met"; a missing file or figure is "not measured", never met."""
    goals = _goals()
    _passing_figures(tmp_path)
    every = goals.GOALS + goals.UPSTREAM
    before = goals.evaluate(tmp_path)
    assert [r["verdict"] for r in before] == ["met"] * len(every)

    name, where, value = _MISSES[case]
    data = json.loads((tmp_path / name).read_text())
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (tmp_path / name).write_text(json.dumps(data))
    after = goals.evaluate(tmp_path)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a["verdict"] != b["verdict"]]
    assert len(changed) == 1 and after[changed[0]]["verdict"] == "not met"
    assert every[changed[0]].source == name

    del node[where[-1]]  # the figure gone: not measured
    (tmp_path / name).write_text(json.dumps(data))
    assert goals.evaluate(tmp_path)[changed[0]]["verdict"] == "not measured"
    (tmp_path / name).unlink()
    assert goals.evaluate(tmp_path)[changed[0]]["verdict"] == "not measured"


@pytest.mark.parametrize("side", ["torch", "torchtitan"])
def test_a_suite_without_its_checkout_is_not_measured_and_says_why(tmp_path: Path, side: str) -> None:
    goals = _goals()
    _upstream_figures(tmp_path, side, replace=True, measured=False, why=f"no checkout of {side} (--{side})")
    rows = {r["what"]: r for r in goals.evaluate(tmp_path)}
    row = next(r for r in rows.values() if r["source"] == "upstream_suites.json" and r["what"].split("'")[0] == side)
    assert row["verdict"] == "not measured" and f"no checkout of {side}" in row["figure"], row
    assert sum(r["verdict"] == "met" for r in rows.values()) == len(rows) - 1


@pytest.mark.parametrize(
    ("side", "key", "value", "why"),
    [
        ("torch", "warm_forked", 2, "1 of the 3 warm runs were not forked from the warm server"),
        ("torch", "items", 0, "upstream's run of torch's tests reported no item"),
        ("torchtitan", "items", 0, "upstream's run of torchtitan's tests reported no item"),
    ],
)
def test_an_upstream_figure_that_is_not_what_the_goal_asks_is_not_measured(
    tmp_path: Path, side: str, key: str, value: int, why: str
) -> None:
    """A warm run that was not forked from the server is a cold run's time; a run of no items is no figure."""
    goals = _goals()
    _upstream_figures(tmp_path, side, **{key: value})
    (row,) = [r for r in goals.evaluate(tmp_path) if r["verdict"] != "met"]
    assert row["verdict"] == "not measured" and why in row["figure"], row
