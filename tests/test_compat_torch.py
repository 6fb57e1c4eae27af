"""contract F2: the plugin for torch's own distributed test bases (``-p dstest.compat.torch``), on small test
files written on those bases (``MultiProcessTestCase``, ``DTensorTestBase`` with ``with_comms``,
``MultiThreadedTestCase``, ``DTensorOpTestBase``), run with pytest in a subprocess, with and without it.

The bases are the installed torch's (``torch.testing._internal``, which needs ``expecttest``). What is
checked: the verdicts, the skip and failure texts are the bases' own; the process-based ranks run in
dstest's warm workers (the same worker pids from one test to the next, where the bases start new processes);
a hang is reported with every rank's stack; what a test leaves in a worker never reaches the next test; the
threaded ranks run on dstest's threaded world and a mismatch there is named; a test marked to need a fresh
process gets the base's own processes.
"""

from __future__ import annotations

import os
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _junit import run_with_outcomes
from _warm import stop_servers, wait_for_server

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (pip install expecttest)")

pytestmark = pytest.mark.cpu

PROCESS_SUITE = """
import os
import time

import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed as cd
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms
from torch.distributed.tensor import Shard, distribute_tensor

cd.TIMEOUT_OVERRIDE["test_hang"] = 4


class ProcTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _init(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)

    def test_allreduce(self):
        self._init()
        t = torch.ones(4) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((4,), 3.0))
        with open(os.path.join(os.environ["PIDS_DIR"], f"{self.id()}.{self.rank}"), "w") as f:
            f.write(str(os.getpid()))

    def test_fails_on_rank_1(self):
        self._init()
        self.assertEqual(self.rank, 0, "rank 1 disagrees")

    def test_raises_before_its_collective(self):
        self._init()
        if self.rank == 1:
            raise ValueError("rank 1 gives up before the all_reduce")
        dist.all_reduce(torch.ones(2))

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self):
        self._init()

    def test_hang(self):
        self._init()
        if self.rank == 1:
            time.sleep(3600)
        dist.all_reduce(torch.ones(1))

    def test_leaves_state(self):
        self._init()
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        dist.distributed_c10d._dstest_left_here = 1

    def test_sees_fresh_state(self):
        self._init()
        self.assertIs(torch.get_default_dtype(), torch.float32)
        self.assertEqual(torch.empty(1).device.type, "cpu")
        self.assertFalse(hasattr(dist.distributed_c10d, "_dstest_left_here"))

    @parametrize("n", [1, 3])
    def test_param(self, n):
        self._init()
        t = torch.ones(n)
        dist.all_reduce(t)
        self.assertEqual(t.sum().item(), 2 * n)
        with open(os.path.join(os.environ["PIDS_DIR"], f"{self.id()}.{self.rank}"), "w") as f:
            f.write(str(os.getpid()))


instantiate_parametrized_tests(ProcTest)


class DTensorTest(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_round_trip(self):
        mesh = self.build_device_mesh()
        x = torch.arange(10.0)
        self.assertEqual(distribute_tensor(x, mesh, [Shard(0)]).full_tensor(), x)
        with open(os.path.join(os.environ["PIDS_DIR"], f"{self.id()}.{self.rank}"), "w") as f:
            f.write(str(os.getpid()))


class SkipsAfterForming(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    @skip_if_lt_x_gpu(2)
    def test_skips_once_its_world_is_formed(self):
        self.build_device_mesh()
"""

THREADED_SUITE = """
import threading

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


class Threads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 4

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_all_reduce(self):
        t = torch.ones(3) * self.rank
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((3,), 6.0))
        self.assertNotEqual(threading.current_thread().name, "MainThread")
        self.assertIn("dstest", type(dist.distributed_c10d._get_default_group()).__module__ + repr(dist.group.WORLD))

    def test_mismatch(self):
        t = torch.ones(3 if self.rank == 2 else 4)
        dist.all_reduce(t)

    def test_fails_on_rank_0(self):
        self.assertEqual(self.rank, 3, "only rank 3 is right")

    def test_skips(self):
        self.skipTest("not here")


class Ops(DTensorOpTestBase):
    def test_redistribute(self):
        mesh = self.build_device_mesh()
        x = torch.arange(8.0)
        self.assertEqual(distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(), x)
"""


