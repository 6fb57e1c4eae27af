"""The threaded world's rank threads on any CPU (``DSTEST_RANK_CPUS=any``) against all on one (``one``), and what
``auto`` (the default) decides on this machine.

    python benchmarks/bench_rank_cpus.py [--rounds 3] [--json PATH]

The same bodies, on the same data, in this one process, the two settings alternating round by round (a
crew made under one setting is replaced when the other is set, so each round's first run is a warm-up):

- ``all_reduce W=N``: a 1 KiB all_reduce per call, slowest rank (``bench_threaded.py``'s loop, 300 calls);
- ``trivial run W=4``: a whole warm run of a body of one all_reduce (median of 300 runs);
- ``fsdp2 step W=4`` and ``dtensor redistribute W=4``: ``bench_torch_stacks.py``'s bodies, per step;
- ``large matmuls W=4``: each rank 20 matmuls of 512 x 512 then one all_reduce, per run: work that runs
  outside the GIL, in parallel on several CPUs when the ranks may use them;
- ``mid elementwise W=4``: each rank 200 multiply-adds of 16,384 elements (below torch's grain: each runs on
  the rank's own thread, outside the GIL) then one all_reduce, per run;
- ``small MLP steps W=4`` and ``conv steps W=4``: each rank 5 forward and backward passes of a 3-layer MLP of
  512 features on a batch of 64 (all_reduce of every gradient), or of a 16 -> 32 channel 3x3 convolution on
  8 x 32 x 32 inputs, per run.

Ratios are ``any / one`` (above 1: one CPU is faster). What the figures mean depends on the machine's
CPUs and load; the script prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from bench_threaded import WORLD, _dstest_loop
from bench_torch_stacks import _on_dstest

from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import cpus

MODES = ("any", "one")


def _trivial(ctx: Any) -> None:
    dist.all_reduce(torch.ones(4))


def _matmuls(ctx: Any) -> None:
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    dist.all_reduce(a)


def _elementwise(ctx: Any) -> None:
    x, y = torch.ones(16384), torch.full((16384,), 0.5)
    for _ in range(200):
        x = x * 1.0001 + y
    dist.all_reduce(x[:4].contiguous())


def _mlp(ctx: Any) -> None:
    torch.manual_seed(ctx.rank)
    layers = [torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    x = torch.randn(64, 512)
    for _ in range(5):
        model(x).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # type: ignore[arg-type]


def _conv(ctx: Any) -> None:
    torch.manual_seed(ctx.rank)
    conv = torch.nn.Conv2d(16, 32, 3)
    x = torch.randn(8, 16, 32, 32)
    for _ in range(5):
        conv(x).sum().backward()
    dist.all_reduce(conv.weight.grad)  # type: ignore[arg-type]


def _per_call(w: int) -> float:
    WORLD.run(RunRequest(_dstest_loop, w, args=("all_reduce", 1024, 50), timeout=600))
    return max(WORLD.run(RunRequest(_dstest_loop, w, args=("all_reduce", 1024, 300), timeout=600)))


def _per_run(body: Any, w: int, n: int) -> float:
    WORLD.run(RunRequest(body, w, timeout=600))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        WORLD.run(RunRequest(body, w, timeout=600))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _per_step(name: str, w: int, args: tuple[Any, ...]) -> float:
    WORLD.run(RunRequest(_on_dstest, w, args=(name, *args), timeout=600))
    return max(WORLD.run(RunRequest(_on_dstest, w, args=(name, *args), timeout=600)))


CASES = {
    "all_reduce W=2 (ms per call)": lambda: _per_call(2),
    "all_reduce W=4 (ms per call)": lambda: _per_call(4),
    "all_reduce W=8 (ms per call)": lambda: _per_call(8),
    "trivial run W=4 (ms per run)": lambda: _per_run(_trivial, 4, 300),
    "fsdp2 step W=4 (ms per step)": lambda: _per_step("fsdp2_step", 4, (10, 64)),
    "dtensor redistribute W=4 (ms per round)": lambda: _per_step("dtensor_redistribute", 4, (20, 64)),
    "large matmuls W=4 (ms per run)": lambda: _per_run(_matmuls, 4, 5),
    "mid elementwise W=4 (ms per run)": lambda: _per_run(_elementwise, 4, 15),
    "small MLP steps W=4 (ms per run)": lambda: _per_run(_mlp, 4, 15),
    "conv steps W=4 (ms per run)": lambda: _per_run(_conv, 4, 15),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"CPUs this process may use: {usable}; torch threads: {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}"
    )
    seen: dict[str, dict[str, list[float]]] = {case: {m: [] for m in MODES} for case in CASES}
    saved = os.environ.get(cpus.ENV_RANK_CPUS)
    os.environ.pop(cpus.ENV_RANK_CPUS, None)
    decision = cpus.auto_decision()  # measured here, before any world: what the default does on this machine
    print(f"auto (the default): {decision.describe()}")
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                os.environ[cpus.ENV_RANK_CPUS] = mode
                for case, measure in CASES.items():
                    seen[case][mode].append(measure())
    finally:
        if saved is None:
            os.environ.pop(cpus.ENV_RANK_CPUS, None)
        else:
            os.environ[cpus.ENV_RANK_CPUS] = saved
    rows = []
    print("\n| case | any CPU | one CPU | any / one |")
    print("|---|---|---|---|")
    for case, by_mode in seen.items():
        any_s, one_s = (statistics.median(by_mode[m]) for m in MODES)
        rows.append({"case": case, "any_ms": any_s * 1e3, "one_ms": one_s * 1e3, "any_over_one": any_s / one_s})
        print(f"| {case} | {any_s * 1e3:.4g} | {one_s * 1e3:.4g} | {any_s / one_s:.2f}x |")
    if args.json:
        auto = {"mode": decision.mode, "ratio": decision.ratio, "reason": decision.reason}
        args.json.write_text(
            json.dumps({"cpus": usable, "load": os.getloadavg()[0], "auto": auto, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
