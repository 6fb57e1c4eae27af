"""The process world (warm gloo worker pools) and the NCCL world's skip path.

Pools cost a few seconds to start (spawn, import torch, form the group), so every test here reuses the
pools of world sizes 1, 2 and 4 that the first tests warm; the failure tests replace the pool of 2.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import InvalidArgument, RankFailure, WorkerDied, WorldAborted, WorldTimeout
from dstest.specification import Case, Settings, run_spec, spec_info
from dstest.worlds import process
from dstest.worlds.process import ProcessWorld, pool_pids
from dstest.worlds.process.pool import FAILURE_GRACE
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

pytestmark = pytest.mark.cpu

PROCESS = ProcessWorld()
BOTH = ["threaded", "process"]


@pytest.fixture(scope="module", autouse=True)
def _warm_pools():
    PROCESS.prestart([1, 2, 4])  # in the background, while the threaded cases run


# -- one spec file, two worlds ------------------------------------------------------------------------


@dstest.spec(world_size=[1, 2, 4], worlds=BOTH, contract="E1")
def test_collectives_agree(ctx):
    n = ctx.world_size
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 3
    b = torch.full((2,), float(ctx.rank))
    dist.broadcast(b, src=n - 1)
    assert b.tolist() == [n - 1.0] * 2
    out = [torch.empty(1) for _ in range(n)]
    dist.all_gather(out, torch.tensor([float(ctx.rank)]))
    assert [x.item() for x in out] == list(range(n))
    assert dist.get_rank() == ctx.rank and dist.get_world_size() == n


@pytest.mark.parametrize("round_", [1, 2, 3])
@dstest.spec(world_size=[2, 4], worlds=BOTH, contract="E4")
def test_groups_of_one_run_do_not_reach_the_next(ctx, round_):
    # Every round creates groups anew on the same warm ranks; ranks that kept the last run's groups, their
    # names or their store keys would hang, count on from the last run's names or see its keys here.
    evens = dist.new_group([r for r in range(ctx.world_size) if r % 2 == 0])
    solo = dist.new_group([ctx.world_size - 1])
    names = {"1": ctx.rank % 2 == 0, "2": ctx.rank == ctx.world_size - 1}  # as a fresh world names them
    for name, group in zip(names, (evens, solo), strict=True):
        if names[name]:
            assert dist.distributed_c10d._get_process_group_name(group) == name
    if ctx.rank == 0:
        assert dist.distributed_c10d._get_default_store().add("dstest-test-round", 1) == 1
    t = torch.ones(1)
    if ctx.rank % 2 == 0:
        dist.all_reduce(t, group=evens)
        assert t.item() == len(range(0, ctx.world_size, 2))
    if ctx.rank == ctx.world_size - 1:
        dist.all_reduce(t, group=solo)
    assert dist.get_world_size() == ctx.world_size


@dstest.spec(world_size=[2, 4], worlds=BOTH, contract="E1")
def test_send_recv_ring(ctx):
    n, r = ctx.world_size, ctx.rank
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert got.tolist() == [float((r - 1) % n)] * 2


@pytest.mark.parametrize("scale", [1.0, 2.5])
@dstest.spec(world_size=[2], worlds=BOTH)
def test_params_and_fixtures_reach_process_ranks(ctx, scale, tmp_path):
    t = torch.full((1,), scale)
    dist.all_reduce(t)
    assert t.item() == scale * ctx.world_size
    assert tmp_path.exists()


@dstest.spec(world_size=[2, 4], worlds=["process"])
def test_process_ranks_are_real_processes(ctx):
    # What DeepSpeed reads from the environment, and state that is per process, not per thread.
    assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == str(ctx.rank)
    assert os.environ["WORLD_SIZE"] == str(ctx.world_size)
    assert int(os.environ["MASTER_PORT"]) > 0  # DS_ACCELERATOR comes from the deepspeed target, not the world
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    assert len(set(pids)) == ctx.world_size and os.getpid() != os.getppid()
    assert dist.get_backend() == "gloo" and ctx.world == "process"
    a = torch.randn(256, 256, generator=ctx.generator)
    assert torch.allclose(a @ torch.eye(256), a)  # intra-op threads work in a forked worker


# -- run() directly: results, seeds, errors ----------------------------------------------------------------


def _draw_and_reduce(ctx, offset):
    t = ctx.randn(4) + offset
    dist.all_reduce(t)
    return [round(x, 5) for x in t.tolist()], ctx.randint(0, 1000, (3,)).tolist()


def own_world_first_importing_dnn(ctx, path):
    """As torch's bases run a test on a warm worker: the test forms its own world, and first imports
    torch.distributed.nn.functional inside it (torch binds ``group=group.WORLD`` defaults at import)."""
    from dstest.worlds import torch_internals

    with torch_internals.hidden_c10d_world(checked=False):
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=ctx.rank, world_size=ctx.world_size)
        try:
            import torch.distributed.nn.functional as dnn

            return dnn.broadcast(torch.full((1,), float(ctx.rank + 1)), src=0).item()
        finally:
            dist.destroy_process_group()


def dnn_broadcast(ctx):
    import torch.distributed.nn.functional as dnn

    return dnn.broadcast(torch.full((1,), float(ctx.rank + 5)), src=0).item()


def test_a_world_a_test_formed_is_not_bound_into_later_tests_by_an_import():
    """A later test's ``dnn.broadcast`` on its default group works on the same warm workers (failed with
    "Group ... is not registered": the earlier test's world was bound as the default at its import)."""
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"dstest-dnn-{uuid.uuid4().hex}")
    assert dstest.run(own_world_first_importing_dnn, 2, world="process", args=(path,)) == [1.0, 1.0]
    assert dstest.run(dnn_broadcast, 2, world="process") == [5.0, 5.0]


