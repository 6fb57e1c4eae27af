"""The whole ``pytest -m cpu`` run, serial and with ``-n 2``, timed side by side.

    python benchmarks/bench_suite.py [--xdist-only] [--json PATH]

``--xdist-only`` skips the serial run (the figure issue 44's goal is set on is the ``-n 2`` one; the serial
run takes as long again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(extra: list[str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cpu", "-q", "-p", "no:cacheprovider", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {summary}")
    return elapsed, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--xdist-only", action="store_true", help="only the -n 2 run")
    args = parser.parse_args()
    report: dict[str, object] = {"load_at_start": os.getloadavg()}
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
