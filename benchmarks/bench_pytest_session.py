"""Per test as users run it: one pytest session of many trivial tests, read from its JUnit times.

    python benchmarks/bench_pytest_session.py [--tests 100] [--sizes 2,4,8] [--json PATH]

One generated test module holds, side by side in one session and interleaved in file order:

- ``plain``:  ``def test(): pass``, what pytest itself costs per test (collection excluded);
- ``dstest``: a ``@dstest.spec`` whose body is one 4-element ``all_reduce`` (threaded world, warm crew);
- ``torch``:  the same body on torch's threaded group, started and ended per test as
  ``MultiThreadedTestCase`` does (``_torch_threaded.py``; the class itself needs ``expecttest``);
- ``world``:  the same body through ``ThreadedWorld.run`` called from a plain test (the world's share of
  the ``dstest`` figure: rendezvous, rank threads, body).

Each test's time is what pytest's reports carry (setup + call + teardown ``duration``, as JUnit's
``time`` sums them, unrounded), collected by a conftest of the generated directory. Medians per kind and
world size; the ratios within the one session are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

MODULE = '''
import sys
sys.path.insert(0, {here!r})
import pytest
import torch
import torch.distributed as dist
import dstest
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from _torch_threaded import run_torch_threaded

SIZES = {sizes!r}
_WORLD = ThreadedWorld(warm=True)


def _body(ctx):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size


def _torch_body(rank, world_size):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world_size
'''

TESTS = '''

def test_plain_{i}():
    pass


@dstest.spec(world_size=SIZES)
def test_dstest_{i}(ctx):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size


@pytest.mark.parametrize("ws", SIZES)
def test_torch_{i}(ws):
    run_torch_threaded(_torch_body, ws)


@pytest.mark.parametrize("ws", SIZES)
def test_world_{i}(ws):
    _WORLD.run(RunRequest(_body, ws))
'''


CONFTEST = '''
import json
TIMES = {{}}

def pytest_runtest_logreport(report):
    TIMES[report.nodeid] = TIMES.get(report.nodeid, 0.0) + report.duration

def pytest_sessionfinish(session):
    with open({out!r}, "w") as f:
        json.dump(TIMES, f)
'''


def _kind_and_size(name: str) -> tuple[str, int | None]:
    kind = name.split("_")[1]
    if "[" not in name:
        return kind, None
    param = name[name.index("[") + 1 : -1]
    return kind, int(param.rsplit("ws", 1)[-1]) if "ws" in param else int(param)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=100, help="tests of each kind (default 100)")
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="dstest-bench-session-") as d:
        path = Path(d) / "test_many.py"
        path.write_text(MODULE.format(here=str(HERE), sizes=sizes) + "".join(TESTS.format(i=i) for i in range(args.tests)))
        out = Path(d) / "times.json"
        (Path(d) / "conftest.py").write_text(CONFTEST.format(out=str(out)))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--dstest-worlds=threaded", str(path)]
        env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning")
        proc = subprocess.run(cmd, cwd=d, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"pytest failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        times: dict[tuple[str, int | None], list[float]] = {}
        for nodeid, seconds in json.loads(out.read_text()).items():
            times.setdefault(_kind_and_size(nodeid.rpartition("::")[2]), []).append(seconds)
    med = {key: statistics.median(v) for key, v in times.items()}
    plain = med[("plain", None)]
    rows = []
    print(f"per test inside one pytest session ({args.tests} tests of each kind), median ms (setup+call+teardown)")
    print(f"pytest's own cost per test (plain test): {plain * 1e3:.3f} ms")
    print(f"{'W':>3} {'dstest':>8} {'torch':>8} {'torch/dstest':>13} {'world.run':>10} {'plugin+fixtures':>16}")
    for ws in sizes:
        ours, theirs, world = med[("dstest", ws)], med[("torch", ws)], med[("world", ws)]
        row = {"world_size": ws, "dstest_s": ours, "torch_s": theirs, "ratio_torch_to_dstest": theirs / ours,
               "world_run_s": world, "pytest_plain_s": plain,
               # a spec item is a plain item plus the plugin's part plus one world run
               "plugin_and_fixtures_s": ours - world}
        rows.append(row)
        print(f"{ws:>3} {ours * 1e3:>8.3f} {theirs * 1e3:>8.3f} {theirs / ours:>12.2f}x {world * 1e3:>10.3f} "
              f"{(ours - world) * 1e3:>16.3f}")
    report = {"benchmark": "pytest_session", "tests_per_kind": args.tests, "pytest_plain_s": plain, "rows": rows,
              "load": os.getloadavg()}
    print(f"load average {os.getloadavg()}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
