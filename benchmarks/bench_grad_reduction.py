"""impl gradient reduction: compute_grad_norm true/false and gradient_allreduce_op mean/sum, side by side.

    python benchmarks/bench_grad_reduction.py [--world-sizes 2,3] [--steps 40] [--device cpu] [--json PATH]

For every (stage, op, compute_grad_norm) one engine is built in the same threaded world, and the engines
take their steps round-robin (step k of every variant before step k+1 of any), so all variants share the
same machine conditions. Per variant: the collectives one step issues (counted by the engine, contract C6)
and the median per-step time (forward, backward with reduction, step) on rank 0. Reported as ratios:
false/true (compute_grad_norm) and sum/mean, for time and for collective counts.
"""

from __future__ import annotations

import argparse
import itertools
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
import impl
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

STAGES = (1, 2)
OPS = ("mean", "sum")
NORMS = (True, False)
DIMS = (256, 509, 511, 253)  # 0.52 M parameters, sizes not divisible by the world size


def _model(device: torch.device) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(DIMS):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) / a**0.5)
            lin.bias.zero_()
        layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


def _config(stage: int, op: str, norm: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_allreduce_op": op,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "compute_grad_norm": norm, "reduce_bucket_size": 200_000},
    }


def _run(ctx: Any, steps: int, warmup: int) -> dict[str, Any]:
    variants = list(itertools.product(STAGES, OPS, NORMS))
    engines = {v: impl.initialize(model=_model(ctx.device), config=_config(*v)) for v in variants}
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    x = torch.randn(16, DIMS[0], generator=g).to(ctx.device)
    y = torch.randn(16, DIMS[-1], generator=g).to(ctx.device)
    times: dict[tuple[int, str, bool], list[float]] = {v: [] for v in variants}
    step_times: dict[tuple[int, str, bool], list[float]] = {v: [] for v in variants}
    counts: dict[tuple[int, str, bool], dict[str, int]] = {}
    for k in range(warmup + steps):
        for v, engine in engines.items():
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            mid = time.perf_counter()
            engine.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            end = time.perf_counter()
            if k >= warmup:
                times[v].append(end - start)
                step_times[v].append(end - mid)
            counts[v] = engine.collective_counts()
    return {
        "params": sum(p.numel() for p in _model(torch.device("cpu")).parameters()),
        "rows": [
            {
                "stage": s,
                "op": op,
                "compute_grad_norm": norm,
                "step_ms": 1e3 * statistics.median(times[s, op, norm]),
                "optimizer_step_ms": 1e3 * statistics.median(step_times[s, op, norm]),
                "collectives": counts[s, op, norm],
                "collectives_total": sum(counts[s, op, norm].values()),
            }
            for s, op, norm in variants
        ],
    }


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["stage"], r["op"], r["compute_grad_norm"]): r for r in rows}
    out = []
    for stage in STAGES:
        for op in OPS:
            on, off = by[stage, op, True], by[stage, op, False]
            out.append(
                {"stage": stage, "compare": f"compute_grad_norm false/true ({op})",
                 "time_ratio": off["step_ms"] / on["step_ms"],
                 "optimizer_step_time_ratio": off["optimizer_step_ms"] / on["optimizer_step_ms"],
                 "collectives": f"{off['collectives_total']}/{on['collectives_total']}",
                 "collectives_fewer": on["collectives_total"] - off["collectives_total"]}
            )  # fmt: skip
        for norm in NORMS:
            m, s = by[stage, "mean", norm], by[stage, "sum", norm]
            out.append(
                {"stage": stage, "compare": f"sum/mean (compute_grad_norm {str(norm).lower()})",
                 "time_ratio": s["step_ms"] / m["step_ms"],
                 "optimizer_step_time_ratio": s["optimizer_step_ms"] / m["optimizer_step_ms"],
                 "collectives": f"{s['collectives_total']}/{m['collectives_total']}",
                 "collectives_fewer": m["collectives_total"] - s["collectives_total"]}
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,3", help="comma-separated world sizes (default 2,3)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="tensor device of the ranks")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    # Rank threads already share the cores; intra-op threads on top of them only add noise.
    torch.set_num_threads(1)
    world = ThreadedWorld(device=args.device)
    report: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "steps": args.steps, "worlds": []}
    began = time.perf_counter()
    for ws in sizes:
        result = world.run(RunRequest(_run, ws, args=(args.steps, args.warmup), timeout=600))[0]
        ratios = _ratios(result["rows"])
        report["worlds"].append(
            {"world_size": ws, "params": result["params"], "rows": result["rows"], "ratios": ratios}
        )
        print(f"\nW={ws}, {result['params']} parameters, median of {args.steps} steps ({args.device}, threaded world)")
        print(f"{'stage':>5} {'op':>4} {'norm':>5} {'step ms':>8} {'opt.step ms':>11}  collectives per step")
        for r in result["rows"]:
            c = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items()))
            norm = str(r["compute_grad_norm"]).lower()
            print(f"{r['stage']:>5} {r['op']:>4} {norm:>5} {r['step_ms']:>8.2f} {r['optimizer_step_ms']:>11.2f}  {c}")
        print(f"{'stage':>5} {'comparison':<40} {'step x':>7} {'opt.step x':>10} {'collectives':>11}")
        for q in ratios:
            print(
                f"{q['stage']:>5} {q['compare']:<40} {q['time_ratio']:>7.3f} "
                f"{q['optimizer_step_time_ratio']:>10.3f} {q['collectives']:>11}"
            )
    report["seconds"] = time.perf_counter() - began
    print(f"\ntotal {report['seconds']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
