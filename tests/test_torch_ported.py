"""A sample of torch's own threaded-group tests, rewritten as dstest specs (contract E6; issue 9, item 8).

torch runs these bodies on its private threaded process group (``MultiThreadedTestCase``,
``spawn_threads_and_init_comms``, ``FSDPTestMultiThread``, ``DTensorOpTestBase``), most at one world size
and several only with a GPU. Here each runs on dstest's threaded world and on the process world (gloo) at
several world sizes, on CPU. The comment above each spec names the torch test it corresponds to (read from
pytorch/pytorch's test/distributed tree); the bodies are written anew, not copied.
"""

from __future__ import annotations

import functools
import operator
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dstest
from dstest.errors import RankFailure
from dstest.worlds import torch_internals
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]


# torch: test/distributed/test_multi_threaded_pg.py, TestCollectivesWithBaseClass.test_all_to_all (W=4 there).
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_all_to_all_list(ctx):
    """Rank r sends block r*W + j to rank j; rank r receives blocks j*W + r, for j in order."""
    if ctx.world == "process" and not torch_internals.gloo_has_list_all_to_all():
        pytest.skip("torch 2.11's gloo has no list all_to_all (added in 2.12)")
    w, r = ctx.world_size, ctx.rank
    send = [torch.full((2, 3), float(r * w + j)) for j in range(w)]
    recv = [torch.empty(2, 3) for _ in range(w)]
    dist.all_to_all(recv, send)
    for j, got in enumerate(recv):
        assert torch.equal(got, torch.full((2, 3), float(j * w + r)))


# torch: test/distributed/test_multi_threaded_pg.py, TestCollectivesWithBaseClass.test_all_reduce_ops.
# (torch's threaded group at first implemented SUM only; its test then expected MAX to raise.)
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_all_reduce_every_op(ctx):
    """Each rank contributes rank + 1; every reduce op gives the fold of 1..W under that op."""
    values = range(1, ctx.world_size + 1)
    expected = {
        dist.ReduceOp.SUM: sum(values),
        dist.ReduceOp.PRODUCT: functools.reduce(operator.mul, values),
        dist.ReduceOp.MIN: 1,
        dist.ReduceOp.MAX: ctx.world_size,
        dist.ReduceOp.BAND: functools.reduce(operator.and_, values),
        dist.ReduceOp.BOR: functools.reduce(operator.or_, values),
        dist.ReduceOp.BXOR: functools.reduce(operator.xor, values),
    }
    for op, want in expected.items():
        t = torch.tensor([ctx.rank + 1])
        dist.all_reduce(t, op=op)
        assert t.item() == want, (op, t.item(), want)


# torch: test/distributed/test_multi_threaded_pg.py, TestCollectivesWithBaseClass.test_subpg.
@dstest.spec(world_size=[4], worlds=WORLDS, contract="E6")
def test_disjoint_subgroups_reduce_concurrently(ctx):
    """Two disjoint pairs all-reduce at the same time, each over its own members only."""
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    t = torch.full((3, 3), float(ctx.rank))
    dist.all_reduce(t, group=low if ctx.rank < 2 else high)
    assert torch.equal(t, torch.full((3, 3), 1.0 if ctx.rank < 2 else 5.0))


# torch: test/distributed/test_multi_threaded_pg.py, TestCollectivesWithBaseClass.test_using_pg_from_another_thread
# (torch's test only checks that the call returns; here the result is checked too).
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_world_group_from_a_helper_thread(ctx):
    """A thread that the rank starts all-reduces a requires-grad tensor over the world group, as that rank."""
    out: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def helper(pg):
        try:
            x = torch.full((4,), float(ctx.rank), requires_grad=True)
            dist.all_reduce(x, group=pg)
            out.append(x.detach().clone())
        except BaseException as exc:  # reported below, on the rank
            errors.append(exc)

    t = threading.Thread(target=helper, args=(dist.group.WORLD,))
    t.start()
    t.join()
    assert not errors, errors
    assert torch.equal(out[0], torch.full((4,), float(sum(range(ctx.world_size)))))


# torch: test/distributed/test_multi_threaded_pg.py, TestCollectivesWithWrapper.test_collective_error_on_rank_non_zero
# (and ..._on_rank_zero, ..._non_zero_all): a rank fails between two all_gathers; the run reports that rank's
# error, and the ranks waiting in the second all_gather are released instead of hanging.
@pytest.mark.parametrize("failing", [[0], [1], [1, 2, 3]], ids=["rank0", "rank1", "all-nonzero"])
def test_rank_failure_between_collectives_is_reported(failing):
    def body(ctx):
        x = torch.full((3, 3), float(ctx.rank))
        outs = [torch.empty(3, 3) for _ in range(ctx.world_size)]
        dist.all_gather(outs, x)
        if ctx.rank in failing:
            raise AssertionError(f"deliberate failure on rank {ctx.rank}")
        dist.all_gather(outs, x)

    with pytest.raises(RankFailure) as info:
        ThreadedWorld().run(RunRequest(body, 4, timeout=30))
    message = str(info.value)
    for rank in failing:
        assert f"deliberate failure on rank {rank}" in message
    assert "WorldTimeout" not in message


