"""Spec overhead: one trivial all_reduce spec, per test, in four ways, side by side in one run.

    python benchmarks/bench_spec_overhead.py [--sizes 2,4,8] [--reps 40] [--spawn-reps 2] [--json PATH]
    python benchmarks/bench_spec_overhead.py --baseline TREE [--sizes 4] [--reps 40] [--rounds 5] [--json PATH]

- threaded:      dstest's threaded world (threads, dstest's own c10d backend)
- process:       dstest's process world on a warm pool (gloo, one OS process per rank)
- torch-threads: torch's threaded process group, driven as MultiThreadedTestCase drives it
- fresh-spawn:   what per-test process spawning costs (DeepSpeed's DistributedTest, torch's
                 MultiProcessTestCase): spawn W interpreters, import torch, form a gloo group, run, exit

Medians per test; the fresh spawn is slow, so it gets few repetitions. Pool start (spawn to a formed
group) is reported separately: once per world size per session for the process world.

With ``--baseline TREE`` (a checkout of dstest: ``git worktree add /tmp/base <commit>``) only the process
world runs, this tree against TREE: one interpreter per tree, each with its own warm pool, the two taking
turns round by round so that both see the same load. Each round splits a warm spec's time: a spec with no
collective (the run's start and end), with one all_reduce (the trivial spec above) and with ten (each
collective after the first, ``(ten - one) / 9``), and inside one run a checked all_reduce against the same
all_reduce issued to the group's own gloo group unchecked, and against that all_reduce preceded by a gloo
all_gather of a 64-byte signature per rank (the floor of a check made among the workers over the group's own
transport). Medians of the rounds' medians, with the load; and the CPU time the parent and the workers
used per spec (Linux; the mean over the rounds), which a shared machine's load moves much less than wall
time.
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


def empty_spec(ctx: Any) -> None:
    pass


def ten_spec(ctx: Any) -> None:
    t = torch.ones(4)
    for _ in range(10):
        dist.all_reduce(t)
    assert t[0].item() == ctx.world_size**10


def checked_against_gloo(ctx: Any, n: int) -> tuple[float, float, float]:
    """Seconds per all_reduce on this rank: checked (dist.all_reduce); gloo's own, unchecked; gloo's own after
    a gloo all_gather of a 64-byte signature from every rank."""
    t = torch.ones(4)
    inner = dist.group.WORLD.inner  # type: ignore[union-attr]  # the checked group's gloo group
    sig = torch.zeros(64, dtype=torch.uint8)
    sigs = torch.zeros(64 * ctx.world_size, dtype=torch.uint8)

    def signed() -> None:
        inner._allgather_base(sigs, sig).wait()
        inner.allreduce([t]).wait()

    times = []
    for call in (lambda: dist.all_reduce(t), lambda: inner.allreduce([t]).wait(), signed):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - start) / n)
    return times[0], times[1], times[2]


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


PHASES = ("empty", "one", "ten")


def dstest_file(ctx: Any) -> str:
    import dstest

    return str(dstest.__file__)


def _cpu_seconds(world_size: int) -> float:
    """CPU seconds used so far by this process and the workers of its pool of ``world_size`` (Linux: from
    /proc; elsewhere this process only). On a shared machine wall time follows the load; CPU time much less."""
    from dstest.worlds.process.pool_cache import pool_pids

    user, system = os.times()[:2]
    total = user + system
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pool_pids().get(("gloo", world_size), []):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def serve_rounds(world_size: int, reps: int) -> None:
    """In a child of ``--baseline``: warm a pool, then one round per line read ("round"), a JSON line each."""
    process = ProcessWorld()
    specs = {"empty": empty_spec, "one": trivial_spec, "ten": ten_spec}
    process.warm(world_size)
    for fn in specs.values():
        process.run(RunRequest(fn, world_size))
    import dstest

    where = set(process.run(RunRequest(dstest_file, world_size)))
    if where != {dstest.__file__}:
        raise RuntimeError(f"the workers run dstest from {where}, this interpreter from {dstest.__file__}")
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        load = os.getloadavg()[0]
        row: dict[str, float] = {}
        for k, fn in specs.items():

            def one_run(fn: Any = fn) -> None:
                process.run(RunRequest(fn, world_size))

            cpu = _cpu_seconds(world_size)
            row[k] = median_seconds(one_run, reps)
            row[f"cpu_{k}"] = (_cpu_seconds(world_size) - cpu) / reps
        per_rank = process.run(RunRequest(checked_against_gloo, world_size, args=(max(reps, 20),)))
        for i, k in enumerate(("coll_checked", "coll_gloo", "coll_signed")):
            row[k] = max(times[i] for times in per_rank)
        row["load"] = load
        print("ROUND " + json.dumps(row), flush=True)
    shutdown_all()


def side_by_side(baseline: str, sizes: list[int], reps: int, rounds: int, out: Path | None) -> dict[str, Any]:
    """This tree against ``baseline``, process world only, the two interpreters taking turns."""
    import statistics
    import subprocess

    sides = {"baseline": str(Path(baseline).resolve()), "this": str(Path(__file__).resolve().parent.parent)}
    report: dict[str, Any] = {
        "benchmark": "spec_overhead_side_by_side",
        "sides": sides,
        "load_at_start": os.getloadavg(),
    }
    for ws in sizes:
        procs = {}
        for side, tree in sides.items():
            code = (
                f"import sys; sys.path.insert(0, {tree!r}); sys.path.insert(1, {str(Path(__file__).parent)!r});"
                f"import dstest; assert dstest.__file__.startswith({tree!r}), dstest.__file__;"
                f"import bench_spec_overhead as b; b.serve_rounds({ws}, {reps})"
            )
            env = dict(os.environ, PYTHONPATH=tree)
            procs[side] = subprocess.Popen(  # run in its tree: "-c" puts the directory it runs in on sys.path
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tree,
            )
        for side, p in procs.items():
            assert p.stdout is not None
            if p.stdout.readline().strip() != "READY":
                raise RuntimeError(f"the {side} side did not start")
        rows: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for r in range(rounds):
            for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
                p = procs[side]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("round\n")
                p.stdin.flush()
                row = json.loads(p.stdout.readline().removeprefix("ROUND "))
                rows[side].append(row)
                print(
                    f"W={ws} {side:<8} round {r}: empty {row['empty'] * 1e3:6.2f} one {row['one'] * 1e3:6.2f} "
                    f"ten {row['ten'] * 1e3:6.2f} ms; all_reduce checked {row['coll_checked'] * 1e3:.2f} "
                    f"gloo {row['coll_gloo'] * 1e3:.2f} signed gloo {row['coll_signed'] * 1e3:.2f} ms; load {row['load']:.1f}",
                    flush=True,
                )
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait(60)
        summary = {}
        for side, rs in rows.items():
            keys = (*PHASES, *(f"cpu_{k}" for k in PHASES), "coll_checked", "coll_gloo", "coll_signed")
            # CPU time is read in clock ticks (10 ms): its mean over the rounds, not a median of coarse values.
            med = {k: (statistics.fmean if k.startswith("cpu_") else statistics.median)(x[k] for x in rs) for k in keys}
            med["per_collective"] = (med["ten"] - med["one"]) / 9
            med["cpu_per_collective"] = (med["cpu_ten"] - med["cpu_one"]) / 9
            summary[side] = med
            print(
                f"W={ws} {side:<8} median: spec with no collective {med['empty'] * 1e3:.2f} ms, trivial spec "
                f"{med['one'] * 1e3:.2f} ms, each further all_reduce {med['per_collective'] * 1e3:.2f} ms; CPU (parent and "
                f"workers) {med['cpu_empty'] * 1e3:.2f}, {med['cpu_one'] * 1e3:.2f}, "
                f"{med['cpu_per_collective'] * 1e3:.2f} ms; in a run: "
                f"checked {med['coll_checked'] * 1e3:.2f} ms, gloo's own {med['coll_gloo'] * 1e3:.2f} ms, after a "
                f"signature all_gather {med['coll_signed'] * 1e3:.2f} ms",
                flush=True,
            )
        report[str(ws)] = {"rounds": rows, "median": summary}
    report["load_at_end"] = os.getloadavg()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="a dstest checkout: the process world, this tree against it")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side with --baseline (default 5)")
    parser.add_argument("--sizes", default="2,4,8", help="comma-separated world sizes (default 2,4,8)")
    parser.add_argument("--reps", type=int, default=40, help="repetitions of the fast ways (default 40)")
    parser.add_argument("--spawn-reps", type=int, default=2, help="repetitions of the fresh spawn (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.baseline is not None:
        return side_by_side(args.baseline, sizes, args.reps, args.rounds, args.json)
    began = time.perf_counter()
    load_at_start = os.getloadavg()

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
        "load_at_start": load_at_start,
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
