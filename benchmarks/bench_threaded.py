"""Threaded world: small-collective latency, large-collective bandwidth, scale; each against a baseline
running the same calls on the same data in the same process.

    python benchmarks/bench_threaded.py [--quick] [--torch-max 512] [--json PATH]

- hand-off:  a bare ``threading.Event`` / ``Condition`` hand-off between two threads (one way);
- small:     1 KiB all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and send/recv at
  W = 2, 4, 8, the same loop on every side (per rank: one warm-up call and a barrier, then N calls; the
  mean per call of the slowest rank): dstest's warm world, torch's threaded group (which has no
  send/recv), and the GIL floor (plain threads, one ``Condition``, the last to arrive does the work and
  wakes the others; a send is a Condition hand-off plus the receiver's copy). ``--small-only`` runs only
  this section;
- large:     1 KiB - 64 MiB at W = 4 against a ``copy_`` of the bytes that must move (W outputs of an
  all_gather, the W inputs a reduce-scatter or all_reduce reads);
- scale:     whole-world runs of the same bodies on both sides (list ``all_gather`` of one-element
  tensors + ``all_reduce``; ``all_gather_into_tensor`` + ``all_reduce``), dstest cold and warm against
  torch's threaded group, and the floor of the list body: W^2 small copies in one thread;
- RSS per idle warm rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
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
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld, shutdown_all, warm_thread_cap

WORLD = ThreadedWorld(warm=True)
COLD = ThreadedWorld(warm=False)
BW_WORLD_SIZE = 4
SMALL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send_recv")


# -- the unit: a bare hand-off between threads -------------------------------------------------------
def handoff(kind: str, n: int = 4000) -> float:
    """Seconds per one-way hand-off (ping-pong between two threads, halved)."""
    if kind == "event":
        a, b = threading.Event(), threading.Event()

        def peer() -> None:
            for _ in range(n):
                a.wait()
                a.clear()
                b.set()

        t = threading.Thread(target=peer)
        t.start()
        start = time.perf_counter()
        for _ in range(n):
            a.set()
            b.wait()
            b.clear()
    else:
        cond = threading.Condition()
        turn = [0]

        def peer() -> None:
            for i in range(n):
                with cond:
                    while turn[0] != 2 * i + 1:
                        cond.wait()
                    turn[0] += 1
                    cond.notify()

        t = threading.Thread(target=peer)
        t.start()
        start = time.perf_counter()
        for i in range(n):
            with cond:
                turn[0] += 1
                cond.notify()
                while turn[0] != 2 * i + 2:
                    cond.wait()
    elapsed = time.perf_counter() - start
    t.join()
    return elapsed / n / 2


# -- per-call loops, the same on every side ----------------------------------------------------------
def _call(kind: str, nbytes: int, rank: int, w: int, ops: Any = dist) -> Any:
    """One rank's call of ``kind`` on ``nbytes`` (its tensors made once); ``ops`` is ``torch.distributed`` or
    the floor's :class:`_FloorRank`, which take the same calls."""
    n = max(1, nbytes // 4)
    if kind == "all_reduce":
        t = torch.ones(n)
        return lambda: ops.all_reduce(t)
    if kind == "all_gather_into_tensor":
        inp, out = torch.ones(n // w or 1), torch.empty((n // w or 1) * w)
        return lambda: ops.all_gather_into_tensor(out, inp)
    if kind == "reduce_scatter_tensor":
        inp, out = torch.ones((n // w or 1) * w), torch.empty(n // w or 1)
        return lambda: ops.reduce_scatter_tensor(out, inp)
    if kind == "broadcast":
        t = torch.ones(n)
        return lambda: ops.broadcast(t, 0)
    t = torch.ones(n)
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...: even ranks send, odd ranks receive
    if peer >= w:
        return lambda: None
    return (lambda: ops.send(t, peer)) if rank % 2 == 0 else (lambda: ops.recv(t, peer))


def _loop(rank: int, w: int, kind: str, nbytes: int, reps: int, ops: Any = dist) -> float:
    """Per rank: one warm-up call and a barrier, then ``reps`` calls; seconds per call (no barrier timed)."""
    call = _call(kind, nbytes, rank, w, ops)
    call()
    ops.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def _dstest_loop(ctx: Any, kind: str, nbytes: int, reps: int) -> float:
    return _loop(ctx.rank, ctx.world_size, kind, nbytes, reps)


# -- the GIL floor: plain threads, one Condition, the last to arrive does the work -------------------
class _Floor:
    """What any in-process collective must do at least: every rank posts its tensors under one
    ``threading.Condition``; the last to arrive computes the result (``torch.stack(...).sum(0)`` for the
    reductions), copies it into every rank's output and wakes the others with one ``notify_all``. A send
    hands its tensor to the receiver under a Condition of its pair and waits until the receiver copied it."""

    def __init__(self, w: int) -> None:
        self.w = w
        self.cond = threading.Condition()
        self.slots: list[Any] = [None] * w
        self.arrived = 0
        self.generation = 0
        self.pairs = [_FloorPair() for _ in range(w)]

    def collective(self, rank: int, data: Any, work: Any) -> None:
        with self.cond:
            self.slots[rank] = data
            self.arrived += 1
            if self.arrived == self.w:
                work(self.slots)
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return
            generation = self.generation
            while self.generation == generation:
                self.cond.wait()


class _FloorPair:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.slot: torch.Tensor | None = None
        self.posted = self.taken = 0

    def send(self, t: torch.Tensor) -> None:
        with self.cond:
            self.slot = t
            self.posted += 1
            self.cond.notify_all()
            while self.taken < self.posted:
                self.cond.wait()

    def recv(self, t: torch.Tensor) -> None:
        with self.cond:
            while self.slot is None:
                self.cond.wait()
            t.copy_(self.slot)
            self.slot = None
            self.taken += 1
            self.cond.notify_all()


def _sum_into_all(ts: list[torch.Tensor]) -> None:
    total = torch.stack(ts).sum(0)
    for t in ts:
        t.copy_(total)


def _gather_into_all(slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    gathered = torch.cat([inp for _, inp in slots])
    for out, _ in slots:
        out.copy_(gathered)


def _scatter_sum(slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    total = torch.stack([inp for _, inp in slots]).sum(0)
    n = slots[0][0].numel()
    for j, (out, _) in enumerate(slots):
        out.copy_(total[j * n : (j + 1) * n])


def _broadcast_root0(ts: list[torch.Tensor]) -> None:
    for t in ts[1:]:
        t.copy_(ts[0])


class _FloorRank:
    """One rank's ``dist``-like calls on a :class:`_Floor` (root 0 and pairs (0, 1), (2, 3)... as above)."""

    def __init__(self, floor: _Floor, rank: int) -> None:
        self.floor, self.rank = floor, rank

    def all_reduce(self, t: torch.Tensor) -> None:
        self.floor.collective(self.rank, t, _sum_into_all)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.floor.collective(self.rank, (out, inp), _gather_into_all)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.floor.collective(self.rank, (out, inp), _scatter_sum)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self.floor.collective(self.rank, t, _broadcast_root0)

    def barrier(self) -> None:
        self.floor.collective(self.rank, None, lambda slots: None)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.floor.pairs[min(self.rank, dst)].send(t)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.floor.pairs[min(self.rank, src)].recv(t)


def run_floor(kind: str, w: int, nbytes: int, reps: int) -> list[float]:
    """:func:`_loop` on ``w`` plain threads over one :class:`_Floor`; seconds per call of each rank."""
    floor = _Floor(w)
    results = [0.0] * w

    def main(rank: int) -> None:
        results[rank] = _loop(rank, w, kind, nbytes, reps, _FloorRank(floor, rank))

    threads = [threading.Thread(target=main, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def small(sizes: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    """Per call, slowest rank, median of ``rounds`` interleaved rounds (each side sees the same load)."""
    rows = []
    for w in sizes:
        for kind in SMALL:
            floor, ours, theirs = [], [], []
            for _ in range(rounds):
                floor.append(max(run_floor(kind, w, 1024, reps)))
                ours.append(max(WORLD.run(RunRequest(_dstest_loop, w, args=(kind, 1024, reps), timeout=600))))
                if kind != "send_recv":  # torch's threaded group has no send/recv
                    theirs.append(max(run_torch_threaded(lambda r, ws: _loop(r, ws, kind, 1024, reps), w)))  # noqa: B023
            f, o = statistics.median(floor), statistics.median(ours)
            t = statistics.median(theirs) if theirs else None
            rows.append(
                {
                    "world_size": w,
                    "collective": kind,
                    "floor_seconds": f,
                    "seconds": o,
                    "torch_seconds": t,
                    "ratio_dstest_to_floor": o / f,
                    "ratio_torch_to_dstest": (t / o) if t else None,
                }
            )
    return rows


def print_small(rows: list[dict[str, Any]]) -> None:
    print("\n1 KiB collectives, ms per call (per rank: warm-up call + barrier, then the calls; slowest rank)")
    print(
        f"{'W':>3} {'collective':<24} {'floor':>8} {'torch':>8} {'dstest':>8} {'dstest/floor':>13} {'torch/dstest':>13}"
    )
    for r in rows:
        t, ratio = r["torch_seconds"], r["ratio_torch_to_dstest"]
        theirs = "-" if t is None else f"{t * 1e3:.3f}"
        times = "-" if ratio is None else f"{ratio:.2f}x"
        print(
            f"{r['world_size']:>3} {r['collective']:<24} {r['floor_seconds'] * 1e3:>8.3f} {theirs:>8} "
            f"{r['seconds'] * 1e3:>8.3f} {r['ratio_dstest_to_floor']:>12.2f}x {times:>13}",
            flush=True,
        )


def bandwidth(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    w = BW_WORLD_SIZE
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        # The bytes the W ranks of one collective must move: W outputs of an all_gather, the W inputs
        # of a reduce-scatter or an all_reduce (all n elements per rank here).
        src_all, dst_all = torch.ones(n * w), torch.empty(n * w)
        for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            per_call = max(WORLD.run(RunRequest(_dstest_loop, w, args=(kind, nbytes, reps), timeout=600)))
            memcpy = median_seconds(lambda: dst_all.copy_(src_all), max(reps, 5))  # noqa: B023
            rows.append(
                {
                    "bytes": nbytes,
                    "collective": kind,
                    "seconds": per_call,
                    "memcpy_all_ranks_seconds": memcpy,
                    "ratio_to_memcpy_all_ranks": per_call / memcpy,
                }
            )
    return rows


# -- scale -----------------------------------------------------------------------------------------
def _list_body(rank: int, w: int) -> None:
    out = [torch.empty(1) for _ in range(w)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    t = torch.ones(1)
    dist.all_reduce(t)


def _tensor_body(rank: int, w: int) -> None:
    out = torch.empty(w)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    t = torch.ones(1)
    dist.all_reduce(t)


BODIES = {"list_all_gather": _list_body, "all_gather_into_tensor": _tensor_body}


def _ours(ctx: Any, body: str) -> None:
    BODIES[body](ctx.rank, ctx.world_size)


def floor_w2_copies(w: int) -> float:
    """The list body's floor: W^2 one-element copies (every rank writes every rank's tensor), one thread."""
    dsts, src = [torch.empty(1) for _ in range(w)], torch.ones(1)
    start = time.perf_counter()
    for _ in range(w):
        for d in dsts:
            d.copy_(src)
    return time.perf_counter() - start


def scale(world_sizes: list[int], torch_max: int, cold_only: list[int]) -> list[dict[str, Any]]:
    """``cold_only`` sizes run the all_gather_into_tensor body only (the list body's W^2 tensors at 4096
    ranks are 16.8 M); worlds above the warm-thread cap always run cold, so they get no warm figure."""
    rows = []
    for body in BODIES:
        for ws in world_sizes + (cold_only if body == "all_gather_into_tensor" else []):
            start = time.perf_counter()
            COLD.run(RunRequest(_ours, ws, args=(body,), timeout=900))
            cold = time.perf_counter() - start
            warm = None
            if ws not in cold_only and ws <= warm_thread_cap():
                WORLD.run(RunRequest(_ours, ws, args=(body,), timeout=900))
                warm = median_seconds(lambda: WORLD.run(RunRequest(_ours, ws, args=(body,), timeout=900)), 3)  # noqa: B023
                shutdown_all()
            theirs = None
            if ws <= torch_max and ws not in cold_only:
                theirs = median_seconds(lambda: run_torch_threaded(BODIES[body], ws), 3 if ws <= 256 else 1)  # noqa: B023
            floor = floor_w2_copies(ws) if body == "list_all_gather" else None
            rows.append(
                {
                    "body": body,
                    "world_size": ws,
                    "dstest_cold_seconds": cold,
                    "dstest_warm_seconds": warm,
                    "torch_threaded_seconds": theirs,
                    "w2_copies_floor_seconds": floor,
                    "ratio_torch_to_dstest_cold": (theirs / cold) if theirs else None,
                    "ratio_torch_to_dstest_warm": (theirs / warm) if theirs and warm else None,
                }
            )
            print(
                f"  {body:<24} {ws:>5} cold {cold:8.3f} s  warm {warm if warm is None else round(warm, 3)}  "
                f"torch {theirs if theirs is None else round(theirs, 3)}  W^2 floor {floor if floor is None else round(floor, 3)}",
                flush=True,
            )
    return rows


def _noop(ctx: Any) -> None:
    pass


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rss_per_warm_rank(ws: int) -> dict[str, Any]:
    shutdown_all()
    gc.collect()  # what earlier crews left is freed before, not during, the measured start (it ends with a collection)
    before = _rss_kib()
    WORLD.run(RunRequest(_noop, ws))
    after = _rss_kib()
    shutdown_all()
    return {
        "world_size": ws,
        "rss_kib_before": before,
        "rss_kib_after": after,
        "kib_per_idle_warm_rank": (after - before) / ws,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (CI smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--torch-max", type=int, default=512, help="largest world for torch's threaded group (1024 takes minutes)"
    )
    parser.add_argument("--small-only", action="store_true", help="only the hand-off and the 1 KiB collectives")
    parser.add_argument("--world-sizes", type=int, nargs="+", help="world sizes of the small section")
    parser.add_argument("--reps", type=int, help="calls per rank in the small section")
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval for the whole benchmark (every side), in seconds"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    results: dict[str, Any] = {"torch": torch.__version__, "load_at_start": os.getloadavg()}
    results["handoff"] = {"event_seconds": handoff("event"), "condition_seconds": handoff("condition")}
    print(
        f"load {os.getloadavg()}; one-way hand-off between two threads: Event "
        f"{results['handoff']['event_seconds'] * 1e3:.4f} ms, Condition {results['handoff']['condition_seconds'] * 1e3:.4f} ms"
    )

    small_sizes = args.world_sizes or ([2, 4] if args.quick else [2, 4, 8])
    results["small"] = small(small_sizes, reps=args.reps or (100 if args.quick else 300), rounds=1 if args.quick else 3)
    print_small(results["small"])
    if args.small_only:
        results["load_at_end"] = os.getloadavg()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return

    sizes = [1 << 10, 1 << 20, 64 << 20] if not args.quick else [1 << 10, 1 << 20]
    results["bandwidth"] = bandwidth(sizes, reps=3 if args.quick else 5)
    print(f"\nthreaded collectives at W={BW_WORLD_SIZE} vs memcpy of the bytes that must move (W x n elements)")
    print(f"{'bytes':>10} {'collective':<24} {'ms/call':>10} {'memcpy ms':>10} {'ratio':>8}")
    for r in results["bandwidth"]:
        print(
            f"{r['bytes']:>10} {r['collective']:<24} {r['seconds'] * 1e3:>10.3f} "
            f"{r['memcpy_all_ranks_seconds'] * 1e3:>10.3f} {r['ratio_to_memcpy_all_ranks']:>8.2f}"
        )

    ws_list = [8, 64, 256] if args.quick else [8, 64, 256, 512, 1024]
    print("\nwhole-world runs, the same bodies on both sides (s)")
    results["scale"] = scale(
        ws_list,
        torch_max=min(args.torch_max, 256) if args.quick else args.torch_max,
        cold_only=[] if args.quick else [4096],
    )
    results["rss"] = rss_per_warm_rank(64 if args.quick else 256)
    print(
        f"\nRSS per idle warm rank: {results['rss']['kib_per_idle_warm_rank']:.0f} KiB "
        f"(crew of {results['rss']['world_size']})"
    )
    start = time.perf_counter()
    FakeWorld().run(RunRequest(_ours, 65536, args=("all_gather_into_tensor",)))
    results["fake_65536_seconds"] = time.perf_counter() - start
    print(f"fake world, 65,536 ranks (ranks 0 and 65535 simulated): {results['fake_65536_seconds']:.3f} s")
    results["load_at_end"] = os.getloadavg()
    print(f"load {results['load_at_end']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
