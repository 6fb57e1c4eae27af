"""Threaded world: small-collective latency, large-collective bandwidth, scale; each against a baseline
running the same calls on the same data in the same process.

    python benchmarks/bench_threaded.py [--quick] [--torch-max 512] [--json PATH]

- hand-off:  a bare ``threading.Event`` / ``Condition`` hand-off between two threads (one way), the unit
  the small collectives are reported in;
- small:     1 KiB all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and send/recv at
  W = 2, 4, 8, per call inside one run, dstest's warm world against torch's threaded group (which has no
  send/recv);
- large:     1 KiB - 64 MiB at W = 4 against a ``copy_`` of the bytes that must move (W outputs of an
  all_gather, the W inputs a reduce-scatter or all_reduce reads);
- scale:     whole-world runs of the same bodies on both sides (list ``all_gather`` of one-element
  tensors + ``all_reduce``; ``all_gather_into_tensor`` + ``all_reduce``), dstest cold and warm against
  torch's threaded group, and the floor of the list body: W^2 small copies in one thread;
- RSS per idle warm rank.
"""

from __future__ import annotations

import argparse
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


# -- per-call loops, the same on both sides ----------------------------------------------------------
def _call(kind: str, nbytes: int, rank: int, w: int) -> Any:
    n = max(1, nbytes // 4)
    if kind == "all_reduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t)
    if kind == "all_gather_into_tensor":
        inp, out = torch.ones(n // w or 1), torch.empty((n // w or 1) * w)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind == "reduce_scatter_tensor":
        inp, out = torch.ones((n // w or 1) * w), torch.empty(n // w or 1)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if kind == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, 0)
    t = torch.ones(n)
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...: even ranks send, odd ranks receive
    if peer >= w:
        return lambda: None
    return (lambda: dist.send(t, peer)) if rank % 2 == 0 else (lambda: dist.recv(t, peer))


def _loop(rank: int, w: int, kind: str, nbytes: int, reps: int) -> float:
    call = _call(kind, nbytes, rank, w)
    call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    dist.barrier()
    return (time.perf_counter() - start) / reps


def _dstest_loop(ctx: Any, kind: str, nbytes: int, reps: int) -> float:
    return _loop(ctx.rank, ctx.world_size, kind, nbytes, reps)


def small(sizes: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for w in sizes:
        for kind in SMALL:
            ours, theirs, ev = [], [], []
            for _ in range(rounds):  # interleaved, so both sides see the same load
                ours.append(max(WORLD.run(RunRequest(_dstest_loop, w, args=(kind, 1024, reps), timeout=600))))
                if kind != "send_recv":
                    theirs.append(max(run_torch_threaded(lambda r, ws: _loop(r, ws, kind, 1024, reps), w)))  # noqa: B023
                ev.append(handoff("event", 1000))
            o, e = statistics.median(ours), statistics.median(ev)
            t = statistics.median(theirs) if theirs else None
            rows.append({"world_size": w, "collective": kind, "seconds": o, "torch_seconds": t,
                         "ratio_torch_to_dstest": (t / o) if t else None, "event_handoff_seconds": e,
                         "handoffs": o / e})
    return rows


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
            rows.append({"bytes": nbytes, "collective": kind, "seconds": per_call,
                         "memcpy_all_ranks_seconds": memcpy, "ratio_to_memcpy_all_ranks": per_call / memcpy})
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
            rows.append({"body": body, "world_size": ws, "dstest_cold_seconds": cold, "dstest_warm_seconds": warm,
                         "torch_threaded_seconds": theirs, "w2_copies_floor_seconds": floor,
                         "ratio_torch_to_dstest_cold": (theirs / cold) if theirs else None,
                         "ratio_torch_to_dstest_warm": (theirs / warm) if theirs and warm else None})
            print(f"  {body:<24} {ws:>5} cold {cold:8.3f} s  warm {warm if warm is None else round(warm, 3)}  "
                  f"torch {theirs if theirs is None else round(theirs, 3)}  W^2 floor {floor if floor is None else round(floor, 3)}",
                  flush=True)
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
    before = _rss_kib()
    WORLD.run(RunRequest(_noop, ws))
    after = _rss_kib()
    shutdown_all()
    return {"world_size": ws, "rss_kib_before": before, "rss_kib_after": after,
            "kib_per_idle_warm_rank": (after - before) / ws}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (CI smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--torch-max", type=int, default=512,
                        help="largest world for torch's threaded group (1024 takes minutes)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    results: dict[str, Any] = {"torch": torch.__version__, "load_at_start": os.getloadavg()}
    results["handoff"] = {"event_seconds": handoff("event"), "condition_seconds": handoff("condition")}
    print(f"load {os.getloadavg()}; one-way hand-off between two threads: Event "
          f"{results['handoff']['event_seconds'] * 1e3:.4f} ms, Condition {results['handoff']['condition_seconds'] * 1e3:.4f} ms")

    results["small"] = small([2, 4] if args.quick else [2, 4, 8], reps=100 if args.quick else 300,
                             rounds=1 if args.quick else 3)
    print("\n1 KiB collectives, ms per call inside one run (slowest rank), against torch's threaded group")
    print(f"{'W':>3} {'collective':<24} {'dstest':>8} {'torch':>8} {'torch/dstest':>13} {'Event hand-off':>15} {'x hand-off':>11}")
    for r in results["small"]:
        t, ratio = r["torch_seconds"], r["ratio_torch_to_dstest"]
        theirs = "-" if t is None else f"{t * 1e3:.3f}"
        times = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"{r['world_size']:>3} {r['collective']:<24} {r['seconds'] * 1e3:>8.3f} {theirs:>8} {times:>13} "
              f"{r['event_handoff_seconds'] * 1e3:>15.4f} {r['handoffs']:>10.1f}x")

    sizes = [1 << 10, 1 << 20, 64 << 20] if not args.quick else [1 << 10, 1 << 20]
    results["bandwidth"] = bandwidth(sizes, reps=3 if args.quick else 5)
    print(f"\nthreaded collectives at W={BW_WORLD_SIZE} vs memcpy of the bytes that must move (W x n elements)")
    print(f"{'bytes':>10} {'collective':<24} {'ms/call':>10} {'memcpy ms':>10} {'ratio':>8}")
    for r in results["bandwidth"]:
        print(f"{r['bytes']:>10} {r['collective']:<24} {r['seconds'] * 1e3:>10.3f} "
              f"{r['memcpy_all_ranks_seconds'] * 1e3:>10.3f} {r['ratio_to_memcpy_all_ranks']:>8.2f}")

    ws_list = [8, 64, 256] if args.quick else [8, 64, 256, 512, 1024]
    print("\nwhole-world runs, the same bodies on both sides (s)")
    results["scale"] = scale(ws_list, torch_max=min(args.torch_max, 256) if args.quick else args.torch_max,
                             cold_only=[] if args.quick else [4096])
    results["rss"] = rss_per_warm_rank(64 if args.quick else 256)
    print(f"\nRSS per idle warm rank: {results['rss']['kib_per_idle_warm_rank']:.0f} KiB "
          f"(crew of {results['rss']['world_size']})")
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
