"""The cost of recording every collective (counts, bytes, the records of ``dstest.trace``).

    python benchmarks/bench_trace.py [--quick] [--json PATH]

Side by side in one process, interleaved: the same loop of small all_reduces on the warm threaded world
(and on the fake world) with the recorder as it always runs, and with the recorder's two entry points
replaced by stubs that record nothing (what the worlds cost without it). Reported per call: the wall
time and the CPU time of the whole process (every rank thread; robust when other work shares the
cores), for each side, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import dstest.trace as _trace
from dstest.worlds.fake import FakeWorld
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld


def _loop(ctx: Any, nbytes: int, reps: int) -> float:
    t = torch.ones(max(1, nbytes // 4))
    dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(t)
    dist.barrier()
    return (time.perf_counter() - start) / reps


class _Null:
    """A record that keeps nothing (its hooks are empty calls)."""

    def finished(self, error: object) -> None:
        pass

    def waiting(self, log: object = None) -> None:
        pass

    def waited(self) -> None:
        pass


_NULL = _Null()


class _Off:
    """Replaces the recorder's entry points by stubs for the block (the cost of the worlds without it;
    the stub's empty hook calls stay, so the ratio slightly understates the recorder's cost)."""

    def __enter__(self) -> None:
        self.saved = (_trace.Recorder.collective, _trace.Recorder.p2p)
        _trace.Recorder.collective = lambda self, *a: _NULL  # type: ignore[assignment, method-assign]
        _trace.Recorder.p2p = lambda self, *a: _NULL  # type: ignore[assignment, method-assign]

    def __exit__(self, *exc: object) -> None:
        _trace.Recorder.collective, _trace.Recorder.p2p = self.saved  # type: ignore[method-assign]


def side_by_side(world: Any, world_size: int, nbytes: int, reps: int, rounds: int) -> dict[str, Any]:
    on: list[tuple[float, float]] = []
    off: list[tuple[float, float]] = []
    ranks = 1 if world.name == "fake" else world_size  # the fake world runs its simulated ranks in turn

    def one() -> tuple[float, float]:
        cpu = time.process_time()
        wall = max(world.run(RunRequest(_loop, world_size, args=(nbytes, reps))))
        return wall, (time.process_time() - cpu) / (reps * ranks * (1 if ranks > 1 else 2))

    world.run(RunRequest(_loop, world_size, args=(nbytes, 10)))  # warm
    for _ in range(rounds):
        on.append(one())
        with _Off():
            off.append(one())
    wall_on, wall_off = statistics.median(w for w, _ in on), statistics.median(w for w, _ in off)
    cpu_on, cpu_off = statistics.median(c for _, c in on), statistics.median(c for _, c in off)
    return {
        "world": world.name,
        "world_size": world_size,
        "bytes": nbytes,
        "calls_per_run": reps,
        "recording_wall_s_per_call": wall_on,
        "stubbed_wall_s_per_call": wall_off,
        "wall_ratio": wall_on / wall_off,
        "recording_cpu_s_per_rank_call": cpu_on,
        "stubbed_cpu_s_per_rank_call": cpu_off,
        "cpu_ratio": cpu_on / cpu_off,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    reps, rounds = (100, 3) if args.quick else (300, 7)
    rows = [
        side_by_side(ThreadedWorld(warm=True), 4, 1024, reps, rounds),
        side_by_side(FakeWorld(), 4, 1024, reps * 10, rounds),
        side_by_side(FakeWorld(), 65_536, 1024, reps * 10, rounds),
    ]
    for row in rows:
        print(
            f"{row['world']:>8} W={row['world_size']:<6} {row['bytes']} B all_reduce, per call: wall "
            f"{row['recording_wall_s_per_call'] * 1e6:7.1f} us recording / {row['stubbed_wall_s_per_call'] * 1e6:7.1f} "
            f"us stubbed = {row['wall_ratio']:.3f}; CPU per rank "
            f"{row['recording_cpu_s_per_rank_call'] * 1e6:7.1f} / {row['stubbed_cpu_s_per_rank_call'] * 1e6:7.1f} us "
            f"= {row['cpu_ratio']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
