"""torch's and torchtitan's own distributed tests, as upstream runs them and on dstest's plugin, side by side.

    python benchmarks/bench_upstream_suites.py --torch-tests DIR --torchtitan DIR [--python PY] [--rounds 3]
        [--json PATH]

Neither project's tests are in this repository or in torch's wheel: ``--torch-tests`` is a checkout of
pytorch/pytorch (its ``test/`` tree, of the torch the runs use), ``--torchtitan`` one of pytorch/torchtitan
(default: the environment's ``DSTEST_TORCH_TESTS`` and ``DSTEST_TORCHTITAN``). A side whose checkout is not
given is not measured, and says so. ``--python`` (default: the environment's ``DSTEST_UPSTREAM_PYTHON``, else
this Python) runs both sides: one with the torch those test files were written for, dstest and expecttest.
Two questions, the goals of issue 44:

- **torch's bases, one small file, warm** (``test/distributed/test_c10d_object_collectives.py``: 8 items on
  ``MultiProcessTestCase``): upstream (``-p no:dstest``: a fresh spawned process per rank per test) against a
  developer's rerun on the plugin with ``--dstest-warm``: one cold run starts the warm server, then
  ``--rounds`` runs forked from it; the median of those is the figure. Each file from its own directory, as
  torch's ``run_test.py`` runs it.
- **torchtitan's unit tests on torch's bases, one pytest run** (its 9 files that use them, from its checkout's
  root): upstream against one cold run of the plugin (``-p dstest.compat.torch``), the goal's figure; then,
  reported beside it, a developer's reruns as for torch's file (one cold ``--dstest-warm`` run, ``--rounds``
  forked runs, their median). Every run's verdicts count in the comparison.

Each side's verdict per item (from its JUnit XML) is compared: a faster run with other verdicts is not a
figure, and the JSON says how many differ. The sides run one after the other; the load average before each
is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TORCH_FILE = "test/distributed/test_c10d_object_collectives.py"
TITAN_FILES = [
    "tests/unit_tests/flex_shard/test_dist_muon.py",
    "tests/unit_tests/test_dist_gemm.py",
    "tests/unit_tests/test_distributed_linear.py",
    "tests/unit_tests/test_embedding.py",
    "tests/unit_tests/test_fsdp_moe_sharding.py",
    "tests/unit_tests/test_loss.py",
    "tests/unit_tests/test_loss_dtensor.py",
    "tests/unit_tests/test_module.py",
    "tests/unit_tests/test_parallel_dims.py",
]
FORKED = "dstest warm: forked from a warm server"
# Each item's verdict and time read from a JUnit file as ci/torch_upstream.sh's table reads them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
from upstream_compare import verdicts as junit_verdicts  # noqa: E402

PYTHON = [sys.executable]


def _pytest(cwd: Path, args: list[str], junit: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One pytest run; its wall time, exit status, verdicts, the load before it and its output's last lines."""
    load = os.getloadavg()
    # Not -q: a warm run says in its header whether it was forked from the server.
    command = [*PYTHON, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    cases = junit_verdicts(junit)
    slowest = sorted(((t, name) for name, (_, t, _) in cases.items()), reverse=True)[:8]
    return {"seconds": wall, "rc": proc.returncode, "load": load, "verdicts": {k: v for k, (v, _, _) in cases.items()},
            "items_s": sum(t for _, t, _ in cases.values()), "slowest": [[name, t] for t, name in slowest],
            "output": proc.stdout, "tail": proc.stdout.splitlines()[-1:]}  # fmt: skip


def _differ(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for v in run["verdicts"].values():
        counts[v] = counts.get(v, 0) + 1
    keys = ("seconds", "rc", "load", "tail", "items_s", "slowest")
    return {"counts": counts} | {k: run[k] for k in keys}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSTEST_WARM"))}
    env.update(extra)
    return env


def _warm_runs(
    cwd: Path, args: list[str], work: Path, tag: str, rounds: int, timeout: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """With ``--dstest-warm``: one cold run (it starts the warm server), then ``rounds`` runs forked from it."""
    warm_dir = Path(tempfile.mkdtemp(prefix="warm-", dir=work))
    os.chmod(warm_dir, 0o700)
    env = _env(DSTEST_WARM_DIR=str(warm_dir))
    plugin = ["-p", "dstest.compat.torch", "--dstest-warm", *args]
    try:
        cold = _pytest(cwd, plugin, work / f"{tag}-cold.xml", env, timeout)
        deadline = time.monotonic() + 300
        while not list(warm_dir.glob("*.sock")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # the socket is there once the server has imported; a pause for the cold run's leftovers
        warm = [_pytest(cwd, plugin, work / f"{tag}-warm{i}.xml", env, timeout) for i in range(rounds)]
    finally:
        subprocess.run([*PYTHON, "-m", "dstest.pytest.warm", "--stop"], env=env, capture_output=True, timeout=60)
    return cold, warm


def torch_small_file(root: Path, rounds: int, work: Path) -> dict[str, Any]:
    path = root / TORCH_FILE
    if not path.is_file():
        return {"measured": False, "why": f"{path} is not there"}
    cwd, name = path.parent, path.name
    upstream = _pytest(cwd, ["-p", "no:dstest", name], work / "torch-upstream.xml", _env(), 1800)
    cold, warm = _warm_runs(cwd, [name], work, "torch", rounds, 900)
    forked = sum(FORKED in w["output"] for w in warm)
    median = statistics.median(w["seconds"] for w in warm)
    differ = sorted({k for run in (cold, *warm) for k in _differ(upstream["verdicts"], run["verdicts"])})
    return {
        "measured": True, "file": TORCH_FILE, "items": len(upstream["verdicts"]),
        "upstream": _summary(upstream), "cold": _summary(cold), "warm": [_summary(w) for w in warm],
        "warm_forked": forked, "warm_median_s": median, "ratio_upstream_to_warm": upstream["seconds"] / median,
        "differ": differ,
    }  # fmt: skip


def torchtitan_files(root: Path, rounds: int, work: Path) -> dict[str, Any]:
    """One cold run on the plugin (the goal's figure), then, as a developer rerunning the files does, a cold
    and ``rounds`` warm runs with ``--dstest-warm`` (reported beside it)."""
    missing = [f for f in TITAN_FILES if not (root / f).is_file()]
    if missing:
        return {"measured": False, "why": f"not in {root}: {', '.join(missing)}"}
    upstream = _pytest(root, ["-p", "no:dstest", *TITAN_FILES], work / "titan-upstream.xml", _env(), 3600)
    plugin = _pytest(root, ["-p", "dstest.compat.torch", *TITAN_FILES], work / "titan-plugin.xml", _env(), 3600)
    cold, warm = _warm_runs(root, TITAN_FILES, work, "titan", rounds, 3600)
    median = statistics.median(w["seconds"] for w in warm)
    differ = sorted({k for run in (plugin, cold, *warm) for k in _differ(upstream["verdicts"], run["verdicts"])})
    return {
        "measured": True, "files": TITAN_FILES, "items": len(upstream["verdicts"]),
        "upstream": _summary(upstream), "plugin": _summary(plugin),
        "ratio_upstream_to_plugin": upstream["seconds"] / plugin["seconds"],
        "warm_cold": _summary(cold), "warm": [_summary(w) for w in warm],
        "warm_forked": sum(FORKED in w["output"] for w in warm), "warm_median_s": median,
        "ratio_upstream_to_warm": upstream["seconds"] / median,
        "differ": differ,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-tests", type=Path, default=os.environ.get("DSTEST_TORCH_TESTS"))
    parser.add_argument("--torchtitan", type=Path, default=os.environ.get("DSTEST_TORCHTITAN"))
    parser.add_argument("--python", default=os.environ.get("DSTEST_UPSTREAM_PYTHON", sys.executable))
    parser.add_argument("--rounds", type=int, default=3, help="warm runs of each side (the median counts)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    PYTHON[:] = [args.python]
    report: dict[str, Any] = {"load_at_start": os.getloadavg(), "python": args.python}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dstest-upstream-")))
        if args.torch_tests is None:
            report["torch"] = {"measured": False, "why": "no checkout of torch's tests (--torch-tests)"}
        else:
            report["torch"] = torch_small_file(args.torch_tests.resolve(), args.rounds, work)
        if args.torchtitan is None:
            report["torchtitan"] = {"measured": False, "why": "no checkout of torchtitan (--torchtitan)"}
        else:
            report["torchtitan"] = torchtitan_files(args.torchtitan.resolve(), args.rounds, work)
    for key in ("torch", "torchtitan"):
        r = report[key]
        if not r["measured"]:
            print(f"{key}: not measured: {r['why']}")
        elif key == "torch":
            print(f"torch {r['file']} ({r['items']} items): upstream {r['upstream']['seconds']:.1f} s, cold "
                  f"{r['cold']['seconds']:.1f} s, warm median {r['warm_median_s']:.1f} s "
                  f"({r['warm_forked']}/{len(r['warm'])} forked): {r['ratio_upstream_to_warm']:.1f}x; "
                  f"verdicts differ: {len(r['differ'])}")  # fmt: skip
        else:
            print(f"torchtitan {len(r['files'])} files ({r['items']} items): upstream {r['upstream']['seconds']:.1f} "
                  f"s, plugin {r['plugin']['seconds']:.1f} s: {r['ratio_upstream_to_plugin']:.1f}x; with --dstest-warm "
                  f"cold {r['warm_cold']['seconds']:.1f} s, warm median {r['warm_median_s']:.1f} s "
                  f"({r['warm_forked']}/{len(r['warm'])} forked): {r['ratio_upstream_to_warm']:.1f}x; verdicts differ: "
                  f"{len(r['differ'])}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
