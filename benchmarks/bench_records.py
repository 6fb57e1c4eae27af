"""The trace's records in C against the pure-Python records (issue 44 item 3), on the same calls and data.

    python benchmarks/bench_records.py [--world-sizes 2 4] [--reps 300] [--rounds 7] [--json PATH]

Per world size, a 1 KiB all_reduce loop on dstest's warm threaded world (per rank: one warm-up call and a
barrier, then ``--reps`` calls; the mean per call of the slowest rank, as ``bench_threaded.py`` measures
it), interleaved round by round in this one process, three ways:

- ``python``: every record a :class:`~dstest.trace.records.PyCallRecord`, call sites walked in Python;
- ``c``: the C records of :mod:`dstest.trace.native` (what dstest uses where it could build them);
- ``none``: no record at all (a stand-in whose hooks do nothing): the floor of what any record can save.
  Not a dstest configuration: without records a failure names no call.

Then the cost of each record part alone, in a tight loop of one thread (construction, the three hooks,
the call-site walk), both ways. The threaded world's figures depend on the machine's regime (one CPU or
two: see docs/benchmarks.md); run it under ``taskset -c 0`` for the one-CPU regime.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_threaded import WORLD, _dstest_loop
from bench_trace import _NULL

import dstest.trace.recorder as recorder_module
from dstest.trace import native
from dstest.trace import records as R
from dstest.worlds.request import RunRequest

_NONE = _NULL  # a record that keeps nothing: bench_trace.py's stand-in
_COLLECTIVE = recorder_module.Recorder.collective
_SIDES: dict[str, tuple[Any, Any]] = {"python": (R.PyCallRecord, R.py_call_site), "c": (R.CallRecord, R.call_site)}


def _use(side: str) -> None:
    if side == "none":
        recorder_module.Recorder.collective = lambda self, group, call, seq, rank: _NONE  # type: ignore[method-assign]
        return
    recorder_module.Recorder.collective = _COLLECTIVE  # type: ignore[method-assign]
    recorder_module.CallRecord, recorder_module.call_site = _SIDES[side]  # type: ignore[misc]


def per_call(w: int, reps: int, rounds: int, sides: list[str]) -> dict[str, float]:
    """Seconds per all_reduce (slowest rank), median of ``rounds`` interleaved rounds, per side."""
    seen: dict[str, list[float]] = {s: [] for s in sides}
    for side in sides:  # warm-up of each side
        _use(side)
        WORLD.run(RunRequest(_dstest_loop, w, args=("all_reduce", 1024, reps), timeout=600))
    for _ in range(rounds):
        for side in sides:
            _use(side)
            seen[side].append(max(WORLD.run(RunRequest(_dstest_loop, w, args=("all_reduce", 1024, reps), timeout=600))))
    _use("c" if "c" in sides else "python")
    return {s: statistics.median(v) for s, v in seen.items()}


def parts(number: int = 200_000) -> dict[str, dict[str, float]]:
    """Microseconds per record part, one thread, best of 5, per implementation."""
    out: dict[str, dict[str, float]] = {}
    for side, (cls, site) in _SIDES.items():
        if side == "c" and cls is R.PyCallRecord:
            continue
        log = R.RankLog(0, 256)
        rec = cls(0, "all_reduce", "world", 1, "float32", ((256,),), 256, 1024)
        env = {"cls": cls, "rec": rec, "log": log, "site": site}
        stmts = {
            "construct": "cls(0, 'all_reduce', 'world', 1, 'float32', ((256,),), 256, 1024)",
            "finished": "rec.t_done = None; rec.finished(None)",
            "waiting (a later wait: walks to its site)": "rec.t_wait = None; rec.waiting(log)",
            "waited": "rec.t_waited = None; rec.waited()",
            "call site": "site(1)",
        }
        out[side] = {
            name: min(timeit.repeat(stmt, number=number, repeat=5, globals=env)) / number * 1e6
            for name, stmt in stmts.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    status = native.status()
    print(f"records: {status.describe()}; CPUs usable: {len(os.sched_getaffinity(0))}; load {os.getloadavg()[0]:.2f}")
    sides = ["python", "c", "none"] if status.native else ["python", "none"]
    rows = []
    print(
        "\n| W | Python records, ms | C records, ms | no record, ms | C / Python | what C saves of what a record costs |"
    )
    print("|---|---|---|---|---|---|")
    for w in args.world_sizes:
        t = per_call(w, args.reps, args.rounds, sides)
        row: dict[str, Any] = {"world_size": w, **{f"{s}_ms": t[s] * 1e3 for s in sides}}
        if "c" in t:
            row["c_over_python"] = t["c"] / t["python"]
            cost = t["python"] - t["none"]
            row["share_saved"] = (t["python"] - t["c"]) / cost if cost > 0 else None
            share = f"{row['share_saved']:.0%}" if row["share_saved"] is not None else "-"
            print(
                f"| {w} | {t['python'] * 1e3:.4f} | {t['c'] * 1e3:.4f} | {t['none'] * 1e3:.4f} | {row['c_over_python']:.2f}x | {share} |"
            )
        else:
            print(f"| {w} | {t['python'] * 1e3:.4f} | - | {t['none'] * 1e3:.4f} | - | - |")
        rows.append(row)
    micro = parts()
    print("\n| part (one thread, us) | " + " | ".join(micro) + " |")
    print("|---|" + "---|" * len(micro))
    for name in next(iter(micro.values())):
        print(f"| {name} | " + " | ".join(f"{micro[s][name]:.3f}" for s in micro) + " |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"native": status.native, "why": status.why, "load": os.getloadavg()[0], "rows": rows, "parts": micro},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
