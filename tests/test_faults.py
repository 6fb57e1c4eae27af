"""Fault injection (contract G5): Kill, Fail and Delay on the threaded and the process world.

Process-world bodies are module-level functions (the workers find them by reference). Every timing is a
wall time of the whole run, against a timeout of 60 s: a killed rank must be reported at once, not at the
timeout.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.faults import FAULT_OPS, Delay, Fail, InjectedFault, Kill, Killed
from dstest.worlds.core.faults import RankFaults, check_faults
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]
TIMEOUT = 60.0


@pytest.fixture(scope="module", autouse=True)
def _warm_process_pool() -> None:
    """Start the process world's pool of 3 before any timing (a cold start is not what is measured)."""
    from dstest.worlds.process import ProcessWorld

    ProcessWorld().warm(3)


def _run(world: str, fn: Any, world_size: int = 3, **kw: Any) -> tuple[list[Any], float]:
    start = time.monotonic()
    results = dstest.run(fn, world_size, world=world, timeout=TIMEOUT, **kw)
    return results, time.monotonic() - start


# -- bodies (module level: the process world sends them by reference) ------------------------------------
def all_reduces(ctx: Any, n: int = 5, keep_going: bool = False) -> list[str]:
    """``n`` all_reduces; each outcome: "ok", or the error's class, whether it is a backend error, message."""
    out: list[str] = []
    t = torch.ones(2)
    for _ in range(n):
        try:
            dist.all_reduce(t)
            out.append("ok")
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__} backend={isinstance(exc, dist.DistBackendError)}: {exc}")
            if not keep_going:
                break
    return out


def async_wait_after_kill(ctx: Any) -> str:
    """The error reaches the wait of an async collective too."""
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait()
    except dist.DistBackendError as exc:
        return str(exc)
    return "completed"


def survivor_raises(ctx: Any) -> None:
    dist.all_reduce(torch.ones(1))  # rank 1 is killed here; rank 0 does not catch the error


def plain_sum(ctx: Any) -> float:
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return float(t.item())


# -- a recovery loop: manual data-parallel SGD, a checkpoint every step, survivors regroup ---------------
STEPS, LR, DIM = 4, 0.1, 3


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, DIM, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1


