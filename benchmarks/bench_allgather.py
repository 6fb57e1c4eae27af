"""Compaction of a padded allgather (contract D5, D6), measured side by side in one process.

For each layout (per-rank counts over W ranks, the padded buffer W * max(counts) elements) it times,
writing into the same preallocated output:

- ``op``: the native compaction, one call (one kernel launch on CUDA, the C++ op on CPU);
- ``loop``: a Python loop of W slice copies (what code without the op does);
- ``ref``: the pure-torch reference (``torch.cat`` of the W valid slices), the tests' definition;
- grouped layouts (D6) also ``per_tensor``: one native compaction per tensor instead of one for all;
- on CUDA, ``copy``: a plain device-to-device copy of the same number of bytes, so the op's bandwidth
  can be read against what the device's copy engine path achieves.

Prints a table of times and ratios (``x`` > 1 means the op is faster) and writes JSON with --json.

    python benchmarks/bench_allgather.py --device cpu --json bench-cpu.json
    python benchmarks/bench_allgather.py --device cuda --json bench-cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

try:
    import impl.ops as ops
except ImportError:  # run from a checkout without installing: the repository root holds impl/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import impl.ops as ops


@dataclass(frozen=True)
class Layout:
    name: str
    counts_list: tuple[tuple[int, ...], ...]  # one tuple per tensor, one count per rank
    dtype: torch.dtype = torch.float32

    @property
    def world(self) -> int:
        return len(self.counts_list[0])

    @property
    def shard_sizes(self) -> list[int]:
        return [max(c) for c in self.counts_list]

    @property
    def total(self) -> int:
        return sum(sum(c) for c in self.counts_list)


@dataclass
class Row:
    layout: str
    world: int
    tensors: int
    dtype: str
    total_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)  # median seconds per call, by method
    ratios: dict[str, float] = field(default_factory=dict)  # method time / op time
    op_gbps: float | None = None  # bytes read + written per second by the op
    copy_gbps: float | None = None


def _uneven(world: int, mean: int, spread: float, zeros: int = 0) -> tuple[int, ...]:
    """Deterministic uneven counts around `mean`, the last `zeros` ranks empty."""
    counts = [max(0, int(mean * (1 + spread * (((r * 7919) % 17) / 8 - 1)))) for r in range(world)]
    for r in range(world - zeros, world):
        counts[r] = 0
    return tuple(counts)


def layouts(device: str) -> list[Layout]:
    big = 4 if device == "cuda" else 1  # GPU layouts 4x larger: bandwidth needs bytes
    return [
        Layout("tiny W8", (_uneven(8, 100, 0.5),)),
        Layout("uniform 4 MiB W8", ((131_072,) * 8,)),
        Layout("uneven 4 MiB W8", (_uneven(8, 131_072, 0.3),)),
        Layout("uneven 16 MiB W4 bf16", (_uneven(4, big * 2_097_152, 0.2),), torch.bfloat16),
        Layout("half empty W16", (_uneven(16, big * 65_536, 0.4, zeros=8),)),
        Layout("odd sizes W7 uint8", (_uneven(7, big * 1_000_003, 0.3),), torch.uint8),
        Layout("many ranks W128", (_uneven(128, big * 4_096, 0.5),)),
        Layout("grouped 32 tensors W8", tuple(_uneven(8, 512 + 97 * t, 0.5) for t in range(32))),
    ]


def _time_cpu(fn: Callable[[], object], budget: float) -> float:
    fn()  # warm up
    samples: list[float] = []
    deadline = time.perf_counter() + budget
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 1000):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_cuda(fn: Callable[[], object], budget: float) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    # Calibrate the batch so per-call launch latency is amortised but the budget holds.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    batch = max(1, min(200, int(budget / 5 / once)))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(samples)


def bench_layout(layout: Layout, device: str, budget: float) -> Row:
    sizes = layout.shard_sizes
    world = layout.world
    row_len = sum(sizes)
    padded = torch.randint(0, 100, (world * row_len,), device=device).to(layout.dtype)
    out = torch.empty(layout.total, dtype=layout.dtype, device=device)
    flat_counts = [c for counts in layout.counts_list for c in counts]
    counts_list = [list(c) for c in layout.counts_list]

    # Plain slice list: (src offset, dst offset, length) in the order of the output.
    slices = []
    columns = [sum(sizes[:t]) for t in range(len(sizes))]
    dst = 0
    for counts, col in zip(layout.counts_list, columns, strict=True):
        for r, c in enumerate(counts):
            slices.append((r * row_len + col, dst, c))
            dst += c

    def op() -> None:
        torch.ops.dstest_impl.compact_grouped_out(padded, flat_counts, sizes, out)

    def loop() -> None:
        for src, dst, n in slices:
            out[dst : dst + n].copy_(padded[src : src + n])

    def ref() -> None:
        ops.compact_grouped(padded, counts_list, sizes, out=out, impl="reference")

    methods: dict[str, Callable[[], None]] = {"op": op, "loop": loop, "ref": ref}
    if len(layout.counts_list) > 1:
        # One compaction per tensor, each over its own padded buffer: what D6 avoids.
        per = [
            (torch.empty(world * p, dtype=layout.dtype, device=device), list(c), p, out.narrow(0, o, sum(c)))
            for c, p, o in zip(
                layout.counts_list,
                sizes,
                [sum(sum(c) for c in layout.counts_list[:t]) for t in range(len(sizes))],
                strict=True,
            )
        ]

        def per_tensor() -> None:
            for buf, c, p, o in per:
                torch.ops.dstest_impl.compact_grouped_out(buf, c, [p], o)

        methods["per_tensor"] = per_tensor
    if device == "cuda":
        src_copy = padded[: layout.total]

        def copy() -> None:
            out.copy_(src_copy)

        methods["copy"] = copy

    # Correctness first: a benchmark of a wrong result is worthless.
    op()
    want = torch.cat(ops.compact_grouped_reference(padded, counts_list, sizes))
    if not torch.equal(out, want):
        raise AssertionError(f"{layout.name}: the native op differs from the reference")

    timer = _time_cuda if device == "cuda" else _time_cpu
    element = padded.element_size()
    result = Row(
        layout=layout.name,
        world=world,
        tensors=len(layout.counts_list),
        dtype=str(layout.dtype).removeprefix("torch."),
        total_bytes=layout.total * element,
    )
    for name, fn in methods.items():
        result.seconds[name] = timer(fn, budget)
    result.ratios = {k: v / result.seconds["op"] for k, v in result.seconds.items() if k != "op"}
    if device == "cuda":
        moved = 2 * result.total_bytes  # read + write
        result.op_gbps = moved / result.seconds["op"] / 1e9
        result.copy_gbps = moved / result.seconds["copy"] / 1e9
    return result


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f}us" if seconds < 1e-2 else f"{seconds * 1e3:9.2f}ms"


def print_table(rows: list[Row], device: str) -> None:
    methods = ["op", "loop", "ref", "per_tensor"] + (["copy"] if device == "cuda" else [])
    head = f"{'layout':<24}{'W':>4}{'T':>4}{'MiB':>8} " + "".join(f"{m:>12}" for m in methods)
    head += f"{'loop/op':>9}{'ref/op':>8}{'tens/op':>8}"
    if device == "cuda":
        head += f"{'op GB/s':>9}{'copy GB/s':>10}{'op/copy':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r.layout:<24}{r.world:>4}{r.tensors:>4}{r.total_bytes / 2**20:>8.2f} "
        line += "".join(f"{_fmt_time(r.seconds[m]) if m in r.seconds else '-':>12}" for m in methods)
        line += f"{r.ratios['loop']:>8.1f}x{r.ratios['ref']:>7.1f}x"
        line += f"{r.ratios['per_tensor']:>7.1f}x" if "per_tensor" in r.ratios else f"{'-':>8}"
        if r.op_gbps is not None and r.copy_gbps is not None:
            line += f"{r.op_gbps:>9.0f}{r.copy_gbps:>10.0f}{r.op_gbps / r.copy_gbps:>7.0%} "
        print(line)
    print("ratios: method time / op time (> 1: the op is faster)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds of timing per method and layout")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the CPU run")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    built = time.perf_counter()
    info = ops.load_extension()
    print(f"extension: {info.library} (cuda={info.with_cuda}, load {time.perf_counter() - built:.1f} s)")

    rows = [bench_layout(layout, args.device, args.budget) for layout in layouts(args.device)]
    print_table(rows, args.device)
    if args.json is not None:
        meta = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