CONTINUOUS_SUITE = """
import os
import time

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class Continuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_all_reduce(self):
        t = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 3.0))
        self.assertEqual(dist.get_world_size(), 2)

    def test_b_rank_1_raises_before_its_collective(self):
        if self.rank == 1:
            raise ValueError("rank 1 gives up")
        dist.all_reduce(torch.ones(1))

    def test_c_after_a_failure(self):
        pass


class Skips(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_skip(self):
        self.skipTest("not on this machine")
"""


LEAKS_SUITE = """
import os
import signal
import sys
import tempfile

import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest, MultiProcessTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

SEEN = []
TABLE = {"nested": [1]}
THREADS = torch.get_num_threads()
PRINTED = str(torch.tensor([1 / 3]))
CWD = os.getcwd()


class Leaks(MultiProcessTestCase):
    world_size = 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_a_leaves_state(self):
        global ADDED
        ADDED = self.rank
        SEEN.append(self.rank)
        TABLE["nested"].append(self.rank)
        sys.path.insert(0, "/dstest-left-here")
        import leak_helper

        leak_helper.CALLS.append(self.rank)
        with open(os.path.join(CWD, f"pid.a.{self.rank}"), "w") as f:
            f.write(str(os.getpid()))
        os.chdir(tempfile.gettempdir())
        os.environ["DSTEST_LEFT_HERE"] = "1"
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(THREADS + 1)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_printoptions(precision=2)

    def test_b_sees_a_fresh_process(self):
        self.assertEqual(SEEN, [])
        self.assertEqual(TABLE, {"nested": [1]})
        self.assertNotIn("ADDED", globals())
        self.assertNotIn("/dstest-left-here", sys.path)
        self.assertNotIn("leak_helper", sys.modules)
        self.assertEqual(os.getcwd(), CWD)
        self.assertNotIn("DSTEST_LEFT_HERE", os.environ)
        self.assertIs(torch.get_default_dtype(), torch.float32)
        self.assertEqual(torch.get_num_threads(), THREADS)
        self.assertFalse(torch.are_deterministic_algorithms_enabled())
        self.assertEqual(str(torch.tensor([1 / 3])), PRINTED)
        with open(os.path.join(CWD, f"pid.b.{self.rank}"), "w") as f:
            f.write(str(os.getpid()))

    def test_c_sets_a_signal_handler(self):
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def test_d_sees_the_default_handler(self):
        self.assertIs(signal.getsignal(signal.SIGUSR2), signal.SIG_DFL)


SEEN_BY_DTENSOR = []


class DTensorLeaks(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_a_appends(self):
        SEEN_BY_DTENSOR.append(self.rank)

    @with_comms
    def test_b_sees_nothing(self):
        self.assertEqual(SEEN_BY_DTENSOR, [])


SEEN_BY_CLASS = []


class ContinuousFirst(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_appends(self):
        SEEN_BY_CLASS.append(self.rank)

    def test_b_sees_what_its_class_left(self):
        self.assertEqual(SEEN_BY_CLASS, [self.rank])


class ContinuousSecond(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_sees_what_a_fresh_process_sees(self):
        self.assertEqual(SEEN_BY_CLASS, [])
"""


def _run(pytester: pytest.Pytester, *args: str, plugin: bool = True) -> tuple[pytest.RunResult, dict[str, str]]:
    """pytest in a subprocess; the verdict of every test from its JUnit XML."""
    extra = ["-p", "dstest.compat.torch"] if plugin else []
    result, outcomes = run_with_outcomes(pytester, *extra, "-rsf", "-p", "no:cacheprovider", *args)
    return result, {name: kinds[0] if kinds else "passed" for name, kinds in outcomes.items()}


def _pids(directory: Path, test: str) -> set[str]:
    return {p.read_text() for p in directory.glob(f"*.{test}.*")}