def _grad(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    w = w.detach().clone().requires_grad_(True)
    ((x @ w - y) ** 2).mean().backward()
    assert w.grad is not None
    return w.grad


def train_with_recovery(ctx: Any, ckpt_dir: str | None = None) -> Any:
    """Every rank trains; when a peer dies, the survivors restore the last checkpoint, form a group of
    their own and finish the run on it (the pattern of elastic / fault-tolerant training loops)."""
    w = torch.zeros(DIM, dtype=torch.float64)
    group, members = None, list(range(ctx.world_size))
    checkpoint = (0, w.clone())
    step = 0
    while step < STEPS:
        grad = _grad(w, ctx.rank, step)
        try:
            dist.all_reduce(grad, group=group)
        except dist.DistBackendError as exc:
            dead = [r for r in members if f"rank {r} was killed" in str(exc)]
            assert dead, str(exc)
            members = [r for r in members if r not in dead]
            group = dist.new_group(members, use_local_synchronization=True)
            step, w = checkpoint[0], checkpoint[1].clone()
            if ckpt_dir is not None:  # the on-disk copy, as a real job would restore it
                w = torch.load(f"{ckpt_dir}/rank{ctx.rank}.pt")
            continue
        w -= LR * grad / len(members)
        step += 1
        checkpoint = (step, w.clone())
        if ckpt_dir is not None:
            torch.save(w, f"{ckpt_dir}/rank{ctx.rank}.pt")
    return (members, w)


def _reference(kill_step: int, world_size: int, survivors: list[int]) -> torch.Tensor:
    """One process: the same updates, all ranks' data before the kill, the survivors' after it."""
    w = torch.zeros(DIM, dtype=torch.float64)
    for step in range(STEPS):
        ranks = range(world_size) if step < kill_step else survivors
        w = w - LR * sum(_grad(w, r, step) for r in ranks) / len(ranks)
    return w


# -- Kill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("nth", [1, 3])
def test_killed_rank_is_reported_at_once(world: str, nth: int) -> None:
    results, seconds = _run(world, all_reduces, faults=[Kill(rank=1, op="all_reduce", nth=nth)])
    assert seconds < 5.0, f"the run took {seconds:.2f} s: the kill was not reported promptly"
    assert results[1] == Killed(1, f"all_reduce #{nth} on any group")
    for r in (0, 2):
        assert results[r][: nth - 1] == ["ok"] * (nth - 1)
        error = results[r][nth - 1]
        assert error.startswith("InjectedFault backend=True: rank 1 was killed by an injected fault"), error
        assert f"seq {nth}" in error
        assert len(results[r]) == nth


@pytest.mark.parametrize("world", WORLDS)
def test_kill_reaches_the_wait_of_an_async_collective(world: str) -> None:
    results, seconds = _run(world, async_wait_after_kill, 2, faults=[Kill(1)])
    assert seconds < 5.0
    assert results[1] == Killed(1, "all_reduce #1 on any group")
    assert "rank 1 was killed by an injected fault" in results[0]


@pytest.mark.parametrize("world", WORLDS)
def test_a_survivor_that_raises_fails_the_run_and_the_report_names_the_fault(world: str) -> None:
    with pytest.raises(dstest.RankFailure) as info:
        _run(world, survivor_raises, 2, faults=[Kill(1)])
    text = str(info.value)
    assert "rank 0: InjectedFault: rank 1 was killed by an injected fault" in text
    assert "injected fault" in text and "Kill(rank 1 at its all_reduce #1 on any group)" in text
    assert 1 not in info.value.exceptions  # the killed rank is no failure of the run


@pytest.mark.parametrize("world", WORLDS)
def test_kill_counts_per_group(world: str) -> None:
    """``group="world"`` counts only calls on the default group."""
    results, _ = _run(world, all_reduces, 2, faults=[Kill(1, nth=2, group="world")])
    assert results[1] == Killed(1, "all_reduce #2 on group world")
    assert results[0][0] == "ok" and "rank 1 was killed" in results[0][1]


# -- Fail and Delay ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_fail_raises_on_the_rank_and_its_peers(world: str) -> None:
    results, seconds = _run(world, all_reduces, kwargs={"n": 4, "keep_going": True}, faults=[Fail(1, nth=2)])
    assert seconds < 5.0
    for r in range(3):
        assert results[r][0] == "ok" and results[r][2:] == ["ok", "ok"], results[r]
        assert results[r][1].startswith("InjectedFault backend=True: injected fault: rank 1's all_reduce"), results[r]
        assert "dstest Fail" in results[r][1]


@pytest.mark.parametrize("world", WORLDS)
def test_delay_only_delays(world: str) -> None:
    results, seconds = _run(world, all_reduces, 2, faults=[Delay(1, nth=2, seconds=0.5)])
    assert results == [["ok"] * 5, ["ok"] * 5]
    assert 0.5 <= seconds < 5.0


# -- recovery ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_survivors_recover_from_a_checkpoint_and_finish(world: str, tmp_path: Any) -> None:
    kwargs = {"ckpt_dir": str(tmp_path)} if world == "process" else {}
    results, seconds = _run(world, train_with_recovery, 3, kwargs=kwargs, faults=[Kill(rank=2, nth=2)])
    assert seconds < 10.0
    assert results[2] == Killed(2, "all_reduce #2 on any group")
    expected = _reference(kill_step=1, world_size=3, survivors=[0, 1])
    for r in (0, 1):
        members, w = results[r]
        assert members == [0, 1]
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)


# -- the world is healthy afterwards; no faults, no change -----------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_a_normal_run_after_faults_passes(world: str) -> None:
    _run(world, all_reduces, faults=[Kill(0, nth=2)])
    _run(world, all_reduces, faults=[Fail(2, nth=1)])
    results, _ = _run(world, plain_sum)
    assert results == [3.0, 3.0, 3.0]
    assert _run(world, all_reduces)[0] == [["ok"] * 5] * 3


