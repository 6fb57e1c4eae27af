"""The threaded world behaves like a world of processes where torch's stacks rely on it, and passes nothing
that did not run, did not match or lost its error (contract E3-E12 on the threaded world; issue 9 items 3-7,
issue 10). Each section names the contracts it checks.

Every desync test asserts the error and that the world's timeout was *not* what ended it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.context import current_context
from dstest.errors import InvalidArgument, RankFailure, WorldTimeout
from dstest.worlds import threaded as threaded_world
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

pytestmark = pytest.mark.cpu
TIMEOUT = 30.0  # generous: every failure below must end the world long before this


def _failure(fn, world_size=2, world=None, **kw) -> RankFailure:
    world = world or ThreadedWorld(warm=True)
    with pytest.raises(RankFailure) as info:
        world.run(RunRequest(fn, world_size, timeout=TIMEOUT, **kw))
    assert not isinstance(info.value, WorldTimeout)
    assert "ran past its timeout" not in str(info.value)
    return info.value


# -- E6 (issue 9.1): groups behave as torch's own ----------------------------------------------------------
def _names_and_destroy(ctx):
    g = dist.new_group(list(range(ctx.world_size)), group_desc="dp")
    name, desc = g.group_name, g.group_desc
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)  # a subgroup alone
    return name, desc, t.item(), dist.get_world_size()


def test_groups_have_names_and_a_subgroup_can_be_destroyed_alone():
    got = ThreadedWorld(warm=True).run(RunRequest(_names_and_destroy, 2, timeout=TIMEOUT))
    assert got[0] == got[1] and got[0][0] and got[0][1:] == ("dp", 2.0, 2)


# -- E7 (issue 9.3): collective results never enter autograd ---------------------------------------------
def _into_leaves(ctx):
    p = torch.nn.Parameter(torch.full((3,), float(ctx.rank)))
    dist.broadcast(p, src=0)  # gloo: allowed, the parameter gets rank 0's values
    q = torch.full((2,), float(ctx.rank + 1), requires_grad=True)
    dist.all_reduce(q)
    r = torch.zeros(2, requires_grad=True)
    if ctx.rank == 0:
        dist.send(torch.full((2,), 7.0), dst=1)
    elif ctx.rank == 1:
        dist.recv(r, src=0)
    return p.tolist(), q.tolist(), r.tolist(), p.grad_fn is None and q.grad_fn is None


def _loss_all_reduced_before_backward(ctx):
    w = torch.full((3,), 2.0, requires_grad=True)
    x = torch.arange(3.0) + ctx.rank
    loss = (w * x).sum()
    dist.all_reduce(loss)
    loss.backward()
    return loss.item(), w.grad.tolist()


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_collectives_into_parameters_and_requires_grad_tensors_behave_as_with_gloo(world):
    got = dstest.run(_into_leaves, 2, world=world, timeout=TIMEOUT)
    assert got[0] == ([0.0] * 3, [3.0, 3.0], [0.0, 0.0], True)
    assert got[1] == ([0.0] * 3, [3.0, 3.0], [7.0, 7.0], True)


def test_a_loss_all_reduced_before_backward_gets_glooss_gradient():
    threaded = dstest.run(_loss_all_reduced_before_backward, 2, world="threaded", timeout=TIMEOUT)
    process = dstest.run(_loss_all_reduced_before_backward, 2, world="process", timeout=TIMEOUT)
    assert threaded == process
    # the single-process reference: d/dw of each rank's own loss (the all_reduce is not differentiated)
    assert threaded[1][1] == [1.0, 2.0, 3.0]


# -- E8 (issue 9.4): every wait path is seen --------------------------------------------------------------
def _ddp_one_extra_step(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    for _ in range(2 if ctx.rank == 1 else 1):
        model(torch.ones(3, 4)).sum().backward()


def test_ddp_desync_is_reported_with_the_pending_call():
    err = _failure(_ddp_one_extra_step)
    text = str(err)
    assert "rank 0 finished its function without joining" in text
    assert 1 in err.exceptions


def _fsdp2_one_extra_forward(ctx):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    for _ in range(2 if ctx.rank == 1 else 1):
        model(torch.ones(3, 4)).sum().backward()


def test_fsdp2_desync_is_reported_with_the_pending_call():
    text = str(_failure(_fsdp2_one_extra_forward))
    assert "rank 0 finished its function without joining" in text


def _dtensor_collective_on_one_rank(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    if ctx.rank == 0:
        d.redistribute(mesh, [Replicate()]).to_local()


def test_dtensor_collective_on_one_rank_only_is_reported():
    text = str(_failure(_dtensor_collective_on_one_rank))
    assert "finished its function without joining all_gather" in text


def _future_waiter_while_peer_raises(ctx):
    if ctx.rank == 0:
        raise ValueError("rank zero breaks first")
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.get_future().wait()


def test_a_future_never_receives_a_base_exception_and_the_first_error_leads_the_report():
    before = {t.name for t in threading.enumerate()}
    err = _failure(_future_waiter_while_peer_raises)
    head = str(err).splitlines()[0]
    assert head.startswith("1 of 2 ranks failed: rank 0: ValueError: rank zero breaks first")
    assert "AssertionError" not in str(err)  # torch's Future.set_exception rejects BaseExceptions
    assert "ranks [1] were aborted" in str(err)
    time.sleep(0.1)
    after = {t.name for t in threading.enumerate() if t.is_alive()}
    assert not {n for n in after - before if n.startswith("dstest-")}


# -- E12 (issue 9.5): threads inside a rank, groups crossing ranks -------------------------------------------
def _helper_thread_acts_as_its_rank(ctx):
    seen = {}

    def helper():
        t = torch.ones(1) * (ctx.rank + 1)
        dist.all_reduce(t)
        seen["rank"], seen["sum"], seen["ctx"] = dist.get_rank(), t.item(), current_context().rank

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    return seen


def test_a_thread_started_by_a_rank_uses_that_ranks_groups():
    got = dstest.run(_helper_thread_acts_as_its_rank, 3, world="threaded", timeout=TIMEOUT)
    assert got == [{"rank": r, "sum": 6.0, "ctx": r} for r in range(3)]


_SHARED: dict[str, object] = {}  # a module-level cache, as Megatron's parallel_state keeps


def _shared_group_cache(ctx):
    group = dist.new_group(list(range(ctx.world_size)))
    _SHARED.setdefault("dp", group)  # the first rank's object wins; every rank then uses it
    dist.barrier()
    cached = _SHARED["dp"]
    t = torch.ones(2) * (ctx.rank + 1)
    dist.all_reduce(t, group=cached)
    b = torch.full((1,), float(ctx.rank))
    dist.broadcast(b, src=1, group=cached)
    return t.tolist(), b.item(), dist.get_rank(cached), dist.get_world_size(cached)


def test_a_group_object_shared_by_all_ranks_acts_for_the_calling_rank():
    _SHARED.clear()
    got = ThreadedWorld(warm=True).run(RunRequest(_shared_group_cache, 3, timeout=TIMEOUT))
    assert got == [([6.0, 6.0], 1.0, r, 3) for r in range(3)]


def _foreign_subgroup(ctx):
    mine = dist.new_group([ctx.rank])  # each rank's own singleton
    if ctx.rank == 0:
        _SHARED["solo"] = mine
    dist.barrier()
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1), group=_SHARED["solo"])


def test_a_group_of_another_rank_raises_naming_both_ranks_and_the_next_run_is_unaffected():
    _SHARED.clear()
    err = _failure(_foreign_subgroup)
    assert isinstance(err.exceptions[1], InvalidArgument)
    assert "belongs to rank 0 but was used by rank 1" in str(err)
    assert ThreadedWorld(warm=True).run(RunRequest(lambda ctx: dist.get_world_size(), 2)) == [2, 2]


# -- E4, E6 (issue 9.6): every world start restores the switches it needs ---------------------------------------
def test_worlds_work_after_torchs_own_threaded_helpers_switched_isolation_off():
    warm = ThreadedWorld(warm=True)
    assert warm.run(RunRequest(lambda ctx: dist.get_world_size(), 2)) == [2, 2]  # a crew is alive and installed
    torch._C._distributed_c10d._set_thread_isolation_mode(False)  # what MultiThreadedTestCase leaves

    def subgroups(ctx):
        return dist.get_world_size(dist.new_group([0, 1]))

    assert warm.run(RunRequest(subgroups, 2)) == [2, 2]
    assert warm.run(RunRequest(subgroups, 3)) == [2, 2, -1]  # a new crew registers its default group "0" per thread
    assert ThreadedWorld().run(RunRequest(subgroups, 2)) == [2, 2]


# -- E5 (issue 9.7): a shared seed gives every rank the same weights ---------------------------------------
def _seeded_model(ctx):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_manual_seed_then_module_construction_gives_every_rank_the_reference_weights():
    torch.manual_seed(1234)  # the single-process reference
    want = torch.cat([p.detach().flatten() for p in torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).parameters()])
    world = ThreadedWorld(warm=True)
    for _ in range(15):
        for got in world.run(RunRequest(_seeded_model, 4, timeout=TIMEOUT)):
            assert torch.equal(got, want)


def test_manual_seed_in_the_fake_world_while_a_warm_crew_holds_the_hooks():
    from dstest.worlds.fake import FakeWorld

    ThreadedWorld(warm=True).run(RunRequest(lambda ctx: None, 2))  # a crew is alive: the seed hook is installed
    got = FakeWorld().run(RunRequest(lambda ctx: (torch.manual_seed(3), torch.rand(1).item())[1], 4))
    torch.manual_seed(3)
    assert got == [torch.rand(1).item()] * 2


# -- E3, E4, E9, E11 (issue 10): nothing passes that did not match, no error is lost, resources bounded ---------------------------------
def test_an_async_all_reduce_never_waited_fails_naming_the_rank_and_the_call():
    def body(ctx):
        dist.all_reduce(torch.ones(2), async_op=True)  # matched by every rank, never waited

    err = _failure(body)
    assert "never waited" in str(err) and "all_reduce(float32[2]@cpu, op=sum)" in str(err)
    assert ThreadedWorld(warm=True).run(RunRequest(lambda ctx: 1, 2)) == [1, 1]


def _all_reduce_async(t):
    return dist.all_reduce(t, async_op=True)


def test_e9_an_unwaited_work_names_where_it_was_issued():
    def forgets_the_first(ctx):
        first = _all_reduce_async(torch.ones(2))  # noqa: F841  (dropped, as a library's wrapper might)
        _all_reduce_async(torch.ones(3)).wait()

    text = str(_failure(forgets_the_first))
    unwaited = [line for line in text.splitlines() if "never waited" in line]
    assert len(unwaited) == 1, text  # the float32[2] call; the float32[3] one was waited
    line = unwaited[0]
    assert "all_reduce(float32[2]@cpu, op=sum)" in line and "issued at tests/test_threaded_strict.py:" in line
    assert "(_all_reduce_async)" in line  # the site only: the threaded world keeps no callers (cost per call)


def test_an_unwaited_collective_still_writes_the_callers_tensor_as_gloo_does():
    kept: dict[int, torch.Tensor] = {}

    def body(ctx):
        kept[ctx.rank] = t = torch.ones(2)
        dist.all_reduce(t, async_op=True)
        dist.barrier()  # every rank has joined the all_reduce; nobody waits it

    err = _failure(body)
    assert "never waited" in str(err)
    assert all(t.tolist() == [2.0, 2.0] for t in kept.values()) and len(kept) == 2


def test_an_unmatched_isend_fails_and_does_not_leak_into_the_next_run():
    def body(ctx):
        if ctx.rank == 0:
            dist.isend(torch.ones(1), dst=1)

    err = _failure(body)
    assert "send(float32[1]@cpu to rank 1" in str(err)

    def matched(ctx):
        t = torch.full((1,), float(ctx.rank))
        if ctx.rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
        return t.item()

    assert ThreadedWorld(warm=True).run(RunRequest(matched, 2)) == [0.0, 0.0]


def test_a_mismatch_caught_by_the_code_under_test_still_fails_and_says_where():
    def body(ctx):
        try:
            dist.all_reduce(torch.ones(2 + ctx.rank))  # shapes differ
        except Exception:  # the code under test swallows it
            pass

    err = _failure(body)
    assert "caught at" in str(err) and "test_threaded_strict.py" in str(err)
    assert "CollectiveMismatch" in str(err)


def test_a_rank_error_is_reported_promptly_while_another_rank_spins_in_python():
    def body(ctx):
        if ctx.rank == 0:
            raise ValueError("the real error")
        while True:  # pure Python: interrupted at the abort, not at the timeout
            pass

    err = _failure(body)
    assert str(err).splitlines()[0].startswith("1 of 2 ranks failed: rank 0: ValueError: the real error")


def test_a_rank_stuck_in_c_code_is_named_never_reused_and_counted():
    def body(ctx):
        if ctx.rank == 0:
            raise ValueError("boom")
        time.sleep(4)  # C code: cannot be interrupted

    err = _failure(body)
    assert "threads that could not be stopped" in str(err)
    stuck = threaded_world.stuck_threads()
    assert any(name.endswith("-rank1") for name in stuck)
    names = ThreadedWorld(warm=True).run(RunRequest(lambda ctx: threading.current_thread().name, 2))
    assert not set(names) & set(stuck)


def test_no_rank_runs_user_code_after_its_world_was_reported():
    ticks = [0]

    def body(ctx):
        if ctx.rank == 0:
            raise ValueError("boom")
        while True:
            ticks[0] += 1

    _failure(body)
    seen = ticks[0]
    time.sleep(0.2)
    assert ticks[0] == seen


def test_warm_crews_are_capped_and_larger_worlds_run_cold(monkeypatch):
    threaded_world.shutdown_all()
    monkeypatch.setenv("DSTEST_WARM_THREADS", "6")
    warm = ThreadedWorld(warm=True)
    for ws in (2, 3, 4, 2):
        assert warm.run(RunRequest(lambda ctx: ctx.rank, ws)) == list(range(ws))
        assert threaded_world.kept_warm_threads() <= 6
    assert warm.run(RunRequest(lambda ctx: ctx.rank, 8)) == list(range(8))  # over the cap: cold
    assert threaded_world.kept_warm_threads() <= 6
    threaded_world.shutdown_all()
    assert threaded_world.kept_warm_threads() == 0


def test_bad_warm_thread_cap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DSTEST_WARM_THREADS", "lots")
    with pytest.raises(InvalidArgument, match="DSTEST_WARM_THREADS='lots'"):
        ThreadedWorld(warm=True).run(RunRequest(lambda ctx: None, 2))


_CTRL_C_SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal, sys, time, torch, torch.distributed as dist
    from dstest.worlds.request import RunRequest
    from dstest.worlds.threaded import ThreadedWorld

    # As at a terminal: a shell's background job (CI run with `&`) inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.dump_traceback_later(15, exit=True)  # a hang shows every thread's stack

    def body(ctx):
        if ctx.rank == 0:
            time.sleep(60)          # C code
        elif ctx.rank == 1:
            dist.all_reduce(torch.ones(1))   # blocked in a collective
        else:
            while True:             # Python
                pass

    if __name__ == "__main__":
        print("started", flush=True)
        ThreadedWorld(warm={warm}).run(RunRequest(body, 3, timeout=120))
    """
)


