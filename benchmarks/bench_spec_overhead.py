"""Spec overhead: one trivial all_reduce spec, per test, in four ways, side by side in one run.

    python benchmarks/bench_spec_overhead.py [--sizes 2,4,8] [--reps 40] [--spawn-reps 2] [--json PATH]

- threaded:      dstest's threaded world (threads, dstest's own c10d backend)
- process:       dstest's process world on a warm pool (gloo, one OS process per rank)
- torch-threads: torch's threaded process group, driven as MultiThreadedTestCase drives it
- fresh-spawn:   what per-test process spawning costs (DeepSpeed's DistributedTest, torch's
                 MultiProcessTestCase): spawn W interpreters, import torch, form a gloo group, run, exit

Medians per test; the fresh spawn is slow, so it gets few repetitions. Pool start (spawn to a formed
group) is reported separately: once per world size per session for the process world.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median_seconds
from _torch_threaded import run_torch_threaded

from dstest.worlds.process import ProcessWorld, shutdown_all
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from dstest.worlds.threaded import shutdown_all as threaded_shutdown_all


def trivial_spec(ctx: Any) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size


def _torch_threads_body(rank: int, world_size: int) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world_size


def _fresh_rank(rank: int, world_size: int, store_path: str) -> None:
    # What a per-test spawn pays: this interpreter imported torch when it unpickled this function.
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world_size
    dist.destroy_process_group()


def fresh_spawn_test(world_size: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dstest-bench-") as d:
        procs = [
            ctx.Process(target=_fresh_rank, args=(r, world_size, os.path.join(d, "store"))) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"fresh spawn at W={world_size}: exit codes {bad}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="comma-separated world sizes (default 2,4,8)")
    parser.add_argument("--reps", type=int, default=40, help="repetitions of the fast ways (default 40)")
    parser.add_argument("--spawn-reps", type=int, default=2, help="repetitions of the fresh spawn (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    began = time.perf_counter()

    # "threaded" is what specs get (warm crews); "threaded_cold" starts and ends its threads per test.
    threaded, cold, process = ThreadedWorld(warm=True), ThreadedWorld(), ProcessWorld()
    # Pool start: the first includes starting the fork server (one torch import); later ones fork from it.
    pool_start = {}
    for ws in sizes:
        start = time.perf_counter()
        process.warm(ws)
        pool_start[ws] = time.perf_counter() - start

    rows: dict[int, dict[str, float]] = {}
    for ws in sizes:
        threaded.run(RunRequest(trivial_spec, ws))  # warm-up: backend registration, first thread creation
        process.run(RunRequest(trivial_spec, ws))
        run_torch_threaded(_torch_threads_body, ws)
        rows[ws] = {
            "threaded": median_seconds(lambda ws=ws: threaded.run(RunRequest(trivial_spec, ws)), args.reps),
            "threaded_cold": median_seconds(lambda ws=ws: cold.run(RunRequest(trivial_spec, ws)), args.reps),
            "process": median_seconds(lambda ws=ws: process.run(RunRequest(trivial_spec, ws)), args.reps),
            "torch_threads": median_seconds(lambda ws=ws: run_torch_threaded(_torch_threads_body, ws), args.reps),
        }
    shutdown_all()  # the spawn baseline gets the cores to itself
    threaded_shutdown_all()
    for ws in sizes:
        rows[ws]["fresh_spawn"] = median_seconds(lambda ws=ws: fresh_spawn_test(ws), args.spawn_reps)

    ms = 1e3
    print(f"spec overhead per test, median ms ({os.cpu_count()} CPUs, torch {torch.__version__})")
    head = f"{'W':>3} {'threaded':>9} {'cold':>9} {'process':>9} {'torch-thr':>9} {'spawn':>9}  {'spawn/process':>13} {'spawn/threaded':>14} {'torch-thr/threaded':>18} {'process/threaded':>16}"
    print(head)
    for ws, r in rows.items():
        print(
            f"{ws:>3} {r['threaded'] * ms:>9.2f} {r['threaded_cold'] * ms:>9.2f} {r['process'] * ms:>9.2f} {r['torch_threads'] * ms:>9.2f} "
            f"{r['fresh_spawn'] * ms:>9.0f}  {r['fresh_spawn'] / r['process']:>12.0f}x "
            f"{r['fresh_spawn'] / r['threaded']:>13.0f}x {r['torch_threads'] / r['threaded']:>17.2f}x "
            f"{r['process'] / r['threaded']:>15.2f}x"
        )
    print(
        "process-world pool start (once per world size per session): "
        + ", ".join(f"W={ws}: {s:.2f} s" for ws, s in pool_start.items())
        + "  (the first includes the fork server's torch import)"
    )
    total = time.perf_counter() - began
    print(f"total {total:.1f} s")

    report = {
        "benchmark": "spec_overhead",
        "unit": "seconds per test (median)",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "reps": {"fast": args.reps, "fresh_spawn": args.spawn_reps},
        "results": {
            str(ws): r
            | {
                "ratio_fresh_spawn_to_process": r["fresh_spawn"] / r["process"],
                "ratio_fresh_spawn_to_threaded": r["fresh_spawn"] / r["threaded"],
                "ratio_torch_threads_to_threaded": r["torch_threads"] / r["threaded"],
                "ratio_process_to_threaded": r["process"] / r["threaded"],
            }
            for ws, r in rows.items()
        },
        "pool_start_s": {str(ws): s for ws, s in pool_start.items()},
        "total_s": total,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