def test_results_and_seeds_match_the_threaded_world():
    for ws in (1, 4):
        want = ThreadedWorld().run(RunRequest(_draw_and_reduce, ws, args=(0.5,), seed=7))
        assert PROCESS.run(RunRequest(_draw_and_reduce, ws, args=(0.5,), seed=7)) == want
        assert PROCESS.run(RunRequest(_draw_and_reduce, ws, args=(0.5,), seed=7)) == want  # run after run (E5)


def _global_rng(ctx):
    return torch.rand(2).tolist()


def test_global_rng_is_seeded_per_rank_and_run():
    first = PROCESS.run(RunRequest(_global_rng, 2, seed=3))
    assert first == PROCESS.run(RunRequest(_global_rng, 2, seed=3))
    assert first[0] != first[1] and first != PROCESS.run(RunRequest(_global_rng, 2, seed=4))


def _compare(ctx, got):
    assert got == 3


def test_failed_assert_shows_values_like_pytest():
    with pytest.raises(RankFailure) as info:
        PROCESS.run(RunRequest(_compare, 1, args=(2,)))
    assert "assert 2 == 3" in str(info.value)


def _chatty(ctx):
    print(f"hello from {ctx.rank}")


def test_rank_output_reaches_the_test_capture(capsys):
    PROCESS.run(RunRequest(_chatty, 2))
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_functions_must_be_reachable_by_name():
    def local(ctx):
        return 1

    with pytest.raises(InvalidArgument, match="module level"):
        PROCESS.run(RunRequest(local, 1))
    with pytest.raises(InvalidArgument, match="module level"):
        PROCESS.run(RunRequest(lambda ctx: 1, 1))


def _unpicklable(ctx):
    return lambda: None


def test_unpicklable_result_is_a_rank_failure():
    with pytest.raises(RankFailure, match="cannot be pickled"):
        PROCESS.run(RunRequest(_unpicklable, 1))


@dstest.spec(world_size=[2], worlds=["process"])
def _skips_everywhere(ctx):
    pytest.skip("not on this target")


def test_skip_on_every_rank_skips_the_item():
    with pytest.raises(pytest.skip.Exception, match="not on this target"):
        run_spec(spec_info(_skips_everywhere), Case(world="process", world_size=2), Settings(), {})


# -- failures: clear errors, nothing left behind, the pool usable again -----------------------------------


