"""Threaded world at scale, one tree against another in one run: whole-world cold runs of the scale bodies of
``bench_threaded.py``, each in a fresh interpreter, the two trees alternating round by round (each side sees
the same load), with where a run's time goes.

    python benchmarks/bench_scale.py [--baseline TREE] [--rounds 3] [--repeat 2] [--case list_all_gather:1024 ...]
        [--json PATH]

``TREE`` is a checkout of dstest (``git worktree add /tmp/base <commit>``); without it only this tree runs.
Each run reports its wall time and three phases read from per-rank timestamps: the start (the run's call
until the last rank entered the body: threads started, each rank's default group formed), the body (until
the last rank left it) and the end (until ``run`` returned). Medians per side; the load average before each
run is kept too, since the machine may be shared. ``--repeat 2`` runs the body a second time in the same
interpreter, a cold world again (``warm=False``): what a test session's later large world costs, where the
first run pays the process's one-time set-up (reported as ``again``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_CASES = ["list_all_gather:1024", "all_gather_into_tensor:4096"]


def one(body: str, world_size: int) -> dict[str, Any]:
    """In the child: one cold run of ``body`` at ``world_size`` ranks; the phases in seconds."""
    import threading
    import time
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    import torch
    import torch.distributed as dist

    from dstest.worlds.request import RunRequest
    from dstest.worlds.threaded import ThreadedWorld

    entered = [0.0] * world_size
    left = [0.0] * world_size
    cpu = [0.0] * world_size
    lock = threading.Lock()

    def run_body(ctx: Any) -> None:
        t0 = time.thread_time()
        entered[ctx.rank] = time.perf_counter()
        w = ctx.world_size
        if body == "list_all_gather":
            out = [torch.empty(1) for _ in range(w)]
            dist.all_gather(out, torch.tensor([float(ctx.rank)]))
        else:
            dist.all_gather_into_tensor(torch.empty(w), torch.tensor([float(ctx.rank)]))
        t = torch.ones(1)
        dist.all_reduce(t)
        left[ctx.rank] = time.perf_counter()
        with lock:
            cpu[ctx.rank] = time.thread_time() - t0

    start = time.perf_counter()
    ThreadedWorld(warm=False).run(RunRequest(run_body, world_size, timeout=1800))
    end = time.perf_counter()
    return {
        "wall": end - start,
        "start": max(entered) - start,
        "body": max(left) - max(entered),
        "end": end - max(left),
        "body_cpu_ms_per_rank": 1e3 * sum(cpu) / world_size,
    }


def repeated(body: str, world_size: int, repeat: int) -> dict[str, Any]:
    """In the child: ``repeat`` cold runs in this interpreter; the first's phases, and the last's as ``again``."""
    first = one(body, world_size)
    for _ in range(repeat - 1):
        first["again"] = one(body, world_size)
    return first


def child(tree: str, body: str, world_size: int, repeat: int = 1) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree, PYTHONWARNINGS="ignore::FutureWarning")
    code = (
        f"import sys, json; sys.path.insert(0, {tree!r}); sys.path.insert(1, {str(HERE)!r});"
        f"import bench_scale, dstest; assert dstest.__file__.startswith({tree!r}), dstest.__file__;"
        f"print('RESULT', json.dumps(bench_scale.repeated({body!r}, {world_size}, {repeat})))"
    )
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"run of {body} at {world_size} on {tree} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    result["load_before"] = load
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a checkout of dstest to run against this tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="cold runs per interpreter (the last: 'again')")
    parser.add_argument("--case", action="append", help="BODY:WORLD_SIZE (repeatable)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sides = {"this": str(HERE.parent)}
    if args.baseline:
        sides = {"baseline": str(Path(args.baseline).resolve()), **sides}
    results: dict[str, Any] = {"load_at_start": os.getloadavg(), "cases": {}}
    for case in args.case or DEFAULT_CASES:
        body, ws = case.split(":")
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                res = child(sides[side], body, int(ws), args.repeat)
                runs[side].append(res)
                for label, x in (("", res), ("again", res.get("again"))):
                    if x is not None:
                        print(
                            f"{case:<28} {side:<9} round {r}{label:>6}: wall {x['wall']:7.2f} s (start {x['start']:6.2f}, "
                            f"body {x['body']:6.2f}, end {x['end']:5.2f}; body cpu/rank {x['body_cpu_ms_per_rank']:.2f} ms) "
                            f"load {res['load_before']:.1f}",
                            flush=True,
                        )
        summary = {}
        for side, rs in runs.items():
            for label, xs in (("", rs), ("again", [x["again"] for x in rs if "again" in x])):
                if not xs:
                    continue
                med = {k: statistics.median(x[k] for x in xs) for k in ("wall", "start", "body", "end")}
                med["spread"] = max(x["wall"] for x in xs) / min(x["wall"] for x in xs)
                summary[side + (f" {label}" if label else "")] = med
                print(
                    f"{case:<28} {side:<9} {label:>5} median wall {med['wall']:.2f} s (start {med['start']:.2f}, "
                    f"body {med['body']:.2f}, end {med['end']:.2f}), max/min {med['spread']:.2f}",
                    flush=True,
                )
        results["cases"][case] = {"runs": runs, "median": summary}
    results["load_at_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