def test_process_bases_keep_their_verdicts_and_run_warm(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pass, fail, the exit-code skip, parametrized ids and with_comms: the bases' verdicts and texts; the
    ranks of different tests ran in the same worker processes; a hang names every rank; nothing a test
    changes (default dtype and device, a module global of torch.distributed) reaches the next one."""
    pids = pytester.path / "pids"
    pids.mkdir()
    monkeypatch.setenv("PIDS_DIR", str(pids))
    pytester.makepyfile(test_suite=textwrap.dedent(PROCESS_SUITE))
    result, verdicts = _run(pytester, "-p", "no:randomly")
    assert verdicts == {
        "test_allreduce": "passed",
        "test_fails_on_rank_1": "failure",
        "test_raises_before_its_collective": "failure",
        "test_needs_two_gpus": "skipped",
        "test_hang": "failure",
        "test_leaves_state": "passed",
        "test_sees_fresh_state": "passed",
        "test_param_n_1": "passed",
        "test_param_n_3": "passed",
        "test_round_trip": "passed",
        "test_skips_once_its_world_is_formed": "skipped",  # not a failure of a peer still connecting
    }, result.stdout.str()[-6000:]
    out = result.stdout.str()
    # upstream's own texts: the skip message of TEST_SKIPS and _check_return_codes's error
    from torch.testing._internal.common_distributed import TEST_SKIPS

    skip = TEST_SKIPS.get("multi-gpu-2") or TEST_SKIPS["multi-device-2"]  # renamed in torch 2.15
    result.stdout.fnmatch_lines([f"*{skip.message}*"])
    assert "Process 1 exited with error code 10 and exception:" in out and "rank 1 disagrees" in out
    assert "ValueError: rank 1 gives up before the all_reduce" in out
    assert "ranks [0] were stopped after the failure" in out  # rank 0 was left in its all_reduce
    assert "past its timeout of 4 s" in out and "---- rank 0" in out and "---- rank 1" in out
    assert "StateLeftBehind" in out and "_dstest_left_here" in out
    # the state was put back in the same workers, not left to a replaced pool
    assert "pool replaced after: test_suite.py::ProcTest::test_hang" in out
    assert "pool replaced after: test_suite.py::ProcTest::test_leaves_state" not in out
    # the same two worker processes served two different tests
    assert _pids(pids, "ProcTest.test_param_n_1") == _pids(pids, "ProcTest.test_param_n_3")
    assert len(_pids(pids, "ProcTest.test_param_n_1")) == 2 and str(os.getpid()) not in _pids(
        pids, "ProcTest.test_param_n_1"
    )
    result.stdout.fnmatch_lines(
        ["*dstest: torch's test bases on dstest's worlds*", "*process-based tests ran on warm workers*"]
    )


def test_process_bases_give_each_test_a_fresh_process_and_name_what_a_test_left(pytester: pytest.Pytester) -> None:
    """What a fresh interpreter per rank per test gives upstream (torch's harness passes all nine, in about
    five minutes on this machine), on the warm workers: a test that appends to a module-level list, binds a
    new global, puts an entry on sys.path, imports a module of its own, changes the working directory, the
    environment, a signal handler and torch's global settings leaves none of it to the next test, on
    MultiProcessTestCase and on DTensorTestBase; on MultiProcContinuousTest, whose processes serve a class,
    the next test of the class sees it and the next class does not. The StateLeftBehind warning names each
    thing left."""
    pytester.makepyfile(test_leaks=textwrap.dedent(LEAKS_SUITE), leak_helper="CALLS = []\n")
    result, verdicts = _run(pytester, "-p", "no:randomly")
    assert verdicts == {
        "test_a_leaves_state": "passed",
        "test_b_sees_a_fresh_process": "passed",
        "test_c_sets_a_signal_handler": "passed",
        "test_d_sees_the_default_handler": "passed",
        "test_a_appends": "passed",
        "test_b_sees_nothing": "passed",
        "test_b_sees_what_its_class_left": "passed",
        "test_sees_what_a_fresh_process_sees": "passed",
    }, result.stdout.str()[-6000:]
    out = result.stdout.str()
    left = [
        "test_leaks.ADDED: added by the run (int); removed",
        "test_leaks.SEEN: its list changed in place; contents put back",
        "test_leaks.TABLE: a list inside it changed in place; contents put back",
        "sys.path: '/dstest-left-here' added by the run; removed",
        "sys.modules['leak_helper']: imported by the run; removed",
        "os.environ['DSTEST_LEFT_HERE']: set by the run; removed",
        "working directory: changed by the run",
        "signal handler of SIGUSR2: set by the run",
        "torch default dtype: torch.float32 -> torch.float64",
        "torch num threads",
        "torch deterministic algorithms: (False, False) -> (True, True)",
        "torch print options",
        "test_leaks.SEEN_BY_DTENSOR: its list changed in place",
        "close_class left module-level state behind",  # the continuous class, when it ends
        "test_leaks.SEEN_BY_CLASS: its list changed in place",
    ]
    assert "StateLeftBehind" in out and [name for name in left if name not in out] == [], out[-8000:]
    # the launch environment the bases set in every rank is not a finding
    assert "TORCH_SHOW_CPP_STACKTRACES" not in out and "os.environ['MASTER_PORT']" not in out
    # the next test ran in the same workers, put back; after a signal handler, which cannot be put back from
    # Python for sure, in new ones
    pids = {p.name: p.read_text() for p in pytester.path.glob("pid.*")}
    assert len(pids) == 4 and {pids["pid.a.0"], pids["pid.a.1"]} == {pids["pid.b.0"], pids["pid.b.1"]}, pids
    assert "pool replaced after: test_leaks.py::Leaks::test_a_leaves_state" not in out
    assert "pool replaced after: test_leaks.py::Leaks::test_c_sets_a_signal_handler" in out


def test_threaded_bases_run_on_the_threaded_world_with_its_checks(pytester: pytest.Pytester) -> None:
    """MultiThreadedTestCase and DTensorOpTestBase: the ranks are threads of dstest's threaded world (its
    default group), a shape mismatch is named with the ranks, the bases' failure and skip texts stay."""
    pytester.makepyfile(test_threads=textwrap.dedent(THREADED_SUITE))
    result, verdicts = _run(pytester)
    assert verdicts == {
        "test_all_reduce": "passed",
        "test_mismatch": "failure",
        "test_fails_on_rank_0": "failure",
        "test_skips": "skipped",
        "test_redistribute": "passed",
    }, result.stdout.str()[-6000:]
    out = result.stdout.str()
    assert "Thread 0 exited with exception:" in out and "only rank 3 is right" in out
    assert "CollectiveMismatch" in out and "rank 2" in out


