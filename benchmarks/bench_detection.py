"""How fast the threaded world reports a broken run, against a correct run of the same calls.

    python benchmarks/bench_detection.py [--quick] [--json PATH]

Each case runs the same body twice on a warm threaded world of W ranks: once correct, once broken at the
same step (a shape mismatch; a rank that skips a collective and finishes; a DDP step one rank does not
take; an error on one rank while another spins in Python; an async all_reduce never waited). The figure
is the median wall time of the broken run to its RankFailure, as a ratio to the correct run (1 would mean
the failure costs nothing beyond the run itself), and in milliseconds beside the world's timeout, which
none of them reaches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median_seconds

from dstest.errors import RankFailure
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld, shutdown_all

WORLD = ThreadedWorld(warm=True)
TIMEOUT = 30.0


def _body(ctx: Any, case: str, broken: bool) -> None:
    me = broken and ctx.rank == ctx.world_size - 1
    t = torch.ones(64)
    if case == "ddp_desync":
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 4))
        for _ in range(1 if me else 2):
            model(torch.ones(2, 8)).sum().backward()
        return
    for step in range(4):
        if step < 2:
            dist.all_reduce(t)
            continue
        if case == "shape":
            dist.all_reduce(torch.ones(65) if me else t)
        elif case == "skip_and_finish":
            if me:
                return
            dist.all_reduce(t)
        elif case == "error_while_spinning":
            if me:
                raise ValueError("broken")
            if broken:
                deadline = time.monotonic() + TIMEOUT
                while time.monotonic() < deadline:
                    pass
            dist.all_reduce(t)
        elif case == "unwaited":
            work = dist.all_reduce(t, async_op=True)
            if me:
                return  # the broken rank returns without waiting
            work.wait()
        else:
            raise ValueError(f"case={case!r}")


def _run(case: str, broken: bool, world_size: int) -> None:
    try:
        WORLD.run(RunRequest(_body, world_size, args=(case, broken), timeout=TIMEOUT))
    except RankFailure:
        if not broken:
            raise
        return
    if broken:
        raise AssertionError(f"{case}: the broken run passed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reps = 3 if args.quick else 7
    rows = []
    for case in ("shape", "skip_and_finish", "ddp_desync", "error_while_spinning", "unwaited"):
        for world_size in (2, 4):
            _run(case, False, world_size)  # warm the crew
            ok = median_seconds(lambda: _run(case, False, world_size), reps)  # noqa: B023
            bad = median_seconds(lambda: _run(case, True, world_size), reps)  # noqa: B023
            rows.append(
                {
                    "case": case,
                    "world_size": world_size,
                    "correct_ms": ok * 1e3,
                    "broken_ms": bad * 1e3,
                    "ratio": bad / ok,
                    "timeout_ms": TIMEOUT * 1e3,
                }
            )
            print(f"{case:22s} W={world_size}: broken {bad * 1e3:8.2f} ms, correct {ok * 1e3:8.2f} ms, "
                  f"ratio {bad / ok:6.2f}x (timeout {TIMEOUT:g} s)")
    shutdown_all()
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "detection", "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