def _workers_below_me() -> set[int]:
    """Live dstest workers descending from this process (psutil-free /proc scan; workers name themselves
    ``dstest-r<rank>`` and are children of multiprocessing's fork server, itself a child of ours)."""
    parent, comm = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        if fields[0] != "Z":
            parent[int(entry)], comm[int(entry)] = int(fields[1]), name.split("(", 1)[1]

    def below_me(pid):
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return {pid for pid in parent if comm[pid].startswith("dstest-r") and below_me(pid)}


def _assert_replaced(old: list[int]) -> None:
    for pid in old:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} of the failed pool survived"
    assert PROCESS.run(RunRequest(_draw_and_reduce, 2, args=(0.0,))) == ThreadedWorld().run(RunRequest(_draw_and_reduce, 2, args=(0.0,)))
    assert set(pool_pids()[("gloo", 2)]).isdisjoint(old)
    live = {pid for pids in pool_pids().values() for pid in pids}
    assert _workers_below_me() <= live, "a worker process outside the live pools survived"


def _old_pids() -> list[int]:
    PROCESS.warm(2)
    return pool_pids()[("gloo", 2)]


def _killed_mid_spec(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_killed_worker_is_reported_and_replaced():
    old = _old_pids()
    with pytest.raises(WorkerDied, match=r"rank 1 \(pid \d+\) was killed by SIGKILL while running _killed_mid_spec"):
        PROCESS.run(RunRequest(_killed_mid_spec, 2, timeout=30))
    _assert_replaced(old)


def _hangs_on_rank_zero(ctx):
    if ctx.rank == 0:
        print("rank 0 going to sleep")
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)


def test_hung_worker_times_out_with_every_stack():
    old = _old_pids()
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        PROCESS.run(RunRequest(_hangs_on_rank_zero, 2, timeout=3))
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "ranks still running: [0, 1]" in msg and "rank 0 going to sleep" in msg
    assert "in _hangs_on_rank_zero" in info.value.stacks[0] and "time.sleep" not in info.value.stacks[1]
    assert "all_reduce" in info.value.stacks[1]
    _assert_replaced(old)


def _raises_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a rank that will never come


def test_rank_failure_short_circuits_blocked_ranks():
    old = _old_pids()
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        PROCESS.run(RunRequest(_raises_on_rank_one, 2, timeout=60))
    assert time.monotonic() - start < FAILURE_GRACE + 5  # not the 60 s timeout, not gloo's
    msg = str(info.value)
    assert "rank 1: ValueError: rank one refuses" in msg and "---- rank 1 ----" in msg
    # rank 0, blocked in all_reduce, is told at once that rank 1 failed: the pool survives
    assert isinstance(info.value.exceptions[0], WorldAborted) and "all_reduce" in info.value.failures[0]
    assert pool_pids()[("gloo", 2)] == old


def _fails_after_collectives(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert ctx.rank == 0, f"rank {ctx.rank} objects"


def test_failure_after_collectives_keeps_the_pool():
    old = _old_pids()
    with pytest.raises(RankFailure, match="rank 1 objects"):
        PROCESS.run(RunRequest(_fails_after_collectives, 2))
    assert pool_pids()[("gloo", 2)] == old
    assert PROCESS.run(RunRequest(_draw_and_reduce, 2, args=(1.0,))) == ThreadedWorld().run(RunRequest(_draw_and_reduce, 2, args=(1.0,)))


def _destroys_the_world_group(ctx):
    dist.destroy_process_group()
    return ctx.rank


def test_spec_that_destroys_the_world_group_gets_a_fresh_pool():
    old = _old_pids()
    assert PROCESS.run(RunRequest(_destroys_the_world_group, 2)) == [0, 1]
    _assert_replaced(old)


# -- the plugin: xdist, and the GPU skip path -------------------------------------------------------------

XDIST_SPECS = """
import os, torch, torch.distributed as dist
import dstest

@dstest.spec(world_size=[2], worlds=["process"])
def test_a(ctx):
    with open(os.path.join(os.environ["PIDS_DIR"], str(os.getpid())), "w"):
        pass
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

test_b = test_c = test_d = test_a
"""


def test_xdist_runs_process_specs_and_leaves_no_process(pytester: pytest.Pytester, monkeypatch):
    pids_dir = pytester.mkdir("pids")
    monkeypatch.setenv("PIDS_DIR", str(pids_dir))
    pytester.makepyfile(XDIST_SPECS)
    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "2", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=4)
    pids = [int(p.name) for p in pids_dir.iterdir()]
    assert len(pids) >= 4  # two xdist workers, a pool of 2 each (or one pool when one worker ran all)
    time.sleep(0.5)  # orphans would be reparented, not gone; give exiting workers a moment
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                assert not f.read().startswith("dstest-r"), f"pool worker {pid} outlived the session"
        except OSError:
            pass  # gone: good


