"""The launched world: pytest under torchrun, every rank one launched process, rank 0 reporting.

Each test runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m pytest ...`` on small
spec files written into ``tmp_path`` (gloo on CPU) and asserts on what rank 0 printed and wrote to its
JUnit file. The child runs are bounded by ``timeout=`` so that a regression that hangs fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

_SPECS = '''
import os, time
import torch, torch.distributed as dist
import dstest

RANK = int(os.environ["RANK"])


@dstest.spec(world_size=[1, 2, 3, 4], worlds=["launched"])
def test_sum(ctx):
    t = torch.ones(2) * (ctx.rank + 1)
    dist.all_reduce(t)
    assert dist.get_world_size() == ctx.world_size
    assert t.tolist() == [sum(range(1, ctx.world_size + 1))] * 2
    print(f"sum ran on launched rank {RANK} as rank {ctx.rank} of {ctx.world_size}")


@dstest.spec(world_size=[2], worlds=["launched"])
def test_rank_one_fails(ctx):
    t = torch.ones(1)
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(t)


@dstest.cpu_test
def test_plain_fails_on_rank_one():
    print(f"plain test on rank {RANK}")
    assert RANK != 1, f"plain failure on rank {RANK}"


@dstest.cpu_test
def test_plain_passes():
    assert RANK >= 0
'''.replace("@dstest.cpu_test", "@pytest.mark.cpu").replace("import dstest", "import dstest, pytest")

# The specs that wait out a timeout (about 25 s of a launch): run in the 3-rank launch only, where rank 2 is
# outside the 2-rank runs as well.
_WAITING_SPECS = '''
import os, time
import pytest
import torch, torch.distributed as dist
import dstest

RANK = int(os.environ["RANK"])


@dstest.spec(world_size=[2], worlds=["launched"], timeout=5)
def test_rank_one_hangs(ctx):
    if ctx.rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


@dstest.spec(world_size=[2], worlds=["launched"])
def test_after_the_hang(ctx):
    t = torch.full((1,), float(ctx.rank))
    dist.all_reduce(t)
    assert t.item() == 1.0


@pytest.fixture(autouse=True)
def _rank_one_slow_to_form(request, monkeypatch):
    if RANK == 1 and "late" in request.node.name:
        real = dist.init_process_group

        def slow(*args, **kwargs):
            time.sleep(4)  # a slow connect on a busy machine: rank 0 is already forming the run's group
            return real(*args, **kwargs)

        monkeypatch.setattr(dist, "init_process_group", slow)
    yield


@dstest.spec(world_size=[2], worlds=["launched"], timeout=2)
def test_a_late_rank_is_waited_for(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


@pytest.mark.cpu
def test_zz_main_thread_hangs_on_rank_one():
    if RANK == 1:
        time.sleep(3600)
'''

_DIVERGENT = '''
import os
import pytest

@pytest.mark.cpu
def test_everywhere():
    pass

if os.environ["RANK"] == "1":
    @pytest.mark.cpu
    def test_only_on_rank_one():
        pass
'''


def _launch(tmp_path: Path, nproc: int, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "DSTEST_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "pytest", "-m", "cpu", "-q", "-rA",
        "-p", "no:hypothesispytest",  # it imports all of hypothesis at each rank's end (1.3 s); nothing uses it
        *args,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _cases(junit: Path) -> dict[str, ET.Element]:
    root = ET.parse(junit).getroot()
    return {f"{case.get('name')}": case for case in root.iter("testcase")}


@pytest.mark.parametrize("nproc", [2, 3])
def test_launched_ranks_run_in_lockstep_and_rank_0_reports(tmp_path: Path, nproc: int) -> None:
    (tmp_path / "test_specs.py").write_text(_SPECS)
    waits = nproc == 3  # the specs that wait out a timeout: once, in the launch with a rank outside the runs
    if waits:
        (tmp_path / "test_waiting.py").write_text(_WAITING_SPECS)
    junit = tmp_path / "out.xml"
    # 15 s: every spec's timeout too, with room for a launched group to form on 2 busy cores (CI, -n 2)
    proc, took = _launch(tmp_path, nproc, "--dstest-timeout=15", f"--junitxml={junit}")
    out = proc.stdout
    assert proc.returncode != 0, out
    assert took < 200, f"the launched run took {took:.0f} s"  # a hang would be an hour (time.sleep(3600))
    # One reporter: rank 0's summary only, even though every rank ran every item.
    assert out.count("short test summary info") == 1, out
    cases = _cases(junit)
    # ws1 and (with 3 ranks) ws2 run on the first ranks; sizes above the launch are skipped with the reason.
    assert cases["test_sum[launched-ws1]"].find("failure") is None
    assert cases["test_sum[launched-ws2]"].find("failure") is None
    skipped = cases["test_sum[launched-ws4]"].find("skipped")
    assert skipped is not None
    assert f"needs 4 launched ranks, the launcher started {nproc}" in (skipped.get("message") or "")
    ws3 = cases["test_sum[launched-ws3]"]
    if nproc == 3:
        assert ws3.find("failure") is None and ws3.find("skipped") is None
    else:
        assert ws3.find("skipped") is not None
    # A failing rank: one failed item whose report carries that rank's own traceback.
    failure = cases["test_rank_one_fails[launched-ws2]"].find("failure")
    assert failure is not None
    text = failure.text or ""
    assert "rank 1: ValueError: rank one is broken" in text
    assert "test_specs.py\", line 22, in test_rank_one_fails" in text  # rank 1's own frame
    assert 'raise ValueError("rank one is broken")' in text
    assert "rank 0 stopped because another rank failed" in text
    # An ordinary test that fails on one rank only: rank 0 reports rank 1's failure and its output.
    plain = cases["test_plain_fails_on_rank_one"].find("failure")
    assert plain is not None
    assert "plain failure on rank 1" in (plain.text or "")
    assert "plain test on rank 1" in out
    assert cases["test_plain_passes"].find("failure") is None
    if not waits:
        return
    # A rank hung in a spec: reported with its stack after the spec's timeout, and the session goes on.
    hang = cases["test_rank_one_hangs[launched-ws2]"].find("failure")
    assert hang is not None
    # 5 s of body: the clock starts once the run's group formed (forming on 2 busy cores is not counted)
    assert "ran past its timeout of 5 s" in (hang.text or ""), hang.text
    assert "time.sleep(3600)" in (hang.text or ""), hang.text
    assert cases["test_after_the_hang[launched-ws2]"].find("failure") is None
    # A rank that connects 4 s after its peer: the spec's 2 s timeout is its body's, counted once the run's
    # group formed.
    late = cases["test_a_late_rank_is_waited_for[launched-ws2]"]
    assert late.find("failure") is None and late.find("skipped") is None, ET.tostring(late, encoding="unicode")
    # A rank whose own pytest thread hangs (no spec run to stop it): reported, and the run ends.
    lost = cases["test_zz_main_thread_hangs_on_rank_one"].find("failure")
    assert lost is not None
    assert "ranks [1] did not report the call phase of this item within 15 s" in (lost.text or "")


def test_ranks_that_collect_different_items_stop_before_running_any(tmp_path: Path) -> None:
    (tmp_path / "test_divergent.py").write_text(_DIVERGENT)
    proc, _ = _launch(tmp_path, 2)
    assert proc.returncode != 0
    err = proc.stderr
    assert "the ranks collected different items (rank 0: 1 items; rank 1: 2)" in err, err
    assert "only on rank 1: test_divergent.py::test_only_on_rank_one" in err, err
    assert "passed" not in proc.stdout, proc.stdout


def test_launched_world_without_a_launcher_is_skipped_with_the_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dstest

        @dstest.spec(world_size=[2], worlds=["launched"])
        def test_x(ctx):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*the launched world needs a launcher: run pytest under torchrun*"])


def test_launch_variables_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from dstest.errors import InvalidArgument
    from dstest.worlds.launched import launch_environment

    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert launch_environment({}) is None
    env = launch_environment({**base, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    with pytest.raises(InvalidArgument, match="RANK set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not"):
        launch_environment({"RANK": "0"})
    with pytest.raises(InvalidArgument, match=r"RANK=2: must be < WORLD_SIZE=2"):
        launch_environment({**base, "RANK": "2"})
    with pytest.raises(InvalidArgument, match=r"WORLD_SIZE='two': must be an int >= 1"):
        launch_environment({**base, "WORLD_SIZE": "two"})
    monkeypatch.setenv("DSTEST_LAUNCHED_BACKEND", "mpi")
    from dstest.worlds.launched import backend_name

    with pytest.raises(InvalidArgument, match=r"DSTEST_LAUNCHED_BACKEND='mpi': allowed values are 'gloo' and 'nccl'"):
        backend_name()


def test_xdist_under_a_launcher_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*-n 2 under a launcher (RANK=0, WORLD_SIZE=2)*drop -n*"])
