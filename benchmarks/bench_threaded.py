"""Threaded world: collective bandwidth against memcpy, and scale against torch's threaded group.

    python benchmarks/bench_threaded.py [--quick] [--json PATH]

Everything runs side by side in one process; figures are reported as ratios to their baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median_seconds
from _torch_threaded import run_torch_threaded

from dstest.worlds.fake import FakeWorld
from dstest.worlds.threaded import ThreadedWorld

WORLD = ThreadedWorld(warm=True)
BW_WORLD_SIZE = 4


def _collective_loop(ctx: Any, kind: str, nbytes: int, reps: int) -> float:
    n = max(1, nbytes // 4)
    w = ctx.world_size
    if kind == "all_reduce":
        t = torch.ones(n)
        call = lambda: dist.all_reduce(t)  # noqa: E731
    elif kind == "all_gather_into_tensor":
        inp, out = torch.ones(n // w or 1), torch.empty((n // w or 1) * w)
        call = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
    else:
        inp, out = torch.ones((n // w or 1) * w), torch.empty(n // w or 1)
        call = lambda: dist.reduce_scatter_tensor(out, inp)  # noqa: E731
    call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    dist.barrier()
    return (time.perf_counter() - start) / reps


def bandwidth(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        src, dst = torch.ones(n), torch.empty(n)
        memcpy = median_seconds(lambda: dst.copy_(src), max(reps, 5))  # noqa: B023
        # What the W ranks of one collective must write in all: each rank its own output.
        src_all, dst_all = torch.ones(n * BW_WORLD_SIZE), torch.empty(n * BW_WORLD_SIZE)
        memcpy_all = median_seconds(lambda: dst_all.copy_(src_all), max(reps, 5))  # noqa: B023
        for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            per_call = max(WORLD.run(_collective_loop, BW_WORLD_SIZE, args=(kind, nbytes, reps), timeout=600))
            rows.append(
                {
                    "bytes": nbytes,
                    "collective": kind,
                    "seconds": per_call,
                    "memcpy_seconds": memcpy,
                    "ratio_to_memcpy": per_call / memcpy,
                    "memcpy_all_ranks_seconds": memcpy_all,
                    "ratio_to_memcpy_all_ranks": per_call / memcpy_all,
                }
            )
    return rows


def _gather_reduce(ctx: Any) -> None:
    out = torch.empty(ctx.world_size)
    dist.all_gather_into_tensor(out, torch.tensor([float(ctx.rank)]))
    t = torch.ones(1)
    dist.all_reduce(t)


def _gather_reduce_torch(rank: int, world_size: int) -> None:
    out = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    t = torch.ones(1)
    dist.all_reduce(t)


def scale(world_sizes: list[int], torch_max: int) -> list[dict[str, Any]]:
    """Whole runs: the first one starts the warm crew (threads + groups), later ones reuse it."""
    from dstest.worlds.threaded import shutdown_all

    rows = []
    for ws in world_sizes:
        start = time.perf_counter()
        WORLD.run(_gather_reduce, ws, timeout=600)
        first = time.perf_counter() - start
        warm = median_seconds(lambda: WORLD.run(_gather_reduce, ws, timeout=600), 3)  # noqa: B023
        shutdown_all()
        theirs = None
        if ws <= torch_max:
            theirs = median_seconds(lambda: run_torch_threaded(_gather_reduce_torch, ws), 3 if ws <= 256 else 1)  # noqa: B023
        rows.append(
            {
                "world_size": ws,
                "dstest_first_seconds": first,
                "dstest_warm_seconds": warm,
                "torch_threaded_seconds": theirs,
                "ratio_torch_to_dstest_first": (theirs / first) if theirs else None,
                "ratio_torch_to_dstest_warm": (theirs / warm) if theirs else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (CI smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--torch-max", type=int, default=512, help="largest world for torch's threaded group (1024 takes minutes)"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    sizes = [1 << 10, 1 << 20, 64 << 20] if not args.quick else [1 << 10, 1 << 20]
    results: dict[str, Any] = {"torch": torch.__version__}
    results["bandwidth"] = bandwidth(sizes, reps=3 if args.quick else 5)
    print(
        f"\nthreaded collectives at W={BW_WORLD_SIZE} vs memcpy of one rank's output and of all W ranks' outputs "
        "(lower is better)"
    )
    print(
        f"{'bytes':>10} {'collective':<24} {'ms/call':>10} {'memcpy ms':>10} {'ratio':>8} {'W x memcpy ms':>14} {'ratio':>8}"
    )
    for r in results["bandwidth"]:
        print(
            f"{r['bytes']:>10} {r['collective']:<24} {r['seconds'] * 1e3:>10.3f} {r['memcpy_seconds'] * 1e3:>10.3f} {r['ratio_to_memcpy']:>8.2f} {r['memcpy_all_ranks_seconds'] * 1e3:>14.3f} {r['ratio_to_memcpy_all_ranks']:>8.2f}"
        )
    ws_list = [8, 64, 256] if args.quick else [8, 64, 128, 256, 512, 1024]
    results["scale"] = scale(ws_list, torch_max=min(args.torch_max, 256) if args.quick else args.torch_max)
    print("\nall_gather + all_reduce, whole world run; dstest's first run starts the crew, warm reuses it")
    print(f"{'ranks':>6} {'first s':>9} {'warm s':>9} {'torch thr s':>12} {'torch/first':>12} {'torch/warm':>11}")
    for r in results["scale"]:
        theirs = r["torch_threaded_seconds"]
        cells = (
            (f"{theirs:.3f}", f"{r['ratio_torch_to_dstest_first']:.2f}", f"{r['ratio_torch_to_dstest_warm']:.2f}")
            if theirs
            else ("-", "-", "-")
        )
        print(
            f"{r['world_size']:>6} {r['dstest_first_seconds']:>9.3f} {r['dstest_warm_seconds']:>9.3f} "
            f"{cells[0]:>12} {cells[1]:>12} {cells[2]:>11}"
        )
    start = time.perf_counter()
    FakeWorld().run(_gather_reduce, 65536)
    results["fake_65536_seconds"] = time.perf_counter() - start
    print(f"\nfake world, 65,536 ranks (ranks 0 and 65535 simulated): {results['fake_65536_seconds']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
