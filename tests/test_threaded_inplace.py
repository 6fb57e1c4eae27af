"""The threaded world reads inputs in place and writes every rank's outputs at completion: results stay
those of a world of processes whatever aliases what (shared tensors, FSDP's in-place all-gather)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dstest.worlds import collectives as C
from dstest.worlds.collectives import reducing
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

pytestmark = pytest.mark.cpu
WORLD = ThreadedWorld()
LARGE = C.IN_PLACE_BYTES // 4 * 2  # float32 elements: above the in-place threshold
W = 3


def _data(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("n", [7, LARGE])
@pytest.mark.parametrize(("op", "dtype"), [("SUM", torch.float32), ("AVG", torch.float32), ("MAX", torch.float32),
                                           ("AVG", torch.int64), ("BXOR", torch.int64), ("PRODUCT", torch.int32)])
def test_all_reduce_equals_the_rank_order_reference(n: int, op: str, dtype: torch.dtype) -> None:
    def body(ctx: Any) -> torch.Tensor:
        t = _data(ctx.rank, n, dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t

    want = C.reduce_tensors(op.lower(), [_data(r, n, dtype) for r in range(W)])
    for got in WORLD.run(RunRequest(body, W)):
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("n", [7, LARGE])
def test_one_tensor_shared_by_every_rank_reduces_as_w_processes_would(n: int) -> None:
    shared = torch.ones(n)

    def body(ctx: Any, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    WORLD.run(RunRequest(body, W, args=(shared,)))
    assert torch.equal(shared, torch.full((n,), float(W)))


def test_the_aliasing_check_is_what_keeps_a_shared_tensor_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the storage check the in-place fold reads what it already wrote: the check can fail."""
    monkeypatch.setattr(reducing, "storages_apart", lambda ts: True)  # where AllReduce reads it
    shared = torch.ones(LARGE)

    def body(ctx: Any, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    WORLD.run(RunRequest(body, W, args=(shared,)))
    assert not torch.equal(shared, torch.full((LARGE,), float(W)))


@pytest.mark.parametrize("n", [5, LARGE // W])
@pytest.mark.parametrize("in_output", [False, True])
def test_all_gather_into_tensor_with_inputs_inside_their_own_outputs(n: int, in_output: bool) -> None:
    def body(ctx: Any) -> torch.Tensor:
        out = torch.zeros(n * W)
        if in_output:  # FSDP's form: the input is this rank's chunk of its own output
            inp = out[ctx.rank * n : (ctx.rank + 1) * n]
            inp.copy_(_data(ctx.rank, n))
        else:
            inp = _data(ctx.rank, n)
        dist.all_gather_into_tensor(out, inp)
        return out

    want = torch.cat([_data(r, n) for r in range(W)])
    for got in WORLD.run(RunRequest(body, W)):
        assert torch.equal(got, want)


def test_all_gather_into_one_output_shared_by_every_rank() -> None:
    n = LARGE // W
    shared = torch.zeros(n * W)

    def body(ctx: Any, out: torch.Tensor) -> None:
        dist.all_gather_into_tensor(out, _data(ctx.rank, n))

    WORLD.run(RunRequest(body, W, args=(shared,)))
    assert torch.equal(shared, torch.cat([_data(r, n) for r in range(W)]))


@pytest.mark.parametrize("n", [4, LARGE // W])
@pytest.mark.parametrize("out_in_input", [False, True])
def test_reduce_scatter_tensor_with_outputs_inside_inputs(n: int, out_in_input: bool) -> None:
    def body(ctx: Any) -> torch.Tensor:
        inp = _data(ctx.rank, n * W)
        out = inp[ctx.rank * n : (ctx.rank + 1) * n] if out_in_input else torch.empty(n)
        dist.reduce_scatter_tensor(out, inp)
        return out.clone()

    total = C.reduce_tensors("sum", [_data(r, n * W) for r in range(W)])
    for rank, got in enumerate(WORLD.run(RunRequest(body, W))):
        assert torch.equal(got, total[rank * n : (rank + 1) * n])


@pytest.mark.parametrize("shared", [False, True])
def test_broadcast_from_the_root_tensor_in_place(shared: bool) -> None:
    one = torch.zeros(LARGE)

    def body(ctx: Any) -> torch.Tensor:
        t = one if shared else torch.zeros(LARGE)
        if ctx.rank == 1:
            t.copy_(_data(1, LARGE))
        dist.broadcast(t, 1)
        return t.clone()

    for got in WORLD.run(RunRequest(body, W)):
        assert torch.equal(got, _data(1, LARGE))


def test_large_collectives_into_requires_grad_tensors_stay_out_of_autograd() -> None:
    def body(ctx: Any) -> tuple[bool, Any]:
        p = torch.nn.Parameter(torch.ones(LARGE))
        dist.all_reduce(p.data)
        dist.all_reduce(p)  # the Parameter itself, as gloo accepts it: no graph is recorded
        return p.requires_grad and p.grad_fn is None, p.grad_fn

    for ok, grad_fn in WORLD.run(RunRequest(body, W)):
        assert ok and grad_fn is None
