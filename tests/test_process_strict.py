"""The process world is as strict as the threaded one (contract E10, E11 for the cap; issue 10): every gloo call is checked across ranks.

Each test runs a small broken program on the warm gloo pool of 2 ranks and asserts the error's type, on
which ranks it was raised and what it names; never how long it took (timings live in
benchmarks/bench_checking.py). ``pytest.raises(RankFailure)`` also asserts that no WorldTimeout happened:
the runs have a generous timeout that a hang would reach instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import (
    CollectiveMismatch,
    InvalidArgument,
    RankFailure,
    UnfinishedWork,
    UnguardedMain,
    WorkerDied,
    WorldAborted,
    WorldTimeout,
)
from dstest.worlds import process
from dstest.worlds.process import ProcessWorld, checked, pool_pids
from dstest.worlds.process.messages import PoolKey
from dstest.worlds.process.pool_cache import _POOLS, _POOLS_LOCK
from dstest.worlds.process.world import _under_main_guard
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

PROCESS = ProcessWorld()
TIMEOUT = 20.0  # far beyond any check (milliseconds): reaching it would be a WorldTimeout, which the tests reject


@pytest.fixture(scope="module", autouse=True)
def _warm_pools():
    PROCESS.prestart([2])


def _fails(fn, *, args=()) -> RankFailure:
    """Run ``fn`` on 2 ranks and return the RankFailure it must end with (not a timeout, not a death)."""
    try:
        PROCESS.run(RunRequest(fn, 2, args=args, timeout=TIMEOUT))
    except RankFailure as exc:
        assert "past its timeout" not in str(exc)
        return exc
    except (WorldTimeout, WorkerDied) as exc:  # pragma: no cover - the regressions these tests catch
        pytest.fail(f"expected a RankFailure from the check, got {type(exc).__name__}: {exc}")
    pytest.fail("the run passed; it must fail")


def _pids() -> list[int]:
    PROCESS.warm(2)  # launched and ready: its pids are all known
    return pool_pids().get(("gloo", 2), [])


def _sum(ctx):
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def _next_run_passes() -> None:
    assert PROCESS.run(RunRequest(_sum, 2, timeout=TIMEOUT)) == [[3.0] * 3, [3.0] * 3]


# -- a correct program still runs, through every checked entry point ----------------------------------


def _every_call(ctx):
    r, n = ctx.rank, ctx.world_size
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=1)
    red = torch.ones(1)
    dist.reduce(red, dst=0)
    outs = [torch.empty(1) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([float(r)]))
    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
    rs = torch.empty(1)
    dist.reduce_scatter_tensor(rs, torch.arange(float(n)))
    a2a_out = torch.empty(3 if r == 0 else 1)
    a2a_in = torch.full((2,), float(r))
    dist.all_to_all_single(
        a2a_out, a2a_in, output_split_sizes=[1, 2] if r == 0 else [1, 0], input_split_sizes=[1, 1] if r == 0 else [2, 0]
    )
    g = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([float(r)]), g, dst=0)
    sc = torch.empty(1)
    dist.scatter(sc, [torch.tensor([5.0]), torch.tensor([6.0])] if r == 0 else None, src=0)
    sub = dist.new_group([0, 1])
    work = dist.all_reduce(torch.ones(1), group=sub, async_op=True)
    work.wait()
    fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
    fut.wait()
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()
    return {
        "sum": t.tolist(),
        "bcast": b.tolist(),
        "reduce": red.item() if r == 0 else None,
        "gather": [x.item() for x in outs],
        "flat": flat.tolist(),
        "rs": rs.item(),
        "a2a": a2a_out.tolist(),
        "gathered": [x.item() for x in g] if g else None,
        "scattered": sc.item(),
        "ring": got.tolist(),
        "backend": dist.get_backend(),
        "checked": type(dist.distributed_c10d._get_default_group()).__name__,
    }


def test_correct_programs_run_checked_on_gloo():
    r0, r1 = PROCESS.run(RunRequest(_every_call, 2, timeout=TIMEOUT))
    assert r0["sum"] == r1["sum"] == [3.0, 3.0]
    assert r0["bcast"] == r1["bcast"] == [1.0, 1.0]
    assert r0["reduce"] == 2.0
    assert r0["gather"] == r1["gather"] == [0.0, 1.0]
    assert r0["flat"] == [0.0, 0.0, 1.0, 1.0]
    assert (r0["rs"], r1["rs"]) == (0.0, 2.0)
    assert r0["a2a"] == [0.0, 1.0, 1.0] and r1["a2a"] == [0.0]
    assert r0["gathered"] == [0.0, 1.0] and (r0["scattered"], r1["scattered"]) == (5.0, 6.0)
    assert r0["ring"] == [1.0, 1.0] and r1["ring"] == [0.0, 0.0]
    assert r0["backend"] == "gloo" and r0["checked"] == "CheckedGroup"  # checked, yet gloo to the code


# -- item 1 (and 3): mismatches raise on every rank, naming both ranks and both calls -------------------


def _shape(ctx):
    dist.all_reduce(torch.ones(4 if ctx.rank == 0 else 8))


def _dtype(ctx):
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if ctx.rank == 0 else torch.float64))


def _op(ctx):
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if ctx.rank == 0 else dist.ReduceOp.MAX)


def _root(ctx):
    dist.broadcast(torch.ones(2), src=ctx.rank)


def _kind(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2))
    else:
        dist.broadcast(torch.ones(2), src=0)


def _splits(ctx):
    out, inp = torch.empty(2), torch.ones(2)
    # rank 0 sends 1 row to rank 1, which expects 2 from rank 0 (gloo itself would hang or abort)
    dist.all_to_all_single(
        out,
        inp,
        output_split_sizes=[1, 1] if ctx.rank == 0 else [2, 0],
        input_split_sizes=[1, 1] if ctx.rank == 0 else [0, 2],
    )


def _seq(ctx):
    dist.all_reduce(torch.ones(2))  # seq 1 agrees
    dist.all_reduce(torch.ones(2 if ctx.rank == 0 else 3))  # seq 2 does not


MISMATCHES = {
    "shape": (_shape, ["float32[4]@cpu", "float32[8]@cpu", "group world (seq 1)"]),
    "dtype": (_dtype, ["float32[4]@cpu", "float64[4]@cpu"]),
    "op": (_op, ["op=sum", "op=max"]),
    "root": (_root, ["root=0", "root=1", "broadcast("]),
    "kind": (_kind, ["all_reduce(", "broadcast(", "different collectives"]),
    "splits": (_splits, ["all_to_all_single(", "rank 0 sends 1 rows to rank 1, which expects 2"]),
    "sequence": (_seq, ["group world (seq 2)", "float32[2]@cpu", "float32[3]@cpu"]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_raises_on_every_rank_naming_both_calls(case):
    fn, words = MISMATCHES[case]
    old = _pids()
    info = _fails(fn)
    assert sorted(info.exceptions) == [0, 1]
    for rank, exc in info.exceptions.items():
        assert isinstance(exc, CollectiveMismatch), (rank, exc)
        text = str(exc)
        assert "rank 0" in text and "rank 1" in text, text
        for word in words:
            assert word in text, (word, text)
    assert _pids() == old  # found before gloo ran anything: the pool was not replaced
    _next_run_passes()


def test_dtype_mismatch_is_a_mismatch_not_a_dead_worker():
    old = _pids()
    info = _fails(_dtype)
    assert all(type(e) is CollectiveMismatch for e in info.exceptions.values())
    assert "WorkerDied" not in str(info) and "SIGABRT" not in str(info)
    assert _pids() == old


def _group_order(ctx):
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    first, second = (a, b) if ctx.rank == 0 else (b, a)
    dist.all_reduce(torch.ones(1), group=first)
    dist.all_reduce(torch.ones(1), group=second)


def test_group_order_mismatch_is_a_deadlock_named_on_every_rank():
    info = _fails(_group_order)
    assert sorted(info.exceptions) == [0, 1]
    for exc in info.exceptions.values():
        assert isinstance(exc, CollectiveMismatch)
        text = str(exc)
        assert "deadlock" in text
        assert "rank 0 waits in all_reduce(float32[1]@cpu, op=sum) on group 1 [0, 1] (seq 1)" in text
        assert "rank 1 waits in all_reduce(float32[1]@cpu, op=sum) on group 2 [0, 1] (seq 1)" in text
    _next_run_passes()


def _p2p_shape(ctx):
    if ctx.rank == 0:
        dist.send(torch.ones(4), 1)
    else:
        dist.recv(torch.empty(8), 0)


def test_send_recv_shape_mismatch_raises_on_both_ranks():
    info = _fails(_p2p_shape)
    assert sorted(info.exceptions) == [0, 1]
    for exc in info.exceptions.values():
        assert isinstance(exc, CollectiveMismatch)
        assert "send(float32[4]@cpu to rank 1, tag=0)" in str(exc) and "recv(float32[8]@cpu from rank 0, tag=0)" in str(
            exc
        )
    _next_run_passes()


def _caught(ctx):
    try:
        dist.all_reduce(torch.ones(2 if ctx.rank == 0 else 3))
    except Exception:
        pass
    return ctx.rank


def test_mismatch_caught_by_the_code_still_fails_the_world():
    info = _fails(_caught)
    assert sorted(info.exceptions) == [0, 1]
    for exc in info.exceptions.values():
        assert isinstance(exc, CollectiveMismatch) and "caught by the code under test" in str(exc)
    _next_run_passes()


# -- item 2: a rank that skips a collective and finishes ------------------------------------------------


def _skips(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2))
    return ctx.rank


def test_rank_that_skips_a_collective_and_finishes_is_named():
    old = _pids()
    info = _fails(_skips)
    assert sorted(info.exceptions) == [0]  # rank 1 did finish; rank 0 is told why it cannot go on
    text = str(info.exceptions[0])
    assert isinstance(info.exceptions[0], CollectiveMismatch)
    assert "rank 1 finished its function without joining all_reduce" in text  # one text, both worlds (core)
    assert "rank 0 called all_reduce(float32[2]@cpu, op=sum)" in text and "group world (seq 1)" in text
    assert _pids() == old
    _next_run_passes()


def _raises_while_peer_waits(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    dist.all_reduce(torch.ones(1))


def test_failed_peer_aborts_the_waiting_rank_and_comes_first():
    old = _pids()
    info = _fails(_raises_while_peer_waits)
    assert isinstance(info.exceptions[1], ValueError) and isinstance(info.exceptions[0], WorldAborted)
    assert "rank 1 failed (ValueError: rank one refuses)" in str(info.exceptions[0])
    head = str(info).splitlines()[0]
    assert head.index("rank 1: ValueError") < head.index("rank 0: WorldAborted")
    assert _pids() == old  # the waiting rank unwound: no kill, no replacement
    _next_run_passes()


# -- item 4: orphan work fails the run and never reaches the next one ------------------------------------


def _orphan_all_reduce(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2), async_op=True)  # nobody matches it, nobody waits
    return ctx.rank


def _orphan_isend(ctx):
    if ctx.rank == 0:
        dist.isend(torch.ones(3), 1)  # no recv anywhere, never waited
    return ctx.rank


def _unwaited(ctx):
    dist.all_reduce(torch.ones(2), async_op=True)  # matched on both ranks, waited by none
    return ctx.rank


ORPHANS = {
    "all_reduce": (_orphan_all_reduce, [0], "all_reduce(float32[2]@cpu, op=sum) on group world (seq 1)"),
    "isend": (_orphan_isend, [0], "send(float32[3]@cpu to rank 1, tag=0) on group world"),
    "unwaited": (_unwaited, [0, 1], "all_reduce(float32[2]@cpu, op=sum) on group world (seq 1)"),
}


@pytest.mark.parametrize("case", list(ORPHANS))
def test_orphan_work_fails_naming_rank_and_call_and_the_next_run_passes(case):
    fn, ranks, call = ORPHANS[case]
    info = _fails(fn)
    assert sorted(info.exceptions) == ranks
    for rank in ranks:
        exc = info.exceptions[rank]
        assert isinstance(exc, UnfinishedWork), exc
        assert f"rank {rank} finished its function with work left behind" in str(exc) and call in str(exc)
        assert "never waited" in str(exc)
    _next_run_passes()  # before the check, this hung to its timeout, blamed on the orphan's rank
    _next_run_passes()


def _gather_each_wait_last(ctx):
    """A library's habit that holds on NCCL's one stream only: gather per tensor, wait the last handle."""
    handles = [_gather_async(torch.full((2,), float(i))) for i in range(3)]
    handles[-1].wait()
    return ctx.rank


def _gather_async(t):
    out = torch.empty(2 * dist.get_world_size())
    return dist.all_gather_into_tensor(out, t, async_op=True)


def test_e9_an_unwaited_work_names_where_it_was_issued_and_from_where():
    info = _fails(_gather_each_wait_last)
    for rank in (0, 1):
        text = str(info.exceptions[rank])
        assert isinstance(info.exceptions[rank], UnfinishedWork), text
        assert text.count("was never waited") == 2  # the first two gathers; the third was waited
        assert "issued at tests/test_process_strict.py:" in text
        assert "(_gather_async) <- tests/test_process_strict.py:" in text and "(_gather_each_wait_last)" in text
    _next_run_passes()


# -- item 5: a script without a __main__ guard ----------------------------------------------------------


def test_unguarded_script_gets_a_clear_error(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import dstest

            def body(ctx):
                return ctx.rank

            print(dstest.run(body, world_size=2, world="process"))
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "dstest.errors.UnguardedMain" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert "process object is closed" not in done.stderr


def test_main_guard_detection(tmp_path):
    source = tmp_path / "s.py"
    source.write_text(
        'import x\nrun()\nif __name__ == "__main__":\n    run()\nelse:\n    run()\nif "__main__" == __name__:\n    run()\n'
    )
    assert [_under_main_guard(str(source), n) for n in (2, 4, 6, 8)] == [False, True, False, True]
    # The parse is kept per version of the file: an edited script is read again.
    source.write_text('if __name__ == "__main__":\n    run()\nrun()\n')
    os.utime(source, ns=(1, 1))
    assert [_under_main_guard(str(source), n) for n in (2, 3)] == [True, False]
    # Inside multiprocessing's import of the script (as __mp_main__), any module-level call is refused.
    code = compile(
        "from dstest.worlds.process.world import _check_not_bootstrapping\n_check_not_bootstrapping('run')", "s.py", "exec"
    )
    with pytest.raises(UnguardedMain, match="__mp_main__"):
        exec(code, {"__name__": "__mp_main__", "__file__": "s.py"})


# -- item 6: a cap on the workers kept warm -------------------------------------------------------------


def _pid(ctx):
    return os.getpid()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_world_larger_than_the_cap_runs_cold(monkeypatch):
    monkeypatch.setenv(process.MAX_WARM_WORKERS_ENV, "1")
    warm = pool_pids()
    pids = PROCESS.run(RunRequest(_pid, 2, timeout=TIMEOUT))
    assert len(set(pids)) == 2 and not set(pids) & {p for ps in warm.values() for p in ps}
    assert all(_gone(p) for p in pids)  # stopped after the run
    assert set(pool_pids()) == set(warm)  # nothing new kept, nothing evicted (a pool may still be starting)


def test_starting_a_pool_evicts_the_least_recently_used_beyond_the_cap(monkeypatch):
    PROCESS.run(RunRequest(_sum, 2, timeout=TIMEOUT))
    two = _pids()
    assert two
    capped = ProcessWorld(max_warm_workers=2)
    with _POOLS_LOCK:  # a pool of 1 must be started now (not kept from another test)
        stale = _POOLS.pop(PoolKey("gloo", "cpu", 1), None)
    if stale is not None:
        stale.stop()
    assert capped.run(RunRequest(_pid, 1, timeout=TIMEOUT))
    assert ("gloo", 2) not in pool_pids() and ("gloo", 1) in pool_pids()  # 2 + 1 > 2: the older one went
    assert all(_gone(p) for p in two)


@pytest.mark.parametrize("value", ["lots", "-1", "2.5"])
def test_cap_setting_is_validated(monkeypatch, value):
    monkeypatch.setenv(process.MAX_WARM_WORKERS_ENV, value)
    with pytest.raises(InvalidArgument, match=f"{process.MAX_WARM_WORKERS_ENV}.*integer >= 0"):
        process.warm_worker_cap()
    with pytest.raises(InvalidArgument, match="max_warm_workers=True must be an integer >= 0"):
        ProcessWorld(max_warm_workers=True)  # type: ignore[arg-type]


def _ddp(ctx):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.full((3, 4), float(ctx.rank))).sum().backward()
    return [p.grad.tolist() for p in model.parameters()], len(checked._CHECKER.posted)


def test_ddp_runs_on_checked_groups():
    (grads0, checked0), (grads1, checked1) = PROCESS.run(RunRequest(_ddp, 2, timeout=TIMEOUT))
    assert grads0 == grads1  # averaged across ranks by DDP's all_reduce
    assert checked0 >= 3 and checked1 >= 3  # its broadcast, all_gather and all_reduce all went through the check


# -- one body under several specs (the process world finds its rank adapter by the spec's name) ----------


def _shared_body(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


test_shared_body_threaded = dstest.spec(world_size=[2], worlds=["threaded"], contract="E10")(_shared_body)
test_shared_body_process = dstest.spec(world_size=[2], worlds=["process"], contract="E10")(_shared_body)