def test_without_the_plugin_the_threaded_mismatch_is_not_caught_the_same_way(pytester: pytest.Pytester) -> None:
    """The same threaded file on torch's threaded group: the verdicts of the tests that do not depend on
    dstest's checks are the same; the mismatch is not named as one."""
    pytester.makepyfile(test_threads=textwrap.dedent(THREADED_SUITE))
    result, verdicts = _run(pytester, "-k", "not test_all_reduce", plugin=False)
    assert verdicts["test_fails_on_rank_0"] == "failure" and verdicts["test_skips"] == "skipped"
    assert verdicts["test_redistribute"] == "passed"
    assert "CollectiveMismatch" not in result.stdout.str()


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_continuous_bases_run_each_test_warm_with_upstreams_answers(pytester: pytest.Pytester, checked: bool) -> None:
    """MultiProcContinuousTest: a pass, a skip, a rank that raised (its peer, blocked in an all_reduce, is
    stopped with its stack, not left until the 300 s timeout) and upstream's "skip the rest of the class
    after a failure". The classes' rendezvous files are gone afterwards. On checked groups (the default) the
    blocked peer's checked call is failed by the referee and its pool stays; on torch's own gloo
    (--dstest-unchecked) the peer is stuck in gloo and its pool is replaced."""
    pytester.makepyfile(test_continuous=textwrap.dedent(CONTINUOUS_SUITE))
    temp = Path(tempfile.gettempdir())  # the run's too (a TMPDIR of its own can be too long for a socket path)
    before = set(temp.glob("dstest-rdvz-*"))
    result, verdicts = _run(pytester, *([] if checked else ["--dstest-unchecked"]))
    assert sorted(set(temp.glob("dstest-rdvz-*")) - before) == []
    assert verdicts == {
        "test_a_all_reduce": "passed",
        "test_b_rank_1_raises_before_its_collective": "failure",
        "test_c_after_a_failure": "skipped",
        "test_skip": "skipped",
    }, result.stdout.str()[-6000:]
    out = result.stdout.str()
    assert "Exception in worker process (rank 1):" in out and "ValueError: rank 1 gives up" in out
    assert "ranks [0] were stopped after another rank's failure" in out
    replaced = (
        "pool replaced after: test_continuous.py::Continuous::test_b_rank_1_raises_before_its_collective: "
        "a rank failed while its peers were blocked"
    )
    assert (replaced in out) is not checked
    result.stdout.fnmatch_lines(["*Previous test failed, skipping*", "*not on this machine*"])


