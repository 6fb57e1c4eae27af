"""The cost of ``ctx.assert_replicas`` (G4) against one all_reduce of the same bytes, and against an older version.

    python benchmarks/bench_replicas.py [--params N] [--world threaded|process] [--size W] [--reps R]
                                        [--baseline REV]

Side by side in one run, interleaved on every rank: ``assert_replicas`` of a model of about N parameters
(an MLP of square Linear layers, fp32; identical on every rank, so the check passes: digests only),
and one ``all_reduce`` of a flat fp32 tensor of the same element count (what DDP moves per step). Also the
failing case: one element of one parameter changed on rank 1 (digests, then that parameter's values
gathered, compared and reported). Medians of R interleaved repetitions, wall seconds, per rank 0.

``--baseline REV`` also times the replica check as it was at git revision REV (``git show REV:...`` into a
temporary folder, imported beside the current one: the module ``dstest/replicas.py``, or since issue 41 the
package ``dstest/replicas/``), interleaved with the current one on the same model and world: the before and
after of a change, in one run, under the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import dstest
from dstest.errors import ReplicasDiverge

ROOT = Path(__file__).resolve().parent.parent


def _model(params: int) -> nn.Module:
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


_LOADING = threading.Lock()
#: The name the older replica check is imported under.
_BASELINE = "_replicas_baseline"


def _baseline(path: str) -> Callable[..., None]:
    """``assert_replicas`` of the replica check at ``path`` (a module file, or a package folder: see
    :func:`_old_module`), imported under a name of its own so that it stands beside the current one (once per
    process: the threaded world's ranks share it)."""
    name = _BASELINE
    with _LOADING:
        if name not in sys.modules:
            folder = Path(path)
            if folder.is_dir():
                spec = importlib.util.spec_from_file_location(
                    name, folder / "__init__.py", submodule_search_locations=[str(folder)]
                )
            else:
                spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while the file runs
            spec.loader.exec_module(module)
    check: Callable[..., None] = sys.modules[name].assert_replicas
    return check


def _timed(check: Callable[..., None], *args: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    try:
        check(*args)
    except ReplicasDiverge:
        pass
    return time.perf_counter() - start


def measure(ctx: Any, params: int, reps: int, baseline: str | None) -> dict[str, float]:
    model = _model(params)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.ones(numel)
    checks: dict[str, Callable[..., None]] = {"": ctx.assert_replicas}
    if baseline is not None:
        checks[" (baseline)"] = _baseline(baseline)
    times: dict[str, list[float]] = {}
    last = list(model.parameters())[-2]
    for _ in range(reps):
        for suffix, check in checks.items():
            times.setdefault(f"assert_replicas{suffix}", []).append(_timed(check, model))
        times.setdefault("all_reduce", []).append(_timed(dist.all_reduce, flat))
        kept = last[0, 0].clone()  # restored bit for bit after (x + 1 - 1 is not x)
        with torch.no_grad():
            if ctx.rank == 1:
                last[0, 0] += 1.0
        for suffix, check in checks.items():
            name = f"assert_replicas{suffix}, one differs"
            times.setdefault(name, []).append(_timed(check, model))
        with torch.no_grad():
            if ctx.rank == 1:
                last[0, 0] = kept
    out = {k: statistics.median(v) for k, v in times.items()}
    out["numel"] = float(numel)
    return out


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _old_module(rev: str, folder: str) -> str:
    """The replica check at git revision ``rev``, written into ``folder``; its path. A package (``dstest/replicas/``,
    since issue 41) is written as a package of its own, its modules' imports of each other pointed at the copy."""
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "dstest/replicas/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not listed:  # one module before issue 41
        path = Path(folder) / "replicas_baseline.py"
        path.write_text(_git_show(rev, "dstest/replicas.py"))
        return str(path)
    package = Path(folder) / _BASELINE
    package.mkdir()
    for name in listed:
        if name.endswith(".py"):
            source = _git_show(rev, name).replace("dstest.replicas.", f"{_BASELINE}.")
            (package / Path(name).name).write_text(source)
    return str(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--world", default="threaded", choices=["threaded", "process"])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", default=None, metavar="REV", help="also time the replica check at REV")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        baseline = None if args.baseline is None else _old_module(args.baseline, folder)
        result = dstest.run(measure, args.size, world=args.world, args=(args.params, args.reps, baseline), timeout=600)[
            0
        ]
    numel = int(result.pop("numel"))
    print(
        f"{args.world} world, W = {args.size}, {numel:,} fp32 parameters ({numel * 4 / 2**20:.0f} MiB), "
        f"medians of {args.reps}" + (f", baseline {args.baseline}" if args.baseline else "") + ":"
    )
    base = result["all_reduce"]
    for name, seconds in result.items():
        print(f"  {name:40s} {seconds * 1e3:9.1f} ms   x{seconds / base:.2f} of one all_reduce")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