GPU_SPECS = """
import dstest

@dstest.spec(world_size=[2, 4], worlds=["process", "nccl"])
def test_sum(ctx):
    pass
"""


def test_gpu_marker_collects_nccl_items_and_skips_them(pytester: pytest.Pytester, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the skip path is for GPU-less machines")
    # The inline session's pytest_unconfigure would stop this session's warm pools; keep them.
    monkeypatch.setattr(process, "shutdown_all", lambda: None)
    pytester.makepyfile(GPU_SPECS)
    result = pytester.runpytest("-m", "gpu", "-rs", "-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        [
            "*test_sum?nccl-ws2? SKIPPED*",
            "*SKIPPED*needs 2 CUDA devices, found 0*",
            "*SKIPPED*needs 4 CUDA devices, found 0*",
            "*2 skipped, 2 deselected*",
        ]
    )


def _reads_accelerator(ctx):
    return os.environ.get("DS_ACCELERATOR")


def test_a_plain_function_gets_its_targets_environment_in_the_process_world():
    """dstest.run sends a RankCall: the function by reference, the target binding by pickle (issue 12.2)."""
    assert dstest.run(_reads_accelerator, 2, world="process", target="deepspeed") == ["cpu", "cpu"]


# -- the worker's heap -----------------------------------------------------------------------------------

_LEFT: dict[str, object] = {}  # in each worker: what the runs below leave there


class _Node:
    pass


def _import_and_drop_a_cycle(ctx, module_dir, module):
    import importlib
    import sys
    import weakref

    sys.path.insert(0, module_dir)
    try:
        importlib.import_module(module)  # a module no worker imported yet
    finally:
        sys.path.remove(module_dir)
    node = _Node()
    node.me = node  # garbage once the run returns: only the cyclic collector can free it
    _LEFT["cycle"] = weakref.ref(node)
    _LEFT["frozen_before"] = __import__("gc").get_freeze_count()


