"""contract F1: the DeepSpeed test-suite plugin (``-p dstest.compat.deepspeed``) on small DistributedTest-style
suites (and E3, E10 for the failure, hang and isolation cases).

Each test writes a suite of the shape DeepSpeed's tests have (a ``unit/common.py`` with ``DistributedExec``,
``DistributedTest`` and ``DistributedFixture``, a conftest that hands DistributedTest items to the class,
test classes with ``world_size``), written here from scratch, and runs it with pytest in a subprocess, with
the plugin. The harness below runs each test on its own pool of forked processes when the plugin is off; the tests check
what the plugin changes: the ranks run warm in dstest's process world, verdicts and locations stay the
test's own, and nothing of one test reaches the next. DeepSpeed itself is not needed.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from _junit import run_with_outcomes

from dstest.worlds.process.byref import free_port as _free_port

pytestmark = pytest.mark.cpu

#: A harness of the shape of DeepSpeed's tests/unit/common.py (the two steps the plugin adapts to:
#: _launch_with_file_store(request, world_size) and _dist_run(local_rank, num_procs, master_port, ...)).
COMMON = '''
import inspect
import os
import socket
import tempfile

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _pytest.fixtures import FixtureLookupError
from _pytest.outcomes import Skipped


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedExec:
    world_size = 2
    init_distributed = True
    set_dist_env = True
    exec_timeout = 60

    def run(self, **kwargs):
        raise NotImplementedError

    def __call__(self, request):
        self._fixture_kwargs = self._kwargs(request, self.run)
        self._launch_with_file_store(request, self.world_size)

    def _kwargs(self, request, func):
        found = {}
        for name in inspect.signature(func).parameters:
            try:
                found[name] = request.getfixturevalue(name)
            except FixtureLookupError:
                pass
        return found

    def _launch_with_file_store(self, request, world_size):
        sizes = [world_size] if isinstance(world_size, int) else world_size
        for n in sizes:
            os.environ["HARNESS_POOLS"] = str(int(os.environ.get("HARNESS_POOLS", "0")) + 1)
            store = tempfile.NamedTemporaryFile(delete=False, dir=str(request.getfixturevalue("tmp_path")))
            port = _free_port()
            with mp.get_context("fork").Pool(n) as pool:
                skips = pool.starmap(self._dist_run, [(r, n, port, f"file://{store.name}") for r in range(n)])
            if any(skips):
                pytest.skip(skips[0])

    def _dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg=""):
        if self.set_dist_env:
            os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(num_procs),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
        if self.init_distributed and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=local_rank, world_size=num_procs)
        try:
            self.run(**self._fixture_kwargs)
        except Skipped as exc:
            return exc.msg
        return skip_msg


class DistributedTest(DistributedExec):
    is_dist_test = True

    def run(self, **kwargs):
        self._current_test(**kwargs)

    def __call__(self, request):
        self._current_test = getattr(self, request.function.__name__)
        self._fixture_kwargs = self._kwargs(request, self._current_test)
        mark = request.node.get_closest_marker("world_size")
        world_size = mark.args[0] if mark else self._fixture_kwargs.get("world_size", self.world_size)
        self._launch_with_file_store(request, world_size)


class DistributedFixture(DistributedExec):
    is_dist_fixture = True
'''

CONFTEST = '''
import pytest


@pytest.fixture(scope="class")
def class_tmpdir(request, tmp_path_factory):
    return tmp_path_factory.mktemp(request.cls.__name__ if request.cls else "module")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: True
'''


def _suite(pytester: pytest.Pytester, tests: str, *, conftest_extra: str = "", **files: str) -> None:
    pytester.makepyfile(**{"unit/__init__.py": "", "unit/common.py": COMMON, **files})
    pytester.makeconftest(CONFTEST + textwrap.dedent(conftest_extra))
    pytester.makepyfile(test_suite=textwrap.dedent(tests))
    pytester.makeini("[pytest]\nmarkers =\n    world_size: the world size of one test\n")


def _run(pytester: pytest.Pytester, *args: str, plugin: bool = True) -> tuple[pytest.RunResult, dict[str, str]]:
    extra = ["-p", "dstest.compat.deepspeed"] if plugin else []
    result, outcomes = run_with_outcomes(pytester, *extra, "-rsf", *args)
    verdicts = {
        name: "failed" if {"failure", "error"} & set(kinds) else "skipped" if "skipped" in kinds else "passed"
        for name, kinds in outcomes.items()
    }
    return result, verdicts


BASIC = """
    import os
    import pytest
    import torch
    import torch.distributed as dist
    from unit.common import DistributedTest


    class TestVerdicts(DistributedTest):
        world_size = 2

        def test_pass(self):
            t = torch.ones(3) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            assert t.tolist() == [3.0, 3.0, 3.0]
            assert os.environ["WORLD_SIZE"] == "2" and os.environ.get("HARNESS_POOLS", "0") == "0"

        def test_fail(self):
            if dist.get_rank() == 1:
                assert 1 + 1 == 3, "rank one disagrees"

        def test_skip(self):
            pytest.skip("needs a feature this machine lacks")
