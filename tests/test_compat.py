"""One test per torch behaviour that dstest/worlds/torch_internals/ (and the group's version hooks) paper over.

The tox matrix (torch 2.11-2.14) runs these against every version.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dstest.worlds import torch_internals
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld
from dstest.worlds.torch_internals import c10d_world, installed

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("warm", [False, True])
def test_rank_threads_have_their_own_c10d_world_and_the_main_thread_keeps_its_own(warm):
    """c10d keeps its world in module globals; each rank thread must see its own default group."""
    seen = ThreadedWorld(warm=warm).run(RunRequest(lambda ctx: (dist.get_rank(), dist.get_world_size()), 3))
    assert seen == [(0, 3), (1, 3), (2, 3)]
    assert not dist.is_initialized()  # the main thread's c10d state is untouched


@pytest.mark.parametrize("warm", [False, True])
def test_init_process_group_does_not_stack_excepthooks(warm):
    """torch 2.13 wraps sys.excepthook in every init_process_group (a "[rankN]" prefix per call)."""
    hook = sys.excepthook
    for _ in range(3):
        ThreadedWorld(warm=warm).run(RunRequest(lambda ctx: None, 4))
    assert sys.excepthook is hook


def test_backward_runs_on_the_rank_thread():
    """Gradient hooks that issue collectives need backward on the rank's own thread (autograd's device
    threads cannot see the rank's thread-local state): multithreaded autograd is off inside a world."""

    def body(ctx):
        w = torch.ones(3, requires_grad=True)
        w.register_hook(lambda g: (dist.all_reduce(g), g)[1])
        (w * (ctx.rank + 1)).sum().backward()
        return torch._C._is_multithreading_enabled(), w.grad.tolist()

    got = ThreadedWorld().run(RunRequest(body, 2))
    assert got == [(False, [3.0, 3.0, 3.0])] * 2


