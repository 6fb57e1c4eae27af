"""Cost of the process world's cross-rank check, per collective, against unchecked gloo.

    python benchmarks/bench_checking.py [--quick] [--json PATH]

Inside one warm gloo pool, each rank times the same calls on the same tensors, interleaved, through
(a) the world group, which dstest checks (the ranks' calls are matched on the pool's check board, or by the
parent's referee, before gloo runs them), and (b) a plain gloo group over the same ranks, built with the
group constructor the check wraps. The figure is their ratio (checked / unchecked; lower is better). Then
the check board against the referee-only check it replaced (issue 44 item 4), interleaved the same way. For
comparison, torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapper (ProcessGroupWrapper: a monitored
barrier and a fingerprint all-gather on a helper gloo group before each call) is timed the same way at
the backend level, against the gloo backend it wraps. Last, how long a run takes to report a shape
mismatch on every rank, against a correct run of the same size (detection latency).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from dstest.errors import RankFailure
from dstest.worlds.process import ProcessWorld, shutdown_all
from dstest.worlds.request import RunRequest

WORLD = ProcessWorld()


def _plain_gloo_group(world_size: int) -> Any:
    """A gloo group the check does not wrap (the worker's group constructor, unwrapped, for this call)."""
    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    c10d._new_process_group_helper = getattr(helper, "unchecked", helper)
    try:
        return dist.new_group(list(range(world_size)), backend="gloo")
    finally:
        c10d._new_process_group_helper = helper


def _calls(kind: str, n: int, w: int, group: Any) -> Any:
    if kind == "all_reduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, src=0, group=group)
    inp, out = torch.ones(n), torch.empty(n * w)
    return lambda: dist.all_gather_into_tensor(out, inp, group=group)


def _time(call: Any, reps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def _compare(ctx: Any, kinds: list[str], sizes: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    """On every rank: checked (world group) against plain gloo, same calls, same data, interleaved."""
    w = ctx.world_size
    plain = _plain_gloo_group(w)
    rows = []
    for kind in kinds:
        for n in sizes:
            checked_call, plain_call = _calls(kind, n, w, None), _calls(kind, n, w, plain)
            checked_call(), plain_call()  # warm both
            checked, unchecked = [], []
            for _ in range(rounds):
                checked.append(_time(checked_call, reps))
                unchecked.append(_time(plain_call, reps))
            c, u = statistics.median(checked), statistics.median(unchecked)
            rows.append({"collective": kind, "bytes": 4 * n, "checked_s": c, "unchecked_s": u, "ratio": c / u})
    return rows


def _board_vs_referee(ctx: Any, sizes: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    """The check board (issue 44 item 4) against the referee-only check it replaced, on every rank, same calls,
    same data, interleaved: between barriers, every rank turns its board off (each call then goes to the
    parent's referee and waits for its verdict, as before the board) and on again."""
    from dstest.worlds.process import checked

    ck = checked._CHECKER
    if ck is None or not ck.board_on:
        return []
    rows = []
    for n in sizes:
        call = _calls("all_reduce", n, ctx.world_size, None)
        call()
        board, referee = [], []
        for _ in range(rounds):
            board.append(_time(call, reps))
            dist.barrier()
            ck.board_on = False
            try:
                referee.append(_time(call, reps))
                dist.barrier()
            finally:
                ck.board_on = True
        b, r = statistics.median(board), statistics.median(referee)
        rows.append({"collective": "all_reduce", "bytes": 4 * n, "board_s": b, "referee_s": r, "ratio": b / r})
    return rows


def _detail_wrapper(ctx: Any, sizes: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    """torch's DETAIL ProcessGroupWrapper around a gloo backend, against that backend alone (all_reduce)."""
    from torch._C import _distributed_c10d as c10d_c
    from torch.distributed import distributed_c10d as c10d

    w = ctx.world_size
    timeout = datetime.timedelta(seconds=600)
    store = c10d._world.pg_map[c10d._get_default_group()][1]
    inner: Any = c10d_c.ProcessGroupGloo(c10d_c.PrefixStore("bench-inner/", store), ctx.rank, w, timeout)
    wrapped = c10d._create_process_group_wrapper(inner, "bench-wrap", store, ctx.rank, w, timeout)
    rows = []
    for n in sizes:
        t = torch.ones(n)
        opts = c10d_c.AllreduceOptions()

        def plain_call(t: torch.Tensor = t, opts: Any = opts) -> None:
            inner.allreduce([t], opts).wait()

        def wrapped_call(t: torch.Tensor = t, opts: Any = opts) -> None:
            wrapped.allreduce([t], opts).wait()

        plain_call()
        wrapped_call()
        a, b = [], []
        for _ in range(rounds):
            a.append(_time(wrapped_call, reps))
            b.append(_time(plain_call, reps))
        c, u = statistics.median(a), statistics.median(b)
        rows.append({"collective": "all_reduce", "bytes": 4 * n, "detail_s": c, "gloo_s": u, "ratio": c / u})
    return rows


def _correct(ctx: Any) -> None:
    dist.all_reduce(torch.ones(4))


def _mismatch(ctx: Any) -> None:
    dist.all_reduce(torch.ones(4 if ctx.rank == 0 else 8))


def _latency(world_size: int, reps: int) -> dict[str, Any]:
    correct, mismatch = [], []
    for _ in range(reps):
        start = time.perf_counter()
        WORLD.run(RunRequest(_correct, world_size))
        correct.append(time.perf_counter() - start)
        start = time.perf_counter()
        try:
            WORLD.run(RunRequest(_mismatch, world_size))
        except RankFailure:
            pass
        else:
            raise AssertionError("the mismatch was not reported")
        mismatch.append(time.perf_counter() - start)
    c, m = statistics.median(correct), statistics.median(mismatch)
    return {"world_size": world_size, "correct_run_s": c, "mismatch_run_s": m, "ratio": m / c}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (CI smoke run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [1, 16384] if args.quick else [1, 1024, 16384, 262144, 1048576]
    kinds = ["all_reduce", "broadcast", "all_gather_into_tensor"]
    reps, rounds = (20, 3) if args.quick else (100, 5)
    world_sizes = [2] if args.quick else [2, 4]
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "checking": [],
        "board": [],
        "detail_wrapper": [],
        "latency": [],
    }
    try:
        for ws in world_sizes:
            per_rank = WORLD.run(RunRequest(_compare, ws, args=(kinds, sizes, reps, rounds), timeout=1800))
            for i in range(len(per_rank[0])):
                worst = max(per_rank, key=lambda rows: rows[i]["checked_s"])[i]  # a collective ends on its slowest rank
                results["checking"].append({"world_size": ws, **worst})
            per_rank = WORLD.run(RunRequest(_board_vs_referee, ws, args=(sizes[:2], reps, rounds), timeout=1800))
            for i in range(len(per_rank[0])):
                worst = max(per_rank, key=lambda rows: rows[i]["board_s"])[i]
                results["board"].append({"world_size": ws, **worst})
            per_rank = WORLD.run(RunRequest(_detail_wrapper, ws, args=(sizes, reps, rounds), timeout=1800))
            for i in range(len(per_rank[0])):
                worst = max(per_rank, key=lambda rows: rows[i]["detail_s"])[i]
                results["detail_wrapper"].append({"world_size": ws, **worst})
            results["latency"].append(_latency(ws, 3 if args.quick else 10))
    finally:
        shutdown_all()
    print("checked collective vs unchecked gloo, same calls and data, per call (lower ratio is better)")
    print(f"{'W':>3} {'collective':<24} {'bytes':>9} {'checked us':>11} {'gloo us':>9} {'ratio':>7}")
    for r in results["checking"]:
        print(
            f"{r['world_size']:>3} {r['collective']:<24} {r['bytes']:>9} {r['checked_s'] * 1e6:>11.1f} "
            f"{r['unchecked_s'] * 1e6:>9.1f} {r['ratio']:>7.2f}"
        )
    print("\nthe check board vs the referee-only check, same calls and data, per call (lower ratio is better)")
    print(f"{'W':>3} {'bytes':>9} {'board us':>9} {'referee us':>11} {'ratio':>7}")
    for r in results["board"]:
        print(
            f"{r['world_size']:>3} {r['bytes']:>9} {r['board_s'] * 1e6:>9.1f} {r['referee_s'] * 1e6:>11.1f} {r['ratio']:>7.2f}"
        )
    print("\ntorch TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper vs the gloo backend it wraps (all_reduce)")
    print(f"{'W':>3} {'bytes':>9} {'DETAIL us':>10} {'gloo us':>9} {'ratio':>7}")
    for r in results["detail_wrapper"]:
        print(
            f"{r['world_size']:>3} {r['bytes']:>9} {r['detail_s'] * 1e6:>10.1f} {r['gloo_s'] * 1e6:>9.1f} {r['ratio']:>7.2f}"
        )
    print("\nwhole run: a shape mismatch reported on every rank vs a correct run (one all_reduce)")
    for r in results["latency"]:
        print(
            f"W={r['world_size']}: mismatch {r['mismatch_run_s'] * 1e3:.1f} ms, correct {r['correct_run_s'] * 1e3:.1f} ms, "
            f"ratio {r['ratio']:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