class _MLP(nn.Module):
    """in_proj -> relu -> out_proj, like the MLP of torch's FSDP test utilities (odd sizes: uneven shards)."""

    def __init__(self, dim: int, mult: int = 3) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * mult)
        self.out_proj = nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


# torch: test/distributed/_composable/fsdp/test_fully_shard_init.py,
# TestFullyShardShardedParameterTensor.test_shard_tensor_parameters (FSDPTestMultiThread, W=2, GPU-only there).
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_fsdp2_shards_parameters_as_torch_chunk(ctx):
    """After fully_shard every parameter is a Shard(0) DTensor with the original size and stride whose local
    tensor is torch.chunk's piece for this rank (empty where W exceeds the rows); also with a shared module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for share in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[_MLP(3) for _ in range(3)])
        if share:
            model[0].in_proj = model[1].in_proj
        before = [p.detach().clone() for p in model.parameters()]
        fully_shard(model, mesh=mesh)
        after = list(model.parameters())
        assert len(after) == len(before)
        for orig, sharded in zip(before, after):
            assert isinstance(sharded, DTensor) and sharded.placements == (Shard(0),)
            assert sharded.device_mesh == mesh
            assert sharded.size() == orig.size() and sharded.stride() == orig.stride()
            chunks = torch.chunk(orig, ctx.world_size, dim=0)
            want = chunks[ctx.rank] if ctx.rank < len(chunks) else orig.new_empty((0, *orig.shape[1:]))
            assert torch.equal(sharded.to_local(), want)


# torch: test/distributed/_composable/fsdp/test_fully_shard_init.py, TestFullyShardLazyInit.test_fully_shard_is_root
# and test_fully_shard_module_and_param_fqns (FSDPTestMultiThread, W=2 there). Uses FSDP2's private state API.
@dstest.spec(world_size=[2, 3], worlds=WORLDS, contract="E6")
def test_fsdp2_lazy_init_root_and_fqns(ctx):
    """Sharding two submodules and then the root: after lazy init only the root is root, the root's group
    holds the parameters of the unsharded child, and each child's group its own, by fully qualified name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = nn.Sequential(_MLP(8), _MLP(8))
    fully_shard(model[0].in_proj, mesh=mesh)
    fully_shard(model[0].out_proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    root = fully_shard.state(model)
    root._lazy_init()
    first, second = fully_shard.state(model[0].in_proj), fully_shard.state(model[0].out_proj)
    assert root._is_root and not first._is_root and not second._is_root
    assert root._state_ctx.all_states == [root, first, second]

    def fqns(state):
        return {p._param_fqn for p in state._fsdp_param_group.fsdp_params}

    assert fqns(root) == {f"1.{m}.{k}" for m in ("in_proj", "out_proj") for k in ("weight", "bias")}
    assert fqns(first) == {"0.in_proj.weight", "0.in_proj.bias"}
    assert fqns(second) == {"0.out_proj.weight", "0.out_proj.bias"}
    assert first._fsdp_param_group._module_fqn == "0.in_proj"


# torch: test/distributed/tensor/test_pointwise_ops.py, DistElementwiseOpsTest.test_activations (DTensorOpTestBase).
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_dtensor_activations_match_local(ctx):
    """gelu / relu / sigmoid on Shard(0), Shard(1) and Replicate DTensors, forward and backward, against the
    same op on the full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    gen = torch.Generator().manual_seed(3)
    cases = [
        ((8, 5), Shard(0), nn.functional.gelu),
        ((8, 5), Replicate(), nn.functional.gelu),
        ((3, 12), Shard(1), nn.functional.relu),
        ((8, 5), Replicate(), nn.functional.relu),
        ((7, 5), Shard(0), torch.sigmoid),
        ((8, 5), Replicate(), torch.sigmoid),
    ]
    for size, placement, op in cases:
        full = torch.randn(*size, generator=gen)
        ref = full.clone().requires_grad_()
        op(ref).pow(2).sum().backward()
        x = distribute_tensor(full, mesh, [placement]).requires_grad_()
        y = op(x)
        assert y.placements == (placement,)
        torch.testing.assert_close(y.full_tensor(), op(full))
        y.pow(2).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)


# torch: test/distributed/tensor/test_pointwise_ops.py, DistElementwiseOpsTest.test_mul_out (DTensorOpTestBase).
@dstest.spec(world_size=[2, 3, 4], worlds=WORLDS, contract="E6")
def test_dtensor_mul_out(ctx):
    """torch.mul(a, b, out=c) on Shard(0) DTensors writes each rank's local product into c's local tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    a, b, c = ctx.randn(8, 4), ctx.randn(8, 4), ctx.randn(8, 4)
    da, db = DTensor.from_local(a, mesh, [Shard(0)]), DTensor.from_local(b, mesh, [Shard(0)])
    dc = DTensor.from_local(c.clone(), mesh, [Shard(0)])
    result = torch.mul(da, db, out=dc)
    assert torch.equal(da.to_local(), a)
    assert torch.equal(result.to_local(), a * b) and torch.equal(dc.to_local(), a * b)