def test_no_faults_means_no_fault_state() -> None:
    assert RunRequest(plain_sum, 2).faults == ()
    assert check_faults(None) == ()


@dstest.spec(world_size=2, worlds=["threaded", "process"], faults=[Kill(1, nth=1)])
def test_spec_with_a_kill_passes_when_the_survivor_recovers(ctx: Any) -> None:
    try:
        dist.all_reduce(torch.ones(1))
    except dist.DistBackendError as exc:
        assert "rank 1 was killed" in str(exc)
    else:
        raise AssertionError("the all_reduce needing the killed rank did not raise")


# -- argument errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Kill(-1), r"Kill\(rank=-1\): rank must be an int >= 0"),
        (lambda: Kill(True), r"rank must be an int"),
        (lambda: Kill(0, op="allreduce"), r"Kill\(op='allreduce'\): op must be the name of a collective"),
        (lambda: Fail(0, nth=0), r"Fail\(nth=0\): nth must be an int >= 1"),
        (lambda: Kill(0, group="tp"), r"group must be None \(any group\), 'world'"),
        (lambda: Kill(0, group=[]), r"a group is given by its global ranks"),
        (lambda: Delay(0, seconds=-1), r"Delay\(seconds=-1\): seconds must be a finite number"),
        (lambda: Kill(0, optional=1), r"Kill\(optional=1\): optional must be True or False"),  # type: ignore[arg-type]
        (lambda: Fail(0, optional="yes"), r"Fail\(optional='yes'\): optional must be True or False"),  # type: ignore[arg-type]
        (lambda: RunRequest(plain_sum, 3, faults=[Kill(3)]), r"rank 3 is not a rank of a world of 3"),
        (lambda: RunRequest(plain_sum, 3, faults=[Kill(0, group=[1, 2])]), r"group \[1, 2\] must hold rank 0"),
        (lambda: RunRequest(plain_sum, 3, faults="Kill"), r"faults='Kill': must be a list"),
        (lambda: RunRequest(plain_sum, 3, faults=[object()]), r"is not a dstest.faults.Kill, Fail or Delay"),
        (lambda: RunRequest(plain_sum, 3, faults=[Kill(0), Fail(0)]), r"fire at the same call"),
        (lambda: dstest.run(plain_sum, 2, world="fake", faults=[Kill(0)]), r"the fake world cannot inject faults"),
        (lambda: dstest.spec(faults=[1]), r"is not a dstest.faults.Kill, Fail or Delay"),
    ],
)
def test_bad_faults_are_refused_before_anything_starts(make: Any, match: str) -> None:
    with pytest.raises(dstest.InvalidArgument, match=match):
        make()


def test_fault_ops_are_the_recorded_collectives() -> None:
    assert {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"} <= FAULT_OPS


def test_counting_is_per_op_and_group() -> None:
    faults = RankFaults([Kill(0, nth=2, group=[0, 1]), Fail(0, op="broadcast", nth=1)], 0)
    assert faults.hit("all_reduce", True, [0, 1, 2]) is None
    assert faults.hit("all_reduce", False, [0, 1]) is None  # the 1st on group [0, 1]
    assert faults.hit("all_reduce", True, [0, 1, 2]) is None
    assert faults.hit("all_reduce", False, [1, 0]) == Kill(0, nth=2, group=[0, 1])
    assert faults.hit("broadcast", False, [0, 1]) == Fail(0, op="broadcast", nth=1)


def test_injected_fault_is_a_backend_error() -> None:
    assert issubclass(InjectedFault, dist.DistBackendError) and issubclass(InjectedFault, RuntimeError)


def fail_uncaught(ctx: Any) -> None:
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("world", WORLDS)
def test_an_uncaught_fail_fails_the_run_and_the_report_names_it(world: str) -> None:
    with pytest.raises(dstest.RankFailure) as info:
        _run(world, fail_uncaught, 2, faults=[Fail(0, nth=1)])
    text = str(info.value)
    assert "InjectedFault: injected fault: rank 0's all_reduce on group world (seq 1) failed" in text
    assert "Fail(rank 0 at its all_reduce #1 on any group)" in text


def subgroup_all_reduces(ctx: Any) -> list[str]:
    """An all_reduce on the world, then on group [0, 1] (rank 2 is not a member)."""
    out = []
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1))
    if ctx.rank in (0, 1):
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out.append("ok")
        except dist.DistBackendError as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_kill_on_a_subgroup(world: str) -> None:
    results, seconds = _run(world, subgroup_all_reduces, faults=[Kill(1, nth=1, group=[0, 1])])
    assert seconds < 5.0
    assert results[1] == Killed(1, "all_reduce #1 on group [0, 1]")
    assert results[2] == []
    assert results[0][0].startswith("rank 1 was killed by an injected fault (dstest Kill at its all_reduce #1 on group [0, 1])")


