"""A warm threaded run against the floor of a run, side by side in one process.

    python benchmarks/bench_run_floor.py [--sizes 2,4,8] [--runs 300] [--rounds 3] [--json PATH]

- ``dstest``: ``ThreadedWorld(warm=True).run`` of a body of one 4-element ``all_reduce``: what a spec's
  world costs per test, outside pytest.
- ``floor``: the same shape with nothing else: W parked plain threads, each handed the run by a queue of its
  own, one all_reduce through one ``threading.Condition`` (the last to arrive sums and copies into every
  rank's tensor and wakes the others), the caller waiting for W answers on one queue.

Per round, each side gets 50 runs of warm-up, then ``--runs`` timed runs; medians per round, the two sides
alternating, and the median of the rounds' ratios. What dstest adds to the floor is its per-run work on
every rank and on the caller (context, generator, hooks, recorder, the run's checks at its end) and the
collective's path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import threading
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore", FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _timing import median_seconds  # noqa: E402

from dstest.worlds.request import RunRequest  # noqa: E402
from dstest.worlds.threaded import ThreadedWorld  # noqa: E402


class _FloorWorld:
    """W parked threads; a run hands each a task and waits for W answers."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cv = threading.Condition()
        self.arrived, self.generation = 0, 0
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.tasks: list[queue.SimpleQueue[bool]] = [queue.SimpleQueue() for _ in range(world_size)]
        self.answers: queue.SimpleQueue[int] = queue.SimpleQueue()
        for rank in range(world_size):
            threading.Thread(target=self._serve, args=(rank,), daemon=True).start()

    def _all_reduce(self, rank: int, t: torch.Tensor) -> None:
        with self.cv:
            self.slots[rank] = t
            self.arrived += 1
            generation = self.generation
            if self.arrived == self.world_size:
                total = torch.stack(self.slots).sum(0)  # type: ignore[arg-type]
                for s in self.slots:
                    s.copy_(total)  # type: ignore[union-attr]
                self.arrived, self.generation = 0, self.generation + 1
                self.cv.notify_all()
            else:
                while self.generation == generation:
                    self.cv.wait()

    def _serve(self, rank: int) -> None:
        while self.tasks[rank].get():
            t = torch.ones(4)
            self._all_reduce(rank, t)
            self.answers.put(rank)

    def run(self) -> None:
        for q in self.tasks:
            q.put(True)
        for _ in range(self.world_size):
            self.answers.get()

    def close(self) -> None:
        for q in self.tasks:
            q.put(False)


def _body(ctx: Any) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)


def _timed(fn: Any, runs: int) -> float:
    for _ in range(50):
        fn()
    return median_seconds(fn, runs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    world = ThreadedWorld(warm=True)
    rows = []
    load = os.getloadavg()
    print(f"a warm run vs the floor of a run, median ms per run ({args.runs} runs, {args.rounds} rounds); load {load[0]:.2f}")
    print(f"{'W':>3} {'floor':>8} {'dstest':>8} {'dstest/floor':>13}")
    for ws in (int(s) for s in args.sizes.split(",")):
        floor = _FloorWorld(ws)
        request = RunRequest(_body, ws)
        floors, ours = [], []
        try:
            for _ in range(args.rounds):
                floors.append(_timed(floor.run, args.runs))
                ours.append(_timed(functools.partial(world.run, request), args.runs))
        finally:
            floor.close()
        ratio = statistics.median(o / f for o, f in zip(ours, floors))
        f_ms, o_ms = statistics.median(floors) * 1e3, statistics.median(ours) * 1e3
        rows.append({"world_size": ws, "floor_s": statistics.median(floors), "dstest_s": statistics.median(ours),
                     "ratio_dstest_to_floor": ratio})
        print(f"{ws:>3} {f_ms:>8.3f} {o_ms:>8.3f} {ratio:>12.2f}x")
    report = {"benchmark": "run_floor", "runs": args.runs, "rounds": args.rounds, "load_at_start": list(load), "rows": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
