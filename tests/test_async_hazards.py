"""Async hazards (contract G3): with the opt-in mode, an unwaited async output holds poison, so reading it
before ``wait()`` fails the same way on every run; correct overlap code passes unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import InvalidArgument, RankFailure, UnfinishedWork
from dstest.worlds.threaded.hazards import poison_value

pytestmark = pytest.mark.cpu

SIZES = [2, 3, 4]


def _overlap_step(ctx: Any, wait_before_use: bool) -> torch.Tensor:
    """Overlap a gradient all-reduce with other work, then apply the reduced gradient.

    The buggy variant forgets to wait before it reads the gradient (it waits only at the very end)."""
    W = ctx.world_size
    grad = torch.full((4,), float(ctx.rank + 1))
    work = dist.all_reduce(grad, async_op=True)
    other = torch.arange(4.0) * 2  # the computation the all-reduce overlaps with
    if wait_before_use:
        work.wait()
    update = grad / W + other
    if not wait_before_use:
        work.wait()
    want = torch.full((4,), (W + 1) / 2) + other  # mean of 1..W
    assert torch.equal(update, want), f"rank {ctx.rank}: update {update.tolist()}, expected {want.tolist()}"
    return update


@pytest.mark.parametrize("world_size", SIZES)
def test_missing_wait_is_caught(world_size: int) -> None:
    for _ in range(3):  # the same failure every run
        with pytest.raises(RankFailure) as err:
            dstest.run(_overlap_step, world_size, args=(False,), async_hazards=True)
        text = str(err.value)
        assert f"{world_size} of {world_size} ranks failed" in text
        assert "update [nan, nan, nan, nan]" in text, text


@pytest.mark.parametrize("world_size", SIZES)
def test_correct_overlap_passes(world_size: int) -> None:
    results = dstest.run(_overlap_step, world_size, args=(True,), async_hazards=True)
    assert len(results) == world_size


def _early_irecv(ctx: Any, wait_first: bool) -> list[int]:
    if ctx.rank == 0:
        dist.send(torch.arange(3, dtype=torch.int32), dst=1)
        return []
    if ctx.rank != 1:
        return []
    buf = torch.zeros(3, dtype=torch.int32)
    work = dist.irecv(buf, src=0)
    seen = [] if wait_first else buf.tolist()
    work.wait()
    return seen + buf.tolist()


@pytest.mark.parametrize("world_size", SIZES)
def test_irecv_read_before_wait_sees_the_integer_pattern(world_size: int) -> None:
    got = dstest.run(_early_irecv, world_size, args=(False,), async_hazards=True)
    pattern = poison_value(torch.int32)
    assert pattern == -1515870811  # 0xA5A5A5A5 as a signed int32
    assert got[1] == [pattern] * 3 + [0, 1, 2]
    assert dstest.run(_early_irecv, world_size, args=(True,), async_hazards=True)[1] == [0, 1, 2]


def _aliased_gather(ctx: Any) -> list[float]:
    """FSDP's in-place all-gather: the input is this rank's slice of the output."""
    W, r = ctx.world_size, ctx.rank
    out = torch.zeros(2 * W)
    mine = out[2 * r : 2 * r + 2]
    mine.fill_(float(r))
    work = dist.all_gather_into_tensor(out, mine, async_op=True)
    early = out.isnan().all().item()
    work.wait()
    assert early, "unwaited output not poisoned"
    total = torch.tensor([1.0, 2.0])
    work = dist.all_reduce(total, async_op=True)
    fut = work.get_future()
    value = fut.wait()[0]
    assert value is total or torch.equal(value, total)
    return out.tolist() + total.tolist()


@pytest.mark.parametrize("world_size", SIZES)
def test_inputs_that_alias_outputs_are_sent_intact(world_size: int) -> None:
    W = world_size
    for got in dstest.run(_aliased_gather, W, async_hazards=True):
        assert got == [float(r) for r in range(W) for _ in range(2)] + [float(W), 2.0 * W]


def _never_waited(ctx: Any) -> None:
    dist.all_reduce(torch.ones(2), async_op=True)


def test_a_handle_never_waited_is_reported() -> None:
    with pytest.raises(RankFailure) as err:
        dstest.run(_never_waited, 2, async_hazards=True)
    assert any(isinstance(e, UnfinishedWork) for e in err.value.exceptions.values())
    text = str(err.value)
    assert "finished its function with work left over" in text and "never waited" in text
    assert "all_reduce(float32[2]@cpu, op=sum)" in text


def test_without_the_option_nothing_is_poisoned() -> None:
    def body(ctx: Any) -> bool:
        t = torch.ones(3)
        work = dist.all_reduce(t, async_op=True)
        poisoned = bool(t.isnan().any())
        work.wait()
        return poisoned

    assert dstest.run(body, 2) == [False, False]


def test_poison_values() -> None:
    assert torch.tensor(poison_value(torch.bfloat16)).isnan()
    assert poison_value(torch.uint8) == 0xA5
    assert poison_value(torch.int64) == int.from_bytes(b"\xa5" * 8, "little", signed=True)
    assert poison_value(torch.bool) is True


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(InvalidArgument, match="async_hazards='yes': must be True or False, got a str"):
        dstest.run(_never_waited, 2, async_hazards="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"\['process'\] cannot poison unwaited outputs"):
        dstest.spec(world_size=[2], worlds=["process"], async_hazards=True)
    with pytest.raises(InvalidArgument, match=r"\['fake'\] cannot poison"):
        dstest.run(_never_waited, 2, world="fake", async_hazards=True)


pytest_plugins = ["pytester"]

_SPECS = """
import torch, torch.distributed as dist, dstest

def _body(ctx):
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    seen = t.clone()  # read before the wait: 1s or 2s without the mode (timing), poison with it
    work.wait()
    assert not seen.isnan().any(), seen

@dstest.spec(world_size=[2], worlds=["threaded"], async_hazards=True)
def test_by_argument(ctx):
    _body(ctx)

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_by_option(ctx):
    _body(ctx)
"""


def test_spec_argument_and_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_specs=_SPECS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)  # the argument poisons; without it nothing is
    result.stdout.fnmatch_lines(["*test_by_argument*", "*AssertionError: tensor(?nan, nan?)*"])
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--dstest-async-hazards")
    result.assert_outcomes(failed=2)


def _fsdp2_step(ctx: Any) -> None:
    """FSDP2 prefetches and reduces asynchronously and waits before every use: it trains unchanged."""
    import copy

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * ctx.world_size, 5, generator=g), torch.randn(2 * ctx.world_size, 3, generator=g)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach())


@pytest.mark.parametrize("world_size", SIZES)
def test_fsdp2_passes_with_hazards_on(world_size: int) -> None:
    dstest.run(_fsdp2_step, world_size, async_hazards=True)