def test_kill_on_a_cold_threaded_world() -> None:
    from dstest.worlds.threaded import ThreadedWorld

    results = ThreadedWorld(warm=False).run(RunRequest(all_reduces, 3, faults=[Kill(2, nth=2)], timeout=TIMEOUT))
    assert results[2] == Killed(2, "all_reduce #2 on any group")
    assert results[0][0] == "ok" and "rank 2 was killed" in results[0][1]


def async_then_killed(ctx: Any) -> str:
    """Rank 1 posts an async all_reduce, never waits, and dies at its next one; the others post theirs late."""
    t = torch.ones(1)
    if ctx.rank == 1:
        dist.all_reduce(t, async_op=True)
        dist.all_reduce(t)  # killed here
        return "not reached"
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as exc:
        return str(exc)
    return "completed"


@pytest.mark.parametrize("world", WORLDS)
def test_work_a_killed_rank_posted_never_completes(world: str) -> None:
    results, seconds = _run(world, async_then_killed, faults=[Kill(1, nth=2)])
    assert seconds < 5.0
    assert results[1] == Killed(1, "all_reduce #2 on any group")
    for r in (0, 2):
        assert results[r].startswith("collective on group world (seq 1) cannot complete: rank 1 was killed"), results[r]


# -- a fault that never fires fails the run (issue 40, finding 2) ------------------------------------------
def all_reduce_then_barrier(ctx: Any) -> str:
    """Two all_reduces and a barrier on the world: no broadcast anywhere."""
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    return "done"


def _not_fired(world: str, fn: Any, faults: list[Any], world_size: int = 2, **kw: Any) -> str:
    with pytest.raises(dstest.FaultNotFired) as info:
        _run(world, fn, world_size, faults=faults, **kw)
    return str(info.value)


@pytest.mark.parametrize("world", WORLDS)
def test_a_fault_whose_op_never_comes_fails_the_run(world: str) -> None:
    text = _not_fired(world, all_reduce_then_barrier, [Kill(rank=1, op="broadcast")])
    assert (
        "Kill(rank=1, op='broadcast', nth=1) never fired: rank 1 made no broadcast call "
        "(its collectives: all_reduce x2, barrier x1)"
    ) in text
    assert "optional=True" in text  # the way out for a fault meant to fire only sometimes


@pytest.mark.parametrize("world", WORLDS)
def test_a_fault_whose_nth_call_never_comes_fails_the_run(world: str) -> None:
    text = _not_fired(world, all_reduces, [Fail(rank=0, op="all_reduce", nth=5)], kwargs={"n": 2})
    assert "Fail(rank=0, op='all_reduce', nth=5) never fired: rank 0 made 2 all_reduce calls on any group" in text


@pytest.mark.parametrize("world", WORLDS)
def test_a_fault_on_a_group_names_the_calls_on_that_group_and_on_any(world: str) -> None:
    text = _not_fired(world, subgroup_all_reduces, [Delay(rank=0, nth=2, group=[0, 1], seconds=0)], 3)
    assert (
        "Delay(rank=0, op='all_reduce', nth=2, group=[0, 1], seconds=0) never fired: rank 0 made 1 all_reduce "
        "call on group [0, 1] (2 on any group)"
    ) in text


