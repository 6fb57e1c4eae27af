"""The cost of ``ctx.assert_replicas`` (G4) against one all_reduce of the same bytes.

    python benchmarks/bench_replicas.py [--params N] [--world threaded|process] [--size W] [--reps R]

Side by side in one run, interleaved on every rank: ``assert_replicas`` of a model of about N parameters
(an MLP of square Linear layers, fp32; identical on every rank, so the check passes: fingerprints only),
and one ``all_reduce`` of a flat fp32 tensor of the same element count (what DDP moves per step). Also the
failing case: one element of one parameter changed on rank 1 (fingerprints, then that parameter's values
gathered, compared and reported). Medians of R interleaved repetitions, wall seconds, per rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import dstest
from dstest.errors import ReplicasDiverge


def _model(params: int) -> nn.Module:
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def measure(ctx: Any, params: int, reps: int) -> dict[str, float]:
    model = _model(params)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.ones(numel)
    times: dict[str, list[float]] = {"assert_replicas": [], "all_reduce": [], "assert_replicas (one differs)": []}
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        ctx.assert_replicas(model)
        times["assert_replicas"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        times["all_reduce"].append(time.perf_counter() - start)
        last = list(model.parameters())[-2]
        kept = last[0, 0].clone()  # restored bit for bit after (x + 1 - 1 is not x)
        with torch.no_grad():
            if ctx.rank == 1:
                last[0, 0] += 1.0
        dist.barrier()
        start = time.perf_counter()
        try:
            ctx.assert_replicas(model)
        except ReplicasDiverge:
            pass
        times["assert_replicas (one differs)"].append(time.perf_counter() - start)
        with torch.no_grad():
            if ctx.rank == 1:
                last[0, 0] = kept
    out = {k: statistics.median(v) for k, v in times.items()}
    out["numel"] = float(numel)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--world", default="threaded", choices=["threaded", "process"])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = dstest.run(measure, args.size, world=args.world, args=(args.params, args.reps), timeout=600)[0]
    numel = int(result.pop("numel"))
    print(
        f"{args.world} world, W = {args.size}, {numel:,} fp32 parameters ({numel * 4 / 2**20:.0f} MiB), medians of {args.reps}:"
    )
    base = result["all_reduce"]
    for name, seconds in result.items():
        print(f"  {name:32s} {seconds * 1e3:9.1f} ms   x{seconds / base:.2f} of one all_reduce")


if __name__ == "__main__":
    main()