def _after_the_run(ctx):
    import gc

    return _LEFT["cycle"]() is None, gc.get_freeze_count() > _LEFT["frozen_before"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_run_that_imports_has_its_garbage_collected_and_its_modules_frozen(world_size, tmp_path):
    # E11 (resources released): collections in code under test (DeepSpeed's gc.collect() calls) then skip
    # what the worker holds for good; the run's own cyclic garbage is collected first, not frozen with it.
    module = f"dstest_heap_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text("VALUES = list(range(10))\n")
    PROCESS.run(RunRequest(_import_and_drop_a_cycle, world_size, args=(str(tmp_path), module)))
    assert PROCESS.run(RunRequest(_after_the_run, world_size)) == [(True, True)] * world_size


# -- the public API compat plugins use (dstest.worlds.process.byref) ---------------------------------------
def _reimport_this_module(ctx, ref):
    """On a rank: the test module found again through its reference, and a rank that asks to be replaced."""
    from dstest.worlds.process import byref

    module = byref.import_module_ref(ref)
    if ctx.rank == 1:
        byref.replace_after_this_run("this test asks for fresh workers")
    return module.__name__, os.getpid()


def test_byref_finds_a_module_on_the_ranks_and_replaces_a_worker_that_asks():
    """module_ref / import_module_ref reach the test module on every rank; a rank's replace_after_this_run
    gives the next run fresh processes (the run's own result still comes back); free_port gives a port."""
    from dstest.worlds.process import byref

    ref = byref.module_ref(sys.modules[__name__])
    assert ref.module == __name__ and ref.path == os.path.abspath(__file__)
    first = PROCESS.run(RunRequest(_reimport_this_module, 2, args=(ref,), timeout=60))
    assert [name for name, _ in first] == [__name__, __name__]
    PROCESS.run(RunRequest(_draw_and_reduce, 2, args=(0,), timeout=60))
    assert not set(byref.pool_pids(2)) & {pid for _, pid in first}  # rank 1 asked: the pool was replaced
    port = byref.free_port()
    assert isinstance(port, int) and 0 < port < 65536


# -- module-level state a run leaves behind (RunRequest.watch_modules, state_watch) -------------------------
LEAKY_SETTING = "fresh"
LEAKY_LIST: list[int] = []


def _leave_state(ctx):
    """What a library's test might do to its module: rebind a global, grow a list in place, add a name."""
    global LEAKY_SETTING
    LEAKY_SETTING = f"set by rank {ctx.rank}"
    LEAKY_LIST.append(ctx.rank)
    globals()["LEAKY_NEW"] = ctx.rank


def _read_state(ctx):
    return LEAKY_SETTING, list(LEAKY_LIST), "LEAKY_NEW" in globals()


def test_state_a_run_leaves_in_a_watched_module_is_put_back_and_named():
    """The next run starts as a fresh process would: each change put back, each named in one warning."""
    from dstest.errors import StateLeftBehind

    request = RunRequest(_leave_state, 2, watch_modules=(__name__,), timeout=60)
    with pytest.warns(StateLeftBehind) as caught:
        PROCESS.run(request)
    (warning,) = caught
    text = str(warning.message)
    assert f"{__name__}.LEAKY_SETTING: rebound to a str; put back" in text
    assert f"{__name__}.LEAKY_LIST: its list changed in place; contents put back" in text
    assert f"{__name__}.LEAKY_NEW: added by the run (int); removed" in text
    again = PROCESS.run(RunRequest(_read_state, 2, watch_modules=(__name__,), timeout=60))
    assert again == [("fresh", [], False)] * 2


def test_unwatched_state_reaches_the_next_run_of_a_warm_worker():
    """Without the watch (a pool of its own: 3 ranks), the same run's changes reach the next run: what the
    watch is for."""
    PROCESS.run(RunRequest(_leave_state, 3, timeout=60))
    got = PROCESS.run(RunRequest(_read_state, 3, timeout=60))
    assert [(setting, seen) for setting, seen, _ in got] == [(f"set by rank {r}", [r]) for r in range(3)]


def test_watch_modules_is_checked_when_the_request_is_made():
    with pytest.raises(InvalidArgument, match=r"watch_modules=\['deep speed'\]: give module names or prefixes"):
        RunRequest(_read_state, 2, watch_modules=["deep speed"])
    for world in ("threaded", "fake"):  # rank threads share one process's modules: nothing to compare with
        with pytest.raises(InvalidArgument, match=rf"watch_modules=\('mypkg',\): the {world} world does not watch"):
            dstest.get_world(world).run(RunRequest(_read_state, 2, watch_modules=("mypkg",)))


def test_e4_fork_server_preloads_from_the_sessions_sys_path(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package the conftest puts in front of an installed copy (DeepSpeed's conftest does so with its
    checkout) is the copy the warm workers run, as in a fresh process with the session's sys.path; the fork
    server imports its preloads with the session's path, not the interpreter's default one."""
    for where in ("installed", "checkout"):
        pkg = pytester.path / where / "probe_pkg"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"WHERE = {where!r}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path / "installed"), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest(
        """
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "checkout"))

def pytest_configure(config):
    from dstest.worlds.process.byref import preload_in_fork_server
    preload_in_fork_server("probe_pkg")
"""
    )
    pytester.makepyfile(
        test_probe="""
import dstest

@dstest.spec(world_size=2, worlds=("process",))
def test_workers_run_the_checkout(ctx):
    import probe_pkg
    assert probe_pkg.WHERE == "checkout", probe_pkg.__file__

def test_this_process_runs_the_checkout():
    import probe_pkg
    assert probe_pkg.WHERE == "checkout"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=2)