CHECKED_SUITE = """
import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed as cd
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

cd.TIMEOUT_OVERRIDE["test_sizes_differ"] = 6
c10d_ops = torch.ops.c10d
funcol = torch.ops.c10d_functional


class Counted(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_counts(self):
        mesh = self.build_device_mesh()
        comm_mode = CommDebugMode()
        with comm_mode:
            dist.all_reduce(torch.ones(3))
            out = torch.empty(4)
            dist.all_gather_into_tensor(out, torch.ones(2))
            sharded = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
            sharded.redistribute(mesh, [Replicate()])
        counts = comm_mode.get_comm_counts()
        self.assertEqual(counts[c10d_ops.allreduce_], 1)
        self.assertEqual(counts[c10d_ops._allgather_base_], 1)
        self.assertEqual(counts[funcol.all_gather_into_tensor], 1)
        self.assertEqual(comm_mode.get_total_counts(), 4)  # distribute_tensor's broadcast too


class Desync(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_sizes_differ(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)
        dist.all_reduce(torch.ones(3 + self.rank))
"""


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_process_bases_run_on_checked_groups_the_dispatcher_sees(pytester: pytest.Pytester, checked: bool) -> None:
    """contract F2 and E16: the gloo groups a test on the process-based bases forms are dstest's checked
    groups by default: ``CommDebugMode`` counts what it counts on torch's gloo (upstream's assertions pass
    on both), and ranks whose collectives differ fail at once with the difference named, where torch's own
    gloo (``--dstest-unchecked``) gives no such report."""
    suite = textwrap.dedent(CHECKED_SUITE)
    if not checked:  # torch's gloo leaves the ranks blocked until the timeout: a shorter one, the same verdict
        suite = suite.replace('TIMEOUT_OVERRIDE["test_sizes_differ"] = 6', 'TIMEOUT_OVERRIDE["test_sizes_differ"] = 2')
        assert 'TIMEOUT_OVERRIDE["test_sizes_differ"] = 2' in suite
    pytester.makepyfile(test_checked=suite)
    result, verdicts = _run(pytester, *([] if checked else ["--dstest-unchecked"]))
    out = result.stdout.str()
    assert verdicts == {"test_counts": "passed", "test_sizes_differ": "failure"}, out[-6000:]
    named = "CollectiveMismatch" in out and "all_reduce" in out and "float32[3]" in out and "float32[4]" in out
    assert named is checked, out[-6000:]


def test_a_test_marked_for_a_fresh_process_runs_on_the_bases_own_processes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fresh=textwrap.dedent(
            """
            import os
            import pytest
            import torch.distributed as dist
            from torch.testing._internal.common_distributed import MultiProcessTestCase

            class Fresh(MultiProcessTestCase):
                world_size = 2

                def setUp(self):
                    super().setUp()
                    self._spawn_processes()

                @pytest.mark.dstest_fresh_process("it checks its own pid is new")
                def test_fresh(self):
                    dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)
                    dist.barrier()

            class OwnJoin(MultiProcessTestCase):
                world_size = 2

                def setUp(self):
                    super().setUp()
                    self._spawn_processes()

                def _join_processes(self, fn):
                    super()._join_processes(fn)

                def test_own_join(self):
                    dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)
                    dist.barrier()
            """
        )
    )
    result, verdicts = _run(pytester)
    assert verdicts == {"test_fresh": "passed", "test_own_join": "passed"}, result.stdout.str()[-4000:]
    result.stdout.fnmatch_lines(
        [
            "*0 process-based tests ran on warm workers*2 on their base's own processes*",
            "*own processes: test_fresh.py::Fresh::test_fresh: it checks its own pid is new*",
            "*own processes: test_fresh.py::OwnJoin::test_own_join: OwnJoin._join_processes is the class's own*",
        ]
    )