"""


def test_pass_fail_and_skip_keep_their_verdicts_and_point_at_the_test(pytester: pytest.Pytester) -> None:
    """F1, E3: the harness's verdicts; a failure carries the failing rank's traceback."""
    _suite(pytester, BASIC)
    result, verdicts = _run(pytester)
    assert verdicts == {"test_pass": "passed", "test_fail": "failed", "test_skip": "skipped"}, result.stdout.str()
    out = result.stdout.str()
    lines = (pytester.path / "test_suite.py").read_text().splitlines()
    fail_line = next(n for n, line in enumerate(lines, 1) if "assert 1 + 1 == 3" in line)
    skip_line = next(n for n, line in enumerate(lines, 1) if "pytest.skip(" in line)
    # the failure shows the failing rank's traceback through the test's own line
    assert "rank 1" in out and "rank one disagrees" in out
    assert f'test_suite.py", line {fail_line}, in test_fail' in out, out
    # the skip is reported at the test's pytest.skip line, not inside dstest or the harness
    assert f"test_suite.py:{skip_line}: needs a feature this machine lacks" in out, out
    assert "3 launches ran warm; 0 ran on DeepSpeed's own launcher" in out


SIZES = """
    import json
    import os
    import pytest
    import torch.distributed as dist
    from unit.common import DistributedTest


    def note(label):
        path = os.path.join(os.environ["SIZES_DIR"], f"{label}-{dist.get_world_size()}-{dist.get_rank()}")
        open(path, "w").close()


    class TestList(DistributedTest):
        world_size = [1, 2]

        def test_each(self):
            note("list")


    class TestMark(DistributedTest):
        world_size = 2

        @pytest.mark.world_size(3)
        def test_three(self):
            note("mark")


    @pytest.fixture(params=[1, 2])
    def world_size(request):
        return request.param


    @pytest.fixture
    def settings():
        return {"lr": 0.5, "steps": 3}


    class TestFixtures(DistributedTest):
        @pytest.mark.parametrize("scale", [10])
        def test_values(self, world_size, settings, scale):
            assert settings == {"lr": 0.5, "steps": 3} and scale == 10
            note(f"fixture{world_size}")
"""


def test_world_size_lists_marks_and_fixtures_reach_every_rank(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1: world_size as a list, a mark and a fixture; parametrize and fixture values reach the ranks."""
    _suite(pytester, SIZES)
    monkeypatch.setenv("SIZES_DIR", str(tmp_path))
    result, verdicts = _run(pytester)
    assert verdicts and set(verdicts.values()) == {"passed"}, result.stdout.str()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fixture1-1-0", "fixture2-2-0", "fixture2-2-1",
        "list-1-0", "list-2-0", "list-2-1",
        "mark-3-0", "mark-3-1", "mark-3-2",
    ]  # fmt: skip
    # test ids are the suite's own
    assert set(verdicts) == {"test_each", "test_three", "test_values[1-10]", "test_values[2-10]"}