@pytest.mark.parametrize("warm", [False, True])
def test_ctrl_c_stops_a_world_whatever_its_ranks_do(warm):
    """E11: Ctrl-C ends a threaded world, warm or cold, whatever its ranks are doing (sleeping in C code,
    blocked in a collective, spinning in Python), and the caller gets its KeyboardInterrupt."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_SCRIPT.format(warm=warm)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    time.sleep(1.0)
    proc.send_signal(2)  # SIGINT, as Ctrl-C
    try:
        _, stderr = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the process did not exit after Ctrl-C")
    assert "KeyboardInterrupt" in stderr, stderr


def test_an_interrupted_rank_runs_its_cleanup_to_the_end():
    """E3: the abort interrupts a spinning rank once, not again while it unwinds: its finally clause (here a
    slow one, as a log handler flushing to a slow stream) runs to the end and releases its lock."""
    lock = threading.Lock()
    released = threading.Event()

    def release() -> None:  # a Python-level release, as logging.Handler.release is
        lock.release()
        released.set()

    def body(ctx):
        if ctx.rank == 0:
            time.sleep(0.05)
            raise ValueError("the real error")
        while True:
            lock.acquire()
            try:  # the interrupt lands here: rank 0 fails long before this spin ends
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    pass
            finally:
                time.sleep(0.15)
                release()

    err = _failure(body)
    assert "the real error" in str(err)
    assert released.wait(2.0) and not lock.locked()


class _SlowToEnterHandler(logging.Handler):
    """A handler whose lock is taken a while before ``Handler.handle`` enters its ``try`` (a busy stream, a
    slow filter): an interrupt landing there leaves the lock held for good."""

    def acquire(self) -> None:
        super().acquire()
        end = time.monotonic() + 0.02
        while time.monotonic() < end:
            pass

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_an_interrupted_rank_that_logs_leaves_no_logging_lock_held_and_stops():
    """E3: pytest attaches its handlers to every non-propagating logger (torch's c10d logger logs each
    failing collective at DEBUG); an abort that interrupted a rank between a handler's acquire and its
    ``try`` left the handler's lock held by a dead thread, and every later log call of the session hung
    (CI: twelve threaded-world tests ran past their timeout). Here the rank is inside that window most of
    the time: it must still be stopped, and the lock must be free after the run."""
    handler = _SlowToEnterHandler()
    log = logging.getLogger("dstest-test.slow-handler")
    log.addHandler(handler)
    log.propagate = False
    try:

        def body(ctx):
            if ctx.rank == 0:
                time.sleep(0.1)
                raise ValueError("the real error")
            while True:
                calls.append(1)
                log.warning("spinning")

        for _ in range(3):
            calls: list[int] = []
            err = _failure(body)
            assert "the real error" in str(err)
            assert handler.lock is not None
            assert handler.lock.acquire(timeout=2.0), "the handler's lock was left held by an interrupted rank"
            handler.lock.release()
            n = len(calls)
            time.sleep(0.1)
            assert len(calls) == n, "the logging rank was never stopped"
    finally:
        log.removeHandler(handler)


def test_a_handler_lock_left_by_a_dead_thread_is_given_a_new_lock():
    """E3: the repair behind the rule above: a logging lock owned by a thread that no longer lives (an
    interrupt that landed anyway, in a handler's own code) is replaced once the ranks have stopped."""
    from dstest.worlds.stopping import repair_logging_locks

    handler = logging.Handler()
    log = logging.getLogger("dstest-test.orphaned-lock")
    log.addHandler(handler)
    try:
        t = threading.Thread(target=handler.acquire)
        t.start()
        t.join()
        assert not handler.lock.acquire(timeout=0.05)
        assert repair_logging_locks({t.ident}) >= 1  # more if an earlier dead thread had the same id
        assert handler.lock.acquire(timeout=0.05)
        handler.lock.release()
        assert repair_logging_locks({t.ident}) == 0  # a free lock is left alone
    finally:
        log.removeHandler(handler)