def test_a_base_without_the_steps_it_adapts_to_is_refused_with_the_class_and_torch_version() -> None:
    import torch

    from dstest.compat._torch_launch import TorchState, adapt_process_base

    class Odd:
        def _start_processes(self, how):  # not (self, proc)
            pass

        def _join_processes(self, fn):
            pass

        def _check_return_codes(self, fn, elapsed):
            pass

    with pytest.raises(
        pytest.UsageError, match=rf"Odd.*torch {re.escape(torch.__version__)}.*_start_processes\(self, proc\)"
    ):
        adapt_process_base(TorchState(), Odd)


# -- traces and flight-recorder dumps (contracts G1, G6; issue 43 item 4) ------------------------------------
TRACED_SUITE = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest, MultiProcessTestCase, MultiThreadedTestCase,
)
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class Comms(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_comms_passes(self):
        dist.all_reduce(torch.ones(3))


class Desync(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_desync_sizes_differ(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(3 + self.rank))


class Threads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_threads_pass(self):
        dist.all_reduce(torch.ones(3))

    def test_threads_sizes_differ(self):
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(3 + self.rank))


class Continuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_passes(self):
        dist.all_reduce(torch.ones(3))

    def test_b_sizes_differ(self):
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(3 + self.rank))
"""

#: The tests of TRACED_SUITE as their file names begin (the test id made readable), by verdict.
_TRACED_PASS = ("Comms_test_comms_passes", "Threads_test_threads_pass", "Continuous_test_a_passes")
_TRACED_FAIL = (
    "Desync_test_desync_sizes_differ",
    "Threads_test_threads_sizes_differ",
    "Continuous_test_b_sizes_differ",
)
_DIGEST = "-" + "[0-9a-f]" * 10  # the digest of the whole id that ends every such name


def _all_reduces(events: list[dict[str, Any]], rank: int) -> list[Any]:
    """The shapes of the all_reduces a rank's track shows, in order."""
    return [
        ev["args"]["shapes"] for ev in events if ev["ph"] == "X" and ev["tid"] == rank and ev["name"] == "all_reduce"
    ]


def test_torch_bases_write_a_trace_and_dumps_of_every_run_as_specs_do(pytester: pytest.Pytester) -> None:
    """G1, G6 on torch's bases: with --dstest-trace every world run of a test on DTensorTestBase,
    MultiProcessTestCase, MultiThreadedTestCase and MultiProcContinuousTest writes DIR/<test id>.json
    (Chrome-trace JSON naming each rank's collectives, with their shapes) and its flight-recorder dumps
    DIR/<test id>.fr/run-1, passing or failing; a failing test's report names its dumps as a spec's does."""
    import json

    from test_trace import check_chrome_trace

    from dstest.trace import FR_PREFIX

    pytester.makepyfile(test_traced=TRACED_SUITE)
    result, verdicts = _run(pytester, "-p", "no:randomly", "--dstest-trace=traces")
    out = result.stdout.str()
    assert verdicts == {
        "test_comms_passes": "passed", "test_threads_pass": "passed", "test_a_passes": "passed",
        "test_desync_sizes_differ": "failure", "test_threads_sizes_differ": "failure", "test_b_sizes_differ": "failure",
    }, out[-6000:]  # fmt: skip
    traces = pytester.path / "traces"
    for name in (*_TRACED_PASS, *_TRACED_FAIL):
        (trace,) = traces.glob(f"test_traced.py_{name}{_DIGEST}.json")
        text = trace.read_text()
        events = check_chrome_trace(json.loads(text))
        assert "test_traced.py::" + name.replace("_test", "::test", 1) in text, name  # the run's label
        for rank in (0, 1):
            expected = [[[3]]] if name in _TRACED_PASS else [[[2]], [[3 + rank]]]
            assert _all_reduces(events, rank) == expected, (name, rank, events)
        dumps = traces / (trace.name[: -len(".json")] + ".fr") / "run-1"
        assert sorted(os.listdir(dumps)) == [f"{FR_PREFIX}0", f"{FR_PREFIX}1"], name
    for name in _TRACED_FAIL:  # the failure report itself names the dumps of its run, and each rank's last calls
        result.stdout.fnmatch_lines([f"*flight-recorder dumps of this run: traces/test_traced.py_{name}-*.fr/run-1*"])
    assert out.count("last calls of each rank") >= len(_TRACED_FAIL), out[-6000:]