FIXTURE = """
    import os
    import torch.distributed as dist
    import pytest
    from unit.common import DistributedFixture, DistributedTest


    class rank_files(DistributedFixture):
        world_size = 2

        def run(self, class_tmpdir):
            with open(os.path.join(class_tmpdir, f"rank{dist.get_rank()}"), "w") as f:
                f.write(str(dist.get_world_size()))


    @pytest.fixture
    def written(request, class_tmpdir):
        rank_files()(request)
        return class_tmpdir


    class TestReadsWhatTheFixtureWrote(DistributedTest):
        world_size = 1

        def test_read(self, written):
            assert sorted(os.listdir(written)) == ["rank0", "rank1"]
            assert open(os.path.join(written, "rank1")).read() == "2"
"""


def test_a_distributed_fixture_runs_on_its_own_world_size(pytester: pytest.Pytester) -> None:
    """F1: a DistributedFixture runs on its own world size before the test."""
    _suite(pytester, FIXTURE)
    result, verdicts = _run(pytester)
    assert verdicts == {"test_read": "passed"}, result.stdout.str()
    assert "2 launches ran warm" in result.stdout.str()


OWN_WORLD = """
    import os
    import socket

    import pytest
    import torch
    import torch.distributed as dist
    from unit.common import DistributedTest


    def pid_file(tag):
        return os.path.join(os.environ["SIZES_DIR"], f"{tag}{dist.get_rank()}")


    class TestOwnsInit(DistributedTest):
        world_size = 2
        init_distributed = False

        def test_forms_its_world(self):
            assert not dist.is_initialized()  # as in a fresh process, though the worker is warm
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2.0
            with open(pid_file("own"), "w") as f:
                f.write(str(os.getpid()))
            dist.destroy_process_group()

        def test_leaves_its_world_formed(self):
            dist.init_process_group("gloo")
            dist.new_group([0, 1])


    class TestNoEnv(DistributedTest):
        world_size = 1
        init_distributed = False
        set_dist_env = False

        def test_sets_its_own(self):
            assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            assert dist.get_world_size() == 1


    class TestAfter(DistributedTest):
        world_size = 2

        def test_runs_on_the_warm_world_again(self):
            with open(pid_file("own")) as f:
                assert int(f.read()) != os.getpid()  # fresh workers after a test that formed its world
            assert dist.get_process_group_ranks(dist.group.WORLD) == [0, 1]
            t = torch.ones(1)
            dist.all_reduce(t, group=dist.new_group([0, 1]))
            assert t.item() == 2.0 and dist.get_world_size() == 2


    class TestMarked(DistributedTest):
        world_size = 1

        @pytest.mark.dstest_own_world("patches multiprocessing itself")
        def test_marked(self):
            assert not dist.is_initialized() or dist.get_world_size() == 1
"""


