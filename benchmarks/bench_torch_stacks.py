"""torch's stacks on three CPU worlds: an FSDP2 training step and a DTensor redistribute, side by side.

    python benchmarks/bench_torch_stacks.py [--quick] [--json PATH]

The same rank bodies, on the same data, run in one process on (a) dstest's threaded world (warm crew),
(b) torch's own threaded process group, driven as ``MultiThreadedTestCase`` drives it (private torch API,
see _torch_threaded.py), and (c) dstest's process world (warm gloo pool, every call checked by the
referee). Two figures per world and world size, both medians over rounds:

- ``step``: seconds per FSDP2 step (forward, backward, AdamW) or per redistribute round, timed inside the
  ranks after a warm-up (the slowest rank's figure);
- ``run``: seconds for a whole run of the body (world start included; warm worlds reuse their ranks).

Ratios are ``other / dstest threaded`` (above 1: dstest's threaded world is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median_seconds
from _torch_threaded import run_torch_threaded

from dstest.worlds.process import ProcessWorld
from dstest.worlds.process import shutdown_all as shutdown_processes
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from dstest.worlds.threaded import shutdown_all as shutdown_threads

THREADED = ThreadedWorld(warm=True)
PROCESS = ProcessWorld()


# -- the rank bodies (plain (rank, world_size) functions: every world calls the same code) --------------------
def fsdp2_steps(rank: int, world_size: int, steps: int, width: int) -> float:
    """fully_shard a 3-layer MLP per layer and at the root; time AdamW steps on this rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(16, width, generator=data), torch.randn(16, 8, generator=data)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()  # warm-up: lazy init, first all-gathers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def redistribute_rounds(rank: int, world_size: int, rounds: int, rows: int) -> float:
    """One round: Shard(0) -> Replicate -> Shard(1) -> Shard(0), and Partial -> Replicate, of a rows x 64 DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2))
    dt = distribute_tensor(full, mesh, [Shard(0)])
    part = DTensor.from_local(full, mesh, [Partial()])

    def one() -> None:
        a = dt.redistribute(mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).redistribute(mesh, [Shard(0)])
        b = part.redistribute(mesh, [Replicate()])
        assert a.to_local().shape == dt.to_local().shape and b.shape == full.shape

    one()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        one()
    dist.barrier()
    return (time.perf_counter() - start) / rounds


BODIES = {"fsdp2_step": fsdp2_steps, "dtensor_redistribute": redistribute_rounds}


def _on_dstest(ctx: Any, name: str, *args: Any) -> float:
    return BODIES[name](ctx.rank, ctx.world_size, *args)


# -- the worlds --------------------------------------------------------------------------------------------------
def _run(world: str, name: str, ws: int, args: tuple[Any, ...]) -> float:
    """One whole run; returns the slowest rank's per-step time."""
    if world == "dstest_threaded":
        per_rank = THREADED.run(RunRequest(_on_dstest, ws, args=(name, *args), timeout=600))
    elif world == "dstest_process":
        per_rank = PROCESS.run(RunRequest(_on_dstest, ws, args=(name, *args), timeout=600))
    else:
        per_rank = run_torch_threaded(lambda r, w: BODIES[name](r, w, *args), ws)
    return max(per_rank)


def measure(name: str, ws: int, args: tuple[Any, ...], rounds: int) -> dict[str, Any]:
    row: dict[str, Any] = {"body": name, "world_size": ws, "args": list(args)}
    for world in ("dstest_threaded", "torch_threaded", "dstest_process"):
        _run(world, name, ws, args)  # start the crew / pool, import and compile what the body needs
        steps: list[float] = []

        def once() -> None:
            steps.append(_run(world, name, ws, args))  # noqa: B023

        row[f"{world}_run_seconds"] = median_seconds(once, rounds)
        row[f"{world}_step_seconds"] = statistics.median(steps)
    base_step, base_run = row["dstest_threaded_step_seconds"], row["dstest_threaded_run_seconds"]
    for world in ("torch_threaded", "dstest_process"):
        row[f"ratio_{world}_to_dstest_threaded_step"] = row[f"{world}_step_seconds"] / base_step
        row[f"ratio_{world}_to_dstest_threaded_run"] = row[f"{world}_run_seconds"] / base_run
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds (CI smoke run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    sizes = [2, 4] if args.quick else [2, 4, 8]
    rounds = 3 if args.quick else 5
    plans = [("fsdp2_step", (5, 64)), ("dtensor_redistribute", (10, 1024))]
    results: dict[str, Any] = {"torch": torch.__version__, "rounds": rounds, "rows": []}
    try:
        for name, body_args in plans:
            for ws in sizes:
                results["rows"].append(measure(name, ws, body_args, rounds))
    finally:
        shutdown_threads()
        shutdown_processes()
    print("\nper step (inside the ranks, slowest rank) and per whole run; ratios: other / dstest threaded")
    print(
        f"{'body':<22} {'W':>3} {'thr ms/step':>11} {'torch/thr':>9} {'proc/thr':>9} "
        f"{'thr s/run':>10} {'torch/thr':>9} {'proc/thr':>9}"
    )
    for r in results["rows"]:
        print(
            f"{r['body']:<22} {r['world_size']:>3} {r['dstest_threaded_step_seconds'] * 1e3:>11.2f} "
            f"{r['ratio_torch_threaded_to_dstest_threaded_step']:>9.2f} "
            f"{r['ratio_dstest_process_to_dstest_threaded_step']:>9.2f} "
            f"{r['dstest_threaded_run_seconds']:>10.3f} {r['ratio_torch_threaded_to_dstest_threaded_run']:>9.2f} "
            f"{r['ratio_dstest_process_to_dstest_threaded_run']:>9.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
