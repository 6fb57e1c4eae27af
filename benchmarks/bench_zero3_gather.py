"""Stage-3 parameter gather (contract D3, D4, D6): the cached padded gather against allocate-and-copy.

    python benchmarks/bench_zero3_gather.py [--world-sizes 2,4] [--sizes 169,65537,1048583,4194319]
                                            [--group-sizes 65,13,169,13,13,13,65,5] [--reps 30]
                                            [--device cpu] [--json PATH]

In one threaded world per world size, for each parameter size N (none divisible by W), rank 0 times,
round-robin so every variant sees the same machine conditions:

``cached``
    impl's gather (:class:`impl.zero.gather.ParamGatherer`): one all-gather of uniform count P from the
    shard into a pooled W·P buffer, the parameter being ``buffer[:N].view(shape)``; then release. After
    the first round it allocates nothing (D4).
``alloc_copy``
    what code without the cache does: allocate a fresh W·P buffer, the same all-gather, then copy
    ``buffer[:N]`` out into a freshly allocated parameter tensor (two allocations and one copy per gather).
``grouped`` / ``singles`` (D6)
    the small parameters of a layer (``--group-sizes``, hidden size 13) prefetched in one grouped launch
    (one all-gather, one compaction) against one cached gather per parameter. Grouping trades launches
    for two copies (pack and compaction), so it pays where a launch costs more than copying the bytes:
    small parameters, and NCCL's per-launch latency on GPUs.

Prints medians and ratios (``x`` > 1: the first variant is faster) and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The checkout, not an installed copy (an editable install made before impl/__init__.py existed maps
# impl as a namespace package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from impl.comm.collectives import all_gather_into
from impl.zero.gather import ParamGatherer
from impl.zero.partition import partition_parameters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _shards(sizes: list[int], ctx: Any) -> tuple[list[torch.Tensor], list[Any]]:
    fulls = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(ctx.device) for n in sizes]
    named = [(f"p{k}", f) for k, f in enumerate(fulls)]
    return fulls, partition_parameters(named, ctx.world_size, ctx.rank)[1]


def _run(ctx: Any, sizes: list[int], group_sizes: list[int], reps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    group = dist.group.WORLD
    fulls, shards = _shards(sizes, ctx)
    cached = ParamGatherer(shards, group)
    small_fulls, small = _shards(group_sizes, ctx)
    grouped = ParamGatherer(small, group)
    singles = ParamGatherer(small, group, pool=grouped.pool)

    def run_cached(i: int) -> torch.Tensor:
        out = cached.gather(i)
        cached.release(i)
        return out

    def run_alloc_copy(i: int) -> torch.Tensor:
        lay = shards[i].layout
        buf = torch.empty(lay.padded_numel, dtype=shards[i].tensor.dtype, device=ctx.device)
        all_gather_into(buf, shards[i].tensor, group)
        return buf[: lay.numel].clone().view(lay.shape)

    def run_grouped() -> None:
        grouped.gather_many(range(len(group_sizes)))
        grouped.release_all()

    def run_singles() -> None:
        for i in range(len(group_sizes)):
            singles.gather(i)
        singles.release_all()

    for i, f in enumerate(fulls):  # every path is correct before anything is timed
        assert torch.equal(run_cached(i), f) and torch.equal(run_alloc_copy(i), f)
    for got, f in zip(grouped.gather_many(range(len(group_sizes))), small_fulls, strict=True):
        assert torch.equal(got, f)
    grouped.release_all()

    times: dict[str, list[list[float]]] = {"cached": [[] for _ in sizes], "alloc_copy": [[] for _ in sizes]}
    group_times: dict[str, list[float]] = {"grouped": [], "singles": []}
    allocations: dict[str, int] = {}
    for k in range(warmup + reps):
        if k == warmup:
            allocations["cached_before"] = cached.pool.allocations
        for i in range(len(sizes)):
            for name, fn in (("cached", run_cached), ("alloc_copy", run_alloc_copy)):
                _sync(ctx.device)
                start = time.perf_counter()
                fn(i)
                _sync(ctx.device)
                if k >= warmup:
                    times[name][i].append(time.perf_counter() - start)
        for name, gfn in (("grouped", run_grouped), ("singles", run_singles)):
            _sync(ctx.device)
            start = time.perf_counter()
            gfn()
            _sync(ctx.device)
            if k >= warmup:
                group_times[name].append(time.perf_counter() - start)
    allocations["cached_after"] = cached.pool.allocations
    rows = []
    for i, n in enumerate(sizes):
        c = statistics.median(times["cached"][i])
        a = statistics.median(times["alloc_copy"][i])
        rows.append(
            {"numel": n, "P": shards[i].layout.shard_size, "bytes": 4 * n,
             "cached_us": 1e6 * c, "alloc_copy_us": 1e6 * a, "ratio_alloc_copy_over_cached": a / c}
        )  # fmt: skip
    g, s = statistics.median(group_times["grouped"]), statistics.median(group_times["singles"])
    return {
        "rows": rows,
        "grouped": {
            "params": len(group_sizes),
            "sizes": group_sizes,
            "grouped_us": 1e6 * g,
            "singles_us": 1e6 * s,
            "ratio_singles_over_grouped": s / g,
        },
        "allocations_per_cached_gather_after_warmup": (allocations["cached_after"] - allocations["cached_before"])
        / (reps * len(sizes)),
        "allocations_per_alloc_copy_gather": 2,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--sizes", default="169,65537,1048583,4194319", help="parameter element counts")
    parser.add_argument("--group-sizes", default="65,13,169,13,13,13,65,5", help="parameters prefetched together")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="tensor device of the ranks")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    world_sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    group_sizes = [int(s) for s in args.group_sizes.split(",") if s.strip()]
    torch.set_num_threads(1)  # rank threads already share the cores
    world = ThreadedWorld(device=args.device)
    report: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "reps": args.reps, "worlds": []}
    began = time.perf_counter()
    for ws in world_sizes:
        result = world.run(RunRequest(_run, ws, args=(sizes, group_sizes, args.reps, args.warmup), timeout=600))[0]
        report["worlds"].append({"world_size": ws, **result})
        print(f"\nW={ws}, median of {args.reps} gathers on rank 0 ({args.device}, threaded world)")
        print(f"{'N':>9} {'P':>8} {'cached us':>10} {'alloc+copy us':>14} {'alloc+copy / cached':>20}")
        for r in result["rows"]:
            print(
                f"{r['numel']:>9} {r['P']:>8} {r['cached_us']:>10.1f} {r['alloc_copy_us']:>14.1f} "
                f"{r['ratio_alloc_copy_over_cached']:>19.2f}x"
            )
        grp = result["grouped"]
        print(
            f"prefetch of {grp['params']} small parameters {grp['sizes']}: grouped {grp['grouped_us']:.1f} us, "
            f"{grp['params']} single gathers {grp['singles_us']:.1f} us, singles / grouped "
            f"{grp['ratio_singles_over_grouped']:.2f}x"
        )
        print(
            f"allocations per gather after warm-up: cached {result['allocations_per_cached_gather_after_warmup']:g}, "
            f"alloc+copy {result['allocations_per_alloc_copy_gather']}"
        )
    report["seconds"] = time.perf_counter() - began
    print(f"\ntotal {report['seconds']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