@pytest.mark.parametrize("world", WORLDS)
def test_every_fault_that_never_fired_is_named_and_those_that_fired_are_not(world: str) -> None:
    faults = [Delay(0, nth=1, seconds=0), Delay(1, nth=3, seconds=0), Fail(0, op="broadcast", nth=2)]
    text = _not_fired(world, all_reduce_then_barrier, faults)
    assert "Delay(rank=1, op='all_reduce', nth=3, seconds=0) never fired: rank 1 made 2 all_reduce calls" in text
    assert "Fail(rank=0, op='broadcast', nth=2) never fired: rank 0 made no broadcast call" in text
    assert "Delay(rank=0, op='all_reduce', nth=1" not in text  # it fired


@pytest.mark.parametrize("world", WORLDS)
def test_an_optional_fault_may_not_fire(world: str) -> None:
    results, _ = _run(world, all_reduce_then_barrier, 2, faults=[Kill(rank=1, op="broadcast", optional=True)])
    assert results == ["done", "done"]
    results, _ = _run(world, all_reduces, 2, faults=[Kill(rank=1, nth=2, optional=True)])  # it may fire, too
    assert results[1] == Killed(1, "all_reduce #2 on any group")


@pytest.mark.parametrize("world", WORLDS)
def test_the_other_faults_of_a_killed_rank_never_fired(world: str) -> None:
    """Rank 1 dies at its 1st all_reduce: its Fail at the 3rd never comes; the survivor catches its error."""
    faults = [Kill(1, nth=1), Fail(1, nth=3)]
    text = _not_fired(world, all_reduces, faults, kwargs={"n": 3})
    assert (
        "Fail(rank=1, op='all_reduce', nth=3) never fired: rank 1 was killed first, by "
        "Kill(rank=1, op='all_reduce', nth=1) at its all_reduce #1 on any group"
    ) in text


@pytest.mark.parametrize("world", WORLDS)
def test_a_run_that_fails_anyway_keeps_its_failure_and_notes_the_fault(world: str) -> None:
    with pytest.raises(dstest.RankFailure) as info:
        _run(world, survivor_raises, 2, faults=[Kill(1), Fail(0, op="broadcast")])
    text = str(info.value)
    assert "rank 0: InjectedFault: rank 1 was killed by an injected fault" in text
    assert "injected faults that never fired: Fail(rank=0, op='broadcast', nth=1) never fired" in text


def test_not_fired_has_the_same_text_in_both_worlds() -> None:
    faults = [Kill(1, op="broadcast"), Fail(0, nth=5), Delay(1, op="barrier", nth=2, group="world", seconds=0)]
    texts = {world: _not_fired(world, all_reduce_then_barrier, faults) for world in WORLDS}
    assert texts["threaded"] == texts["process"]
    assert texts["threaded"].count("never fired:") == 3


@dstest.spec(world_size=2, worlds=["threaded", "process"], faults=[Fail(0, op="broadcast", optional=True)])
def test_spec_with_an_optional_fault_that_never_fires_passes(ctx: Any) -> None:
    dist.all_reduce(torch.ones(1))


_UNFIRED_SPEC = """
import torch, torch.distributed as dist, dstest
from dstest.faults import Kill

@dstest.spec(world_size=[2], worlds=["threaded"], faults=[Kill(1, op="broadcast")])
def test_never_broadcasts(ctx):
    dist.all_reduce(torch.ones(1))
"""


def test_a_spec_whose_fault_never_fires_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_unfired=_UNFIRED_SPEC)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*FaultNotFired: an injected fault never fired*",
            "*Kill(rank=1, op='broadcast', nth=1) never fired: rank 1 made no broadcast call*",
        ]
    )


def test_a_fault_whose_call_another_fault_took_never_fired() -> None:
    """``group=None`` and ``group="world"`` can name the same call: the first of the list fires there."""
    tally = RankFaults([Kill(0, nth=1), Delay(0, nth=1, group="world", seconds=0)], 0)
    assert tally.hit("all_reduce", True, [0, 1]) == Kill(0, nth=1)
    assert tally.not_fired() == [
        "Delay(rank=0, op='all_reduce', nth=1, group='world', seconds=0) never fired: "
        "Kill(rank=0, op='all_reduce', nth=1) fired at the same call, its all_reduce #1 on any group "
        "(give one fault per call)"
    ]
