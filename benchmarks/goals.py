"""Issue 44's performance goals read from one ``ci/bench`` run: each goal met, not met, or not measured.

    python benchmarks/goals.py [--dir bench-out] [--markdown] [--json PATH]

Reads the JSON files the benchmark scripts of ``ci/bench`` wrote into ``--dir`` and prints one line per goal
with the measured figure, the goal and the verdict, and the load average each script saw (the machine may be
shared: ratios measured side by side in one script are what to trust). A goal whose script did not run, or ran
without the figure, is *not measured*, never met. ``--markdown`` prints the table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Reading = tuple[str, bool]  # (the figure as text, whether the goal is met)


class NotMeasured(Exception):
    """A script ran but could not measure the goal (it says why)."""


@dataclass(frozen=True)
class Goal:
    what: str
    goal: str
    source: str  # the JSON file under --dir
    read: Callable[[Any], Reading]


def _small_all_reduce(data: Any) -> Reading:
    row = next(r for r in data["small"] if r["world_size"] == 4 and r["collective"] == "all_reduce")
    to_floor, vs_torch = row["ratio_dstest_to_floor"], row["ratio_torch_to_dstest"]
    text = (
        f"{row['seconds'] * 1e3:.3f} ms; floor {row['floor_seconds'] * 1e3:.3f} ms ({to_floor:.2f}x); "
        f"torch's group {row['torch_seconds'] * 1e3:.3f} ms (dstest {vs_torch:.2f}x faster)"
    )
    return text, to_floor <= 1.5 and vs_torch >= 2.0


def _pytest_session(data: Any) -> Reading:
    row = next(r for r in data["rows"] if r["world_size"] == 4)
    ours, ratio = row["dstest_s"] * 1e3, row["ratio_torch_to_dstest"]
    return f"{ours:.2f} ms vs MultiThreadedTestCase {row['torch_s'] * 1e3:.2f} ms ({ratio:.1f}x)", ours <= 1.0 and ratio >= 5


def _scale(case: str, limit_s: float, spread: float | None) -> Callable[[Any], Reading]:
    def read(data: Any) -> Reading:
        med = data["cases"][case]["median"]["this"]
        text = f"{med['wall']:.1f} s (start {med['start']:.1f}, body {med['body']:.1f}), max/min {med['spread']:.2f}"
        met = med["wall"] < limit_s and (spread is None or med["spread"] <= spread)
        return text, met

    return read


def _process_spec(data: Any) -> Reading:
    row = data["results"]["4"]
    return f"{row['process'] * 1e3:.2f} ms", row["process"] * 1e3 <= 2.0


def _suite(data: Any) -> Reading:
    seconds = data["xdist2_seconds"]
    return f"{seconds:.0f} s ({data['xdist2']})", seconds <= 150


GOALS = [
    Goal("1 KiB all_reduce, W=4, per call", "<= 1.5x the GIL floor and >= 2x faster than torch's group",
         "threaded.json", _small_all_reduce),
    Goal("trivial W=4 spec per test in a pytest session", "<= 1.0 ms and >= 5x faster than MultiThreadedTestCase",
         "pytest_session.json", _pytest_session),
    Goal("4096 rank threads, cold (all_gather_into_tensor + all_reduce)", "< 3 s", "scale.json",
         _scale("all_gather_into_tensor:4096", 3.0, None)),
    Goal("1024 ranks, list all_gather + all_reduce, cold", "< 5 s, max/min of the rounds <= 2x", "scale.json",
         _scale("list_all_gather:1024", 5.0, 2.0)),
    Goal("warm process-world spec, W=4", "<= 2 ms", "spec_overhead.json", _process_spec),
    Goal("pytest -m cpu -n 2, whole project", "<= 150 s", "suite.json", _suite),
]


def _upstream(key: str, ratio_key: str, goal: float, side: str) -> Callable[[Any], Reading]:
    """torch's or torchtitan's own tests against upstream (bench_upstream_suites.py); not measured where no
    checkout was given, never met where a verdict differs."""

    def read(data: Any) -> Reading:
        row = data[key]
        if not row["measured"]:
            raise NotMeasured(row["why"])
        if row["items"] == 0:
            raise NotMeasured(f"upstream's run of {key}'s tests reported no item")
        if key == "torch" and row["warm_forked"] < len(row["warm"]):
            raise NotMeasured(f"{len(row['warm']) - row['warm_forked']} of the {len(row['warm'])} warm runs were not "
                              "forked from the warm server")  # fmt: skip
        ratio, differ = row[ratio_key], len(row["differ"])
        ours = row["warm_median_s"] if key == "torch" else row["plugin"]["seconds"]
        text = (f"{ours:.1f} s {side} vs upstream {row['upstream']['seconds']:.1f} s ({ratio:.1f}x; "
                f"{row['items']} items, verdicts differ: {differ})")  # fmt: skip
        return text, ratio >= goal and differ == 0

    return read


UPSTREAM = [
    Goal("torch's bases, one small file (8 items), with a warm server", ">= 30x faster than upstream",
         "upstream_suites.json", _upstream("torch", "ratio_upstream_to_warm", 30.0, "warm (median)")),
    Goal("torchtitan's 9 unit-test files on torch's bases, one pytest run", ">= 25x faster than upstream",
         "upstream_suites.json", _upstream("torchtitan", "ratio_upstream_to_plugin", 25.0, "one cold run")),
]


def _load(path: Path) -> Any:
    data = json.loads(path.read_text())
    for key in ("load_at_start", "load", "load_at_end"):
        if key in data:
            return data, f"{data[key][0]:.1f}"
    return data, "?"


def evaluate(directory: Path) -> list[dict[str, Any]]:
    rows = []
    for g in GOALS + UPSTREAM:
        path = directory / g.source
        row: dict[str, Any] = {"what": g.what, "goal": g.goal, "source": g.source, "load": "-"}
        if not path.is_file():
            row |= {"figure": f"not measured ({g.source} not written)", "verdict": "not measured"}
        else:
            try:
                data, row["load"] = _load(path)
                figure, met = g.read(data)
                row |= {"figure": figure, "verdict": "met" if met else "not met"}
            except NotMeasured as why:
                row |= {"figure": f"not measured ({why})", "verdict": "not measured"}
            except (KeyError, StopIteration, TypeError, ZeroDivisionError, json.JSONDecodeError) as err:
                row |= {"figure": f"not measured ({g.source} has no figure: {type(err).__name__}: {err})",
                        "verdict": "not measured"}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("bench-out"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = evaluate(args.dir)
    if args.markdown:
        print("| what | measured | goal | load (1 min) | verdict |")
        print("|---|---|---|---|---|")
        for r in rows:
            verdict = r["verdict"] if r["verdict"] == "met" else f"**{r['verdict']}**"
            print(f"| {r['what']} | {r['figure']} | {r['goal']} | {r['load']} | {verdict} |")
    else:
        for r in rows:
            print(f"{r['verdict']:<13} {r['what']}: {r['figure']} (goal {r['goal']}; load {r['load']})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