def test_every_reduce_op_has_a_name():
    names = {
        torch_internals.reduce_op_name(getattr(dist.ReduceOp, op))
        for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
    }
    assert names == {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"}


def test_single_tensor_collectives_under_both_names():
    """torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor to *_single; both must work."""

    def body(ctx):
        out = torch.empty(2 * ctx.world_size)
        dist.all_gather_into_tensor(out, torch.full((2,), float(ctx.rank)))
        rs = torch.empty(2)
        dist.reduce_scatter_tensor(rs, torch.ones(2 * ctx.world_size))
        if hasattr(dist, "all_gather_single"):
            out2 = torch.empty_like(out)
            dist.all_gather_single(out2, torch.full((2,), float(ctx.rank)))
            assert torch.equal(out, out2)
        return out.tolist(), rs.tolist()

    got = ThreadedWorld().run(RunRequest(body, 2))
    assert got[0] == ([0.0, 0.0, 1.0, 1.0], [2.0, 2.0])


def test_batch_isend_irecv_without_coalescing_support():
    """torch 2.14 asks the group's backend whether it coalesces before batch_isend_irecv."""

    def body(ctx):
        peer = 1 - ctx.rank
        buf = torch.empty(2)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(ctx.rank)), peer), dist.P2POp(dist.irecv, buf, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buf.tolist()

    assert ThreadedWorld().run(RunRequest(body, 2)) == [[1.0, 1.0], [0.0, 0.0]]


def test_thread_local_world_is_removed_when_the_last_world_ends():
    from dstest.worlds.threaded import shutdown_all

    shutdown_all()  # warm crews of earlier tests hold the thread-local world
    assert installed.INSTALL.users == 0
    original = c10d._world
    ThreadedWorld().run(RunRequest(lambda ctx: None, 2))
    assert c10d._world is original


def test_monitored_barrier_on_a_rank_thread_says_it_is_gloo_only_and_is_restored_afterwards():
    """torch checks monitored_barrier's backend in Python (a bare ValueError, before the group is asked):
    on a rank thread the group answers instead, naming gloo and what to do; the wrapper leaves with the world."""
    from datetime import timedelta

    from dstest.errors import InvalidArgument
    from dstest.worlds.threaded import shutdown_all

    shutdown_all()  # warm crews of earlier tests hold the installation
    original = c10d.monitored_barrier

    def body(ctx):
        assert dist.monitored_barrier is not original
        with pytest.raises(InvalidArgument, match="gloo") as info:
            dist.monitored_barrier(timeout=timedelta(seconds=5))
        assert "world='process'" in str(info.value)
        sub = dist.new_group([0, 1])
        with pytest.raises(InvalidArgument, match="gloo"):
            dist.monitored_barrier(group=sub, timeout=timedelta(seconds=5))
        dist.barrier()
        return True

    assert ThreadedWorld().run(RunRequest(body, 2)) == [True, True]
    assert c10d.monitored_barrier is original and dist.monitored_barrier is original


def _env() -> dict[str, str]:
    """This process's environment, with dstest importable from where this process imports it."""
    import os
    from pathlib import Path

    import dstest

    root = str(Path(dstest.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


_FAKE_GUARD_SCRIPT = """
import threading
from torch._subclasses.fake_tensor import FakeTensorMode
import dstest

def body(ctx):
    def helper():
        with FakeTensorMode():
            pass
    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    with FakeTensorMode():
        pass

for _ in range(30):
    dstest.run(body, 4, world="threaded")
print("survived")
"""


@pytest.mark.skipif(torch.version.cuda is None, reason="the CUDA device guard exists only on CUDA builds of torch")
@pytest.mark.skipif(torch.cuda.is_available(), reason="torch installs its fake CUDA guard only without a GPU")
def test_fake_tensor_mode_on_threads_that_end_does_not_crash_a_cuda_build_without_gpus(tmp_path):
    """E6: torch 2.11's FakeTensorMode (DTensor, FSDP2) on a thread registers a CUDA guard that dies with the
    thread.

    Without dstest's main-thread guard, the next FakeTensorMode dereferences freed memory: a segfault.
    """
    import subprocess

    script = tmp_path / "fake_guard.py"
    script.write_text(_FAKE_GUARD_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "survived" in done.stdout


_DTENSOR_THREADS_SCRIPT = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

def body(ctx):
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    d = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    for _ in range(3):
        d = (d + 1) * 2
    return float(d.to_local().sum())

for _ in range(60):
    assert ThreadedWorld(warm=False).run(RunRequest(body, 8)) == [4 * 22.0] * 8
print("survived")
"""


def test_dtensor_ranks_ending_at_different_times_do_not_deadlock(tmp_path):
    """E6: torch frees and creates its per-thread DTensor sharding cache under one C++ mutex while letting go of
    (or holding) the GIL: ranks that end while others end or start their first DTensor op deadlocked
    (torch 2.11, within a few dozen cold worlds of 8 ranks). dstest creates and frees those caches under
    a Python lock."""
    import subprocess

    script = tmp_path / "dtensor_threads.py"
    script.write_text(_DTENSOR_THREADS_SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail("60 cold threaded worlds of DTensor bodies hung (the DTensor cache deadlock)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "survived" in done.stdout


# -- the per-thread c10d world follows torch's own _World, field by field, without a list ----------------------
def test_no_field_of_torchs_world_object_is_shared_between_rank_threads():
    """Every public field of the running torch's ``distributed_c10d._World`` is per rank thread (torch 2.15
    added ``pg_flight_recorder_hooks``; the next release may add another). The message names the field
    (contract E15)."""
    problems = torch_internals.unisolated_world_fields()
    assert not problems, "torch's c10d world has state dstest does not isolate:\n" + "\n".join(problems)


def test_the_isolation_check_names_a_field_that_is_shared(monkeypatch):
    """The check above can fail: with the override of ``pg_map`` left out, both ranks' tables are torch's
    module global, and the check names ``pg_map``."""
    fields = dict(torch_internals.global_backed_fields())
    del fields["pg_map"]
    monkeypatch.setattr(c10d_world, "global_backed_fields", lambda: fields)
    c10d_world._per_thread_world_class.cache_clear()
    try:
        problems = torch_internals.unisolated_world_fields()
    finally:
        monkeypatch.undo()
        c10d_world._per_thread_world_class.cache_clear()
    assert len(problems) == 1 and "_World.pg_map is one dict shared by every rank thread" in problems[0]
    assert torch.__version__ in problems[0]


def test_fields_torch_keeps_on_its_world_object_are_fresh_per_rank_thread():
    """What torch's ``_World.__init__`` creates (``_pg_coalesce_state``, ``_comms``, 2.15's
    ``_pg_flight_recorder_hooks``) comes from torch's own constructor on every rank thread's state, so a field
    added there needs nothing from dstest; and a rank thread's group tables are its own."""
    seen = ThreadedWorld().run(
        RunRequest(lambda ctx: (type(c10d._world._target()).__mro__[1], set(vars(c10d._world._target()))), 2)
    )
    own = set(vars(c10d._World()))
    for base, fields in seen:
        assert base is c10d._World
        assert own <= fields
    assert not c10d._world.pg_map or dist.is_initialized()  # the main thread's tables are torch's own, untouched


def test_destroying_groups_on_rank_threads_clears_every_table_of_their_own_world():
    """``destroy_process_group`` on a rank thread (torch 2.15 also clears ``pg_flight_recorder_hooks``) works
    on the thread's own state and leaves no group behind in it."""

    def body(ctx):
        dist.new_group([0, 1])
        dist.destroy_process_group()
        state = c10d._world._target()
        return [name for name in dir(type(state)) if name.startswith("pg_") and name != "pg_config_info"
                and isinstance(getattr(state, name), dict) and getattr(state, name)]

    assert ThreadedWorld().run(RunRequest(body, 2)) == [[], []]