def test_a_failing_torch_bases_test_leaves_its_trace_in_the_cache_and_names_its_dumps(
    pytester: pytest.Pytester,
) -> None:
    """G1, G6 on torch's bases: without --dstest-trace a failing test's trace goes to pytest's cache (a
    passing one's nowhere), as a spec's does, though the bases report a failure through unittest's result
    rather than by raising; with --dstest-flight-recorder DIR each failing run writes its dumps to
    DIR/<test id>/run-1, which its failure report names, and a passing one writes none."""
    import pickle

    from dstest.trace import FR_PREFIX

    pytester.makepyfile(test_traced=TRACED_SUITE)
    result, outcomes = run_with_outcomes(
        pytester, "-p", "dstest.compat.torch", "-p", "no:randomly", "--dstest-flight-recorder=fr"
    )
    out = result.stdout.str()
    assert {k: v[0] if v else "passed" for k, v in outcomes.items()} == {
        "test_comms_passes": "passed", "test_threads_pass": "passed", "test_a_passes": "passed",
        "test_desync_sizes_differ": "failure", "test_threads_sizes_differ": "failure", "test_b_sizes_differ": "failure",
    }, out[-6000:]  # fmt: skip
    cached = pytester.path / ".pytest_cache" / "d" / "dstest-traces"
    assert cached.is_dir(), out[-6000:]
    for name in _TRACED_FAIL:  # the failure report's "dstest trace" section names the file
        assert len(list(cached.glob(f"test_traced.py_{name}{_DIGEST}.json"))) == 1, (name, sorted(cached.iterdir()))
        result.stdout.fnmatch_lines([f"*dstest-traces/test_traced.py_{name}-*.json (open in https://ui.perfetto.dev*"])
    assert len(list(cached.iterdir())) == len(_TRACED_FAIL), sorted(cached.iterdir())
    fr = pytester.path / "fr"
    assert len(list(fr.iterdir())) == len(_TRACED_FAIL), sorted(fr.iterdir())
    for name in _TRACED_FAIL:
        (folder,) = fr.glob(f"test_traced.py_{name}{_DIGEST}")
        dumps = folder / "run-1"
        sizes = {}
        for rank in (0, 1):
            with open(dumps / f"{FR_PREFIX}{rank}", "rb") as f:
                sizes[rank] = [
                    e["input_sizes"] for e in pickle.load(f)["entries"] if "all_reduce" in e["profiling_name"]
                ]
        assert sizes == {0: [[[2]], [[3]]], 1: [[[2]], [[4]]]}, (name, sizes)
        result.stdout.fnmatch_lines(
            [f"*flight-recorder dumps of this run: fr/{folder.name}/run-1 (read them with: python -m *{FR_PREFIX})"]
        )


PRELOAD_SUITE = """
import os
import sys

import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

import {lib}


class Preloaded(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_where_the_library_was_imported(self):
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, init_method=f"file://{{self.file_name}}")
        with open(os.path.join(os.environ["WHERE_DIR"], f"rank{{self.rank}}"), "w") as f:
            f.write(f"{{{lib}.IMPORTED_IN}} {{os.getpid()}} {{len([m for m in sys.modules if m.startswith('{lib}')])}}")
        dist.destroy_process_group()
"""


def _library(root: Path, name: str, modules: int, fails_in_server: bool = False) -> None:
    """A package of ``modules`` submodules, each imported by the package; it records the pid that imported it.
    ``fails_in_server``: its import raises in multiprocessing's fork server (the one process started as
    ``python -c`` that is not a child of multiprocessing), and only there."""
    pkg = root / name
    pkg.mkdir()
    body = "import os\nIMPORTED_IN = os.getpid()\n" + "".join(f"from . import m{i}\n" for i in range(modules))
    if fails_in_server:
        body = (
            "import multiprocessing, sys\n"
            "if sys.argv[:1] == ['-c'] and multiprocessing.parent_process() is None:\n"
            "    raise RuntimeError('not in the fork server')\n"
        ) + body
    (pkg / "__init__.py").write_text(body)
    for i in range(modules):
        (pkg / f"m{i}.py").write_text(f"VALUE = {i}\n")