def test_tests_that_form_their_world_run_warm_and_marked_ones_on_the_harness(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1: a test that forms its own world (init_distributed / set_dist_env False) runs in a warm worker
    with the worker's world hidden, and the next test gets fresh workers; a marked test falls back to the
    harness's launcher, listed with the reason."""
    _suite(pytester, OWN_WORLD)
    monkeypatch.setenv("SIZES_DIR", str(tmp_path))
    result, verdicts = _run(pytester)
    assert verdicts == {
        "test_forms_its_world": "passed",
        "test_leaves_its_world_formed": "passed",
        "test_sets_its_own": "passed",
        "test_runs_on_the_warm_world_again": "passed",
        "test_marked": "passed",
    }, result.stdout.str()
    out = result.stdout.str()
    assert (
        "4 launches ran warm (3 of them on a world the test formed itself, each followed by fresh workers); "
        "1 ran on DeepSpeed's own launcher" in out
    )
    assert "own launcher: test_suite.py::TestMarked::test_marked (world size 1): patches multiprocessing itself" in out
    assert "pool replaced" not in out


STATE = """
    import os
    import torch
    import torch.distributed as dist
    import statelib
    from unit.common import DistributedTest


    def pid_file():
        return os.path.join(os.environ["SIZES_DIR"], f"pid{dist.get_rank()}")


    class TestState(DistributedTest):
        world_size = 2

        def test_a_leaves_state_behind(self):
            os.environ["LEFT_BEHIND"] = "1"
            os.chdir("/")
            torch.set_default_dtype(torch.float64)
            statelib.GROUP = dist.new_group([0, 1])
            statelib.CALLS.append("a")
            with open(pid_file(), "w") as f:
                f.write(str(os.getpid()))

        def test_b_sees_a_fresh_process(self):
            with open(pid_file()) as f:
                assert int(f.read()) == os.getpid()  # the same warm worker as test_a
            assert "LEFT_BEHIND" not in os.environ
            assert os.getcwd() != "/"
            assert torch.get_default_dtype() is torch.float32
            assert statelib.GROUP is None and statelib.CALLS == []
            assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator()).item()
"""

STATELIB = """
    GROUP = None
    CALLS = []


    def reset():
        global GROUP
        GROUP = None
        CALLS.clear()
"""


@pytest.mark.parametrize("registered", [True, False], ids=["reset", "no-reset"])
def test_state_of_one_test_never_reaches_the_next(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registered: bool
) -> None:
    """F1, E10: in the same warm worker, the next test sees a fresh process's state; a library's own
    globals need its registered reset (without it the leak shows)."""
    extra = "\nimport dstest.resets\ndstest.resets.register('statelib:reset')\n" if registered else ""
    _suite(pytester, STATE, conftest_extra=extra, statelib=textwrap.dedent(STATELIB))
    monkeypatch.setenv("SIZES_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=os.pathsep)
    result, verdicts = _run(pytester)
    if registered:
        assert verdicts == {"test_a_leaves_state_behind": "passed", "test_b_sees_a_fresh_process": "passed"}, (
            result.stdout.str()
        )
    else:  # the library's own state needs its reset: without it the next test sees it
        assert verdicts["test_b_sees_a_fresh_process"] == "failed"
        assert "assert statelib.GROUP is None" in result.stdout.str()


HANG = """
    import time
    import torch
    import torch.distributed as dist
    from unit.common import DistributedTest


    class TestFirst(DistributedTest):
        world_size = 2

        def test_warms_the_pool(self):
            dist.barrier()


    class TestHang(DistributedTest):
        world_size = 2
        exec_timeout = 2

        def test_hangs(self):
            if dist.get_rank() == 1:
                time.sleep(600)
            dist.barrier()


    class TestAfter(DistributedTest):
        world_size = 2

        def test_runs_after_the_hang(self):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2.0
"""


def test_a_hanging_test_is_reported_with_stacks_and_the_next_test_runs(pytester: pytest.Pytester) -> None:
    """F1, E3: a hang past exec_timeout fails with every rank's stack; the session goes on."""
    _suite(pytester, HANG)
    result, verdicts = _run(pytester)
    assert verdicts == {"test_warms_the_pool": "passed", "test_hangs": "failed", "test_runs_after_the_hang": "passed"}, (
        result.stdout.str()
    )
    out = result.stdout.str()
    lines = (pytester.path / "test_suite.py").read_text().splitlines()
    sleep_line = next(n for n, line in enumerate(lines, 1) if "time.sleep(600)" in line)
    assert f'test_suite.py", line {sleep_line} in test_hangs' in out  # rank 1's stack where it hangs
    assert "pool replaced after: test_suite.py::TestHang::test_hangs (world size 2): a rank hung" in out


def test_a_harness_of_another_shape_is_refused(pytester: pytest.Pytester) -> None:
    """F1: a common.py the plugin cannot adapt to is a usage error, never a silent run on the harness."""
    _suite(pytester, BASIC)
    common = pytester.path / "unit" / "common.py"
    common.write_text(common.read_text().replace("_launch_with_file_store", "_launch_all"))
    result, _ = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "no class of TestVerdicts's bases defines both _launch_with_file_store" in result.stderr.str()


WARM_FACTS = """
    import os
    import deepspeed
    from cpuinfo import get_cpu_info
    from deepspeed.accelerator import get_accelerator
    from unit.common import DistributedTest


    def record(name, value):
        with open(os.path.join(os.environ["FACTS_DIR"], f"{name}-{os.getpid()}"), "w") as f:
            f.write(str(value))


    class TestWarmFacts(DistributedTest):
        world_size = 2

        def test_a_asks_and_peaks(self):
            info = get_cpu_info()
            assert info["flags"] == ["avx2"]
            info["flags"].append("scribbled")  # a caller's change stays in its copy
            assert get_cpu_info()["flags"] == ["avx2"]
            get_accelerator().allocate(10**9)
            assert get_accelerator().max_memory_allocated() >= 10**9

        def test_b_asks_and_sees_no_earlier_peak(self):
            assert get_cpu_info()["flags"] == ["avx2"]
            assert get_accelerator().max_memory_allocated() < 10**9  # as in a fresh process
            record("imported-here", deepspeed.IMPORTED_BY == os.getpid())
"""

#: py-cpuinfo's call, as slow as a probe of the CPU is not, counting its calls per process.
FAKE_CPUINFO = """
    import os


    def get_cpu_info():
        path = os.path.join(os.environ["FACTS_DIR"], f"cpuinfo-{os.getpid()}")
        calls = int(open(path).read()) if os.path.exists(path) else 0
        with open(path, "w") as f:
            f.write(str(calls + 1))
        return {"brand_raw": "test cpu", "flags": ["avx2"]}
"""

#: DeepSpeed's CPU accelerator, as far as the reset uses it: a peak since creation, reset to "now".
FAKE_DEEPSPEED = {
    "deepspeed/__init__.py": """
        import os
        IMPORTED_BY = os.getpid()
    """,
    "deepspeed/accelerator/__init__.py": "from .real_accelerator import get_accelerator\n",
    "deepspeed/accelerator/real_accelerator.py": """
        class CPU_Accelerator:
            _name = "cpu"

            def __init__(self):
                self.now = 100
                self.max_mem = self.now

            def allocate(self, nbytes):
                self.max_mem = max(self.max_mem, self.now + nbytes)

            def max_memory_allocated(self):
                return self.max_mem

            def reset_peak_memory_stats(self):
                self.max_mem = self.now


        ds_accelerator = CPU_Accelerator()


        def get_accelerator():
            return ds_accelerator
    """,
}


def test_warm_workers_keep_machine_facts_but_not_memory_peaks(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1, E10: what is the same for every process of the machine is asked once per worker (py-cpuinfo's
    probe, which DeepSpeed repeats for every CPU optimizer), handed out as copies; what a fresh process
    starts afresh (the accelerator's peak memory) does; DeepSpeed is imported once, by the fork server."""
    files = {name: textwrap.dedent(text) for name, text in FAKE_DEEPSPEED.items()}
    _suite(pytester, WARM_FACTS, cpuinfo=textwrap.dedent(FAKE_CPUINFO), **files)
    monkeypatch.setenv("FACTS_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=os.pathsep)
    result, verdicts = _run(pytester)
    assert verdicts == {"test_a_asks_and_peaks": "passed", "test_b_asks_and_sees_no_earlier_peak": "passed"}, (
        result.stdout.str()
    )
    facts = {p.name: p.read_text() for p in tmp_path.iterdir()}
    asked = {name: calls for name, calls in facts.items() if name.startswith("cpuinfo-")}
    assert sorted(asked.values()) == ["1", "1"], facts  # one probe per worker, for five questions each
    # neither worker imported DeepSpeed: the fork server had, before it forked them
    assert sorted(v for k, v in facts.items() if k.startswith("imported-here")) == ["False", "False"], facts


SHM = """
    import os
    from unit.common import DistributedTest


    class TestSharedMemory(DistributedTest):
        world_size = 2

        def test_makes_a_segment_as_deepspeed_does(self):
            name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
                os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"]
            )
            with open(os.path.join("/dev/shm", name), "wb") as f:
                f.write(b"x" * 4096)
            with open(os.path.join(os.environ["FACTS_DIR"], "segment-" + os.environ["RANK"]), "w") as f:
                f.write(name)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
def test_deepspeed_shared_memory_segments_of_the_session_are_removed(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1: the segments DeepSpeed's CPU collectives leave in /dev/shm (one per rank and MASTER_PORT, never
    removed by DeepSpeed) are removed when the session ends, and only those of the session's ports."""
    other = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_0"
    other.write_bytes(b"not this session's")
    try:
        _suite(pytester, SHM)
        monkeypatch.setenv("FACTS_DIR", str(tmp_path))
        result, verdicts = _run(pytester)
        assert verdicts == {"test_makes_a_segment_as_deepspeed_does": "passed"}, result.stdout.str()
        names = [(tmp_path / f"segment-{rank}").read_text() for rank in (0, 1)]
        assert len(set(names)) == 2
        assert [name for name in names if (Path("/dev/shm") / name).exists()] == []
        assert other.exists()
    finally:
        other.unlink()


HELD_PORT = """
    import os
    import torch.distributed as dist
    from unit.common import DistributedTest

    KEPT = []


    class TestFormsItsWorldOnAFixedPort(DistributedTest):
        world_size = 1
        init_distributed = False
        set_dist_env = False

        def test_forms_and_keeps_its_store(self):
            # as DeepSpeed's init_distributed does when it sees no MASTER_PORT: its default port
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["FIXED_PORT"], RANK="0", WORLD_SIZE="1")
            dist.init_process_group("gloo", init_method="env://")
            KEPT.append(dist.distributed_c10d._get_default_store())  # a library's reference outlives the test


    def test_a_later_test_binds_that_port():
        from torch.distributed import TCPStore

        TCPStore("127.0.0.1", int(os.environ["FIXED_PORT"]), 1, True)
"""


def test_a_world_a_test_formed_leaves_no_port_taken(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F1, E10: a test that forms its own world on a fixed port (DeepSpeed's default, 29500) and whose
    store something still refers to does not keep that port from the tests after it, as its own process
    would not after exiting: its workers are replaced."""
    _suite(pytester, HELD_PORT)
    monkeypatch.setenv("FIXED_PORT", str(_free_port()))
    result, verdicts = _run(pytester)
    assert verdicts == {"test_forms_and_keeps_its_store": "passed", "test_a_later_test_binds_that_port": "passed"}, (
        result.stdout.str()
    )


def test_without_the_plugin_the_harness_runs_its_own_pools(pytester: pytest.Pytester) -> None:
    """F1: the suite's own warm check is real: without the plugin it sees the harness's pool."""
    _suite(pytester, BASIC)
    result, verdicts = _run(pytester, plugin=False)
    # the suite's own check that it ran warm fails: the harness counted a pool of its own
    assert verdicts == {"test_pass": "failed", "test_fail": "failed", "test_skip": "skipped"}, result.stdout.str()
    assert "HARNESS_POOLS" in result.stdout.str()


def test_the_deepspeed_reset_is_registered_and_cheap_without_deepspeed() -> None:
    """F1: DeepSpeed's reset is a registered dstest.resets entry point and imports nothing of DeepSpeed."""
    import subprocess
    import sys

    import dstest.resets

    assert "dstest.compat.deepspeed:reset_deepspeed" in dstest.resets.registered()
    code = (
        "import sys, json; from dstest.compat.deepspeed import reset_deepspeed; reset_deepspeed(); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []  # it imported nothing of DeepSpeed


LEAKS = """
    import deepspeed
    from unit.common import DistributedTest


    class TestLeaves(DistributedTest):
        world_size = 2

        def test_changes_module_state(self):
            deepspeed.LEVEL = "changed by a test"
            deepspeed.SEEN.append(1)


    class TestNext(DistributedTest):
        world_size = 2

        def test_sees_a_fresh_module(self):
            assert deepspeed.LEVEL == "fresh" and deepspeed.SEEN == []
"""


def test_deepspeed_module_state_a_test_leaves_is_put_back_and_named(pytester: pytest.Pytester) -> None:
    """Issue 28: what a test leaves in DeepSpeed's module globals (here a stand-in ``deepspeed`` package) is put
    back before the next test on the same warm workers, and named in a StateLeftBehind warning of that test."""
    _suite(pytester, LEAKS, **{"deepspeed/__init__.py": 'LEVEL = "fresh"\nSEEN = []\n'})
    result, verdicts = _run(pytester, "-W", "default::dstest.errors.StateLeftBehind")
    assert verdicts == {"test_changes_module_state": "passed", "test_sees_a_fresh_module": "passed"}, (
        result.stdout.str()
    )
    result.stdout.fnmatch_lines(
        [
            "*test_changes_module_state*",
            "*StateLeftBehind: *deepspeed.LEVEL: rebound to a str; put back; "
            "deepspeed.SEEN: its list changed in place; contents put back*",
        ]
    )


DESYNC = """
    import torch
    import torch.distributed as dist
    from unit.common import DistributedTest


    class TestDesync(DistributedTest):
        world_size = 2

        def test_sizes_differ(self):
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(3 + dist.get_rank()))
"""


def test_a_failing_test_writes_its_trace_and_dumps_as_a_spec_does(pytester: pytest.Pytester) -> None:
    """G1, G6 on DeepSpeed's suites: a failing test's trace goes to pytest's cache, and with
    --dstest-flight-recorder DIR its run's dumps to DIR/<test id>/run-1, which the plugin's report of the
    failure names, with each rank's last calls, as a spec's report does."""
    import pickle

    from dstest.trace import FR_PREFIX

    _suite(pytester, DESYNC)
    result, verdicts = _run(pytester, "--dstest-flight-recorder=fr")
    out = result.stdout.str()
    assert verdicts == {"test_sizes_differ": "failed"}, out[-6000:]
    assert "CollectiveMismatch" in out and "last calls of each rank" in out, out[-6000:]
    (trace,) = (pytester.path / ".pytest_cache" / "d" / "dstest-traces").iterdir()
    assert trace.name.startswith("test_suite.py_TestDesync_test_sizes_differ-") and trace.suffix == ".json"
    assert '"all_reduce"' in trace.read_text()
    (folder,) = (pytester.path / "fr").iterdir()
    assert folder.name == trace.stem, (folder.name, trace.name)
    for rank in (0, 1):
        with open(folder / "run-1" / f"{FR_PREFIX}{rank}", "rb") as f:
            sizes = [e["input_sizes"] for e in pickle.load(f)["entries"]]
        assert sizes == [[[2]], [[3 + rank]]], (rank, sizes)
    result.stdout.fnmatch_lines(
        [f"*flight-recorder dumps of this run: fr/{folder.name}/run-1 (read them with: python -m *{FR_PREFIX})"]
    )
