"""The whole ``pytest -m cpu`` run, serial and with ``-n 2``, timed side by side.

    python benchmarks/bench_suite.py [--xdist-only] [--json PATH]
    python benchmarks/bench_suite.py --forked-side-by-side [--json PATH]

``--xdist-only`` skips the serial run (the figure issue 44's goal is set on is the ``-n 2`` one; the serial
run takes as long again). ``--forked-side-by-side`` runs the ``-n 2`` suite twice, one after the other: its
child pytest sessions forked from a warm interpreter (tests/_forked_children.py, the default) and all of them
fresh (``DSTEST_SUITE_FORK=0``); each with the CPU time of the run and every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(extra: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cpu", "-q", "-p", "no:cacheprovider", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    elapsed = time.perf_counter() - start
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {summary}")
    return elapsed, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--xdist-only", action="store_true", help="only the -n 2 run")
    parser.add_argument("--forked-side-by-side", action="store_true", help="-n 2 with forked, then fresh children")
    args = parser.parse_args()
    report: dict[str, object] = {"load_at_start": os.getloadavg()}
    if args.forked_side_by_side:
        for side, value in (("forked", "1"), ("fresh", "0")):
            cpu = _children_cpu()
            seconds, summary = timed(["-n", "2"], env={**os.environ, "DSTEST_SUITE_FORK": value})
            cpu = _children_cpu() - cpu
            print(f"-n 2, {side:6} children {seconds:7.1f} s, CPU {cpu:6.1f} s   {summary}")
            report |= {f"{side}_seconds": seconds, f"{side}_cpu_seconds": cpu, side: summary}
        print(f"fresh / forked         {report['fresh_seconds'] / report['forked_seconds']:7.2f}x")  # type: ignore[operator]
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return
    if not args.xdist_only:
        serial, serial_summary = timed([])
        print(f"pytest -m cpu          {serial:7.1f} s   {serial_summary}")
        report |= {"serial_seconds": serial, "serial": serial_summary}
    parallel, parallel_summary = timed(["-n", "2"])
    print(f"pytest -m cpu -n 2     {parallel:7.1f} s   {parallel_summary}")
    report |= {"xdist2_seconds": parallel, "xdist2": parallel_summary}
    if not args.xdist_only:
        print(f"serial / -n 2          {serial / parallel:7.2f}x")
        report["ratio"] = serial / parallel
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