@pytest.mark.parametrize(
    ("modules", "fails_in_server", "args"),
    [(80, False, ()), (3, False, ()), (3, True, ()), (80, False, ("-n", "2"))],
    ids=["library", "helper", "fails-in-server", "library-xdist"],
)
def test_what_the_collection_imported_is_imported_once_by_the_fork_server(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    modules: int,
    fails_in_server: bool,
    args: tuple[str, ...],
) -> None:
    """A test file that imports a library the bases do not (81 modules, or a helper of 4): the fork server,
    started before collection, is fed what the collection imported and imports it too, before its first
    worker, so every worker starts with it (imported in another process than the rank's own). A module
    whose import fails in the server is passed over there, and each worker imports it at its first test, as
    without the feed. The verdicts are the same either way."""
    where = pytester.path / "where"
    where.mkdir()
    monkeypatch.setenv("WHERE_DIR", str(where))
    name = f"lib{modules}{'x' if fails_in_server else ''}"
    _library(pytester.path, name, modules, fails_in_server)
    pytester.makepyfile(test_preload=PRELOAD_SUITE.format(lib=name))
    result, verdicts = _run(pytester, *args)  # under -n 2: by the server of the xdist worker that runs the test
    assert verdicts == {"test_where_the_library_was_imported": "passed"}, result.stdout.str()[-4000:]
    seen = [p.read_text().split() for p in sorted(where.iterdir())]
    assert len(seen) == 2 and all(count == str(modules + 1) for _, _, count in seen), seen
    if fails_in_server:
        assert all(imported == pid for imported, pid, _ in seen), seen  # by the rank itself
    else:
        assert all(imported != pid for imported, pid, _ in seen), seen  # by the server, before the fork


def test_a_running_fork_server_is_not_fed(tmp_path: Path) -> None:
    """A session whose fork server runs already (a warm session's, a fork of its own process, which has
    imported what the session imports) does not feed it: nothing is written, and feeding does nothing."""
    from dstest.worlds.process import launch

    assert launch.start_fork_server()  # this process's server, running from now on (or already)
    feed = tmp_path / "feed"
    assert launch.fork_server_pid() is not None
    assert launch.start_fork_server_fed(str(feed)) is False
    assert launch.feed_fork_server(["json"]) is False
    assert not feed.exists()


def test_a_warm_rerun_starts_its_workers_with_what_the_collection_imported(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--dstest-warm``: the warm server imports what the cold run fed its fork server, so that a forked
    run's workers start with the test file's library imported (by the warm server, before the forks), as the
    cold run's did, instead of importing it in every worker."""
    warm_dir = tmp_path_factory.mktemp("warm")
    os.chmod(warm_dir, 0o700)
    monkeypatch.setenv("DSTEST_WARM_DIR", str(warm_dir))
    monkeypatch.setenv("DSTEST_WARM_IDLE", "120")
    where = pytester.path / "where"
    where.mkdir()
    monkeypatch.setenv("WHERE_DIR", str(where))
    _library(pytester.path, "libwarm", 3)
    pytester.makepyfile(test_preload=PRELOAD_SUITE.format(lib="libwarm"))
    try:
        runs = []
        for attempt in range(2):
            result, verdicts = _run(pytester, "--dstest-warm")
            assert verdicts == {"test_where_the_library_was_imported": "passed"}, result.stdout.str()[-4000:]
            header = next((line for line in result.outlines if line.startswith("dstest warm:")), "")
            runs.append((header, [p.read_text().split() for p in sorted(where.iterdir())]))
            if attempt == 0:
                wait_for_server(warm_dir)
    finally:
        stop_servers()
    (cold_header, cold), (warm_header, warm) = runs
    assert cold_header.startswith("dstest warm: cold run"), cold_header
    assert warm_header.startswith("dstest warm: forked from a warm server"), warm_header
    for seen in (cold, warm):
        assert len(seen) == 2 and all(imported != pid for imported, pid, _ in seen), runs
    assert warm[0][0] == warm[1][0], runs  # one import, before both ranks were forked
