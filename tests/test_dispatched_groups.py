"""contract E16: dstest's groups reach torch's dispatcher as torch's own groups do.

Each stack body runs under ``CommDebugMode`` three ways: on torch's own ``ProcessGroupGloo`` (formed by the
body inside a worker's hidden world, exactly what a fresh process gets), on the process world's checked
groups, and on the threaded world. The counts of every c10d op must be gloo's. The raw-call body issues every
c10d method dstest's table has; the stack bodies are written as users of DTensor, tensor parallel, FSDP2 and
DDP write them.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dstest
from dstest.worlds import torch_internals

pytestmark = pytest.mark.cpu


def _counts(mode) -> dict[str, int]:
    return {str(op): n for op, n in sorted(mode.get_comm_counts().items(), key=lambda kv: str(kv[0]))}


def every_method(ctx):
    """One call of each c10d method dstest's groups implement, async handles waited."""
    r, n = ctx.rank, ctx.world_size
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.reduce(t.clone(), 0)  # gloo leaves partial sums in a non-root rank's buffer: not read
    dist.all_gather([torch.empty(4) for _ in range(n)], t)
    dist.all_gather_into_tensor(torch.empty(4 * n), t)
    dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n))
    dist.all_to_all_single(torch.empty(n), torch.arange(float(n)))
    dist.gather(t, [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0)
    dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(n)] if r == 0 else None, src=0)
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    dist.barrier()
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if r == 0:
        dist.send(torch.ones(2), 1)
    elif r == 1:
        dist.recv(got, 0)
    dist.all_reduce(t, async_op=True).wait()
    return t.tolist()


def redistribute(ctx):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = dist.device_mesh.init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(0)
    big = torch.randn(4 * ctx.world_size, 3)
    sharded = distribute_tensor(big, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()])
    back = replicated.redistribute(mesh, [Shard(1 % 2)])
    partial = DTensor.from_local(torch.full((2, 2), float(ctx.rank)), mesh, [Partial()])
    summed = partial.redistribute(mesh, [Replicate()])
    return [replicated.to_local().sum().item(), back.to_local().shape[1], summed.to_local().tolist()]


def tensor_parallel(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = dist.device_mesh.init_device_mesh("cpu", (ctx.world_size,))
    model = nn.Sequential(nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 4))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    return round(loss.item(), 5)


class MLP(nn.Module):
    """A model class of the user's own (``CommDebugMode``'s module tracker fails on an FSDP2-sharded
    ``nn.Sequential`` on torch's gloo too: IndexError in ``_fw_set_module_hook``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def fsdp2_step(ctx):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.inp)
    fully_shard(model.out)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + ctx.rank)
    loss = model(torch.randn(3, 6)).sum()
    loss.backward()
    optim.step()
    return round(loss.item(), 5), [round(p.to_local().sum().item(), 5) for p in model.parameters()]


def ddp_step(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    torch.manual_seed(1 + ctx.rank)
    model(torch.randn(3, 4)).sum().backward()
    return [round(x, 5) for x in model.module.weight.grad.flatten().tolist()]


def compiled(ctx):
    """A collective inside a function ``torch.compile`` traces (dynamo breaks the graph at it)."""

    def step(t):
        dist.all_reduce(t)
        return t * 2

    return torch.compile(step, backend="eager")(torch.ones(3) * (ctx.rank + 1)).tolist()


BODIES = {
    "compiled": compiled,
    "every_method": every_method,
    "redistribute": redistribute,
    "tensor_parallel": tensor_parallel,
    "fsdp2_step": fsdp2_step,
    "ddp_step": ddp_step,
}


def counted(ctx, name):
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        out = BODIES[name](ctx)
    return _counts(mode), out, type(dist.group.WORLD).__name__


def counted_on_own_gloo(ctx, name, path, checked):
    """The body on a world it forms itself with ``init_process_group("gloo")``, inside the worker's hidden
    world: torch's own ``ProcessGroupGloo`` when ``checked`` is False, the worker's checked groups else."""
    with torch_internals.hidden_c10d_world(checked=checked):
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=ctx.rank, world_size=ctx.world_size)
        try:
            return counted(ctx, name)
        finally:
            dist.destroy_process_group()


def _own_gloo(name, world_size, checked):
    path = os.path.join(tempfile.gettempdir(), f"dstest-e16-{uuid.uuid4().hex}")
    return dstest.run(counted_on_own_gloo, world_size, world="process", args=(name, path, checked))


CASES = [(name, w) for name in sorted(BODIES) for w in (2, 3) if name != "compiled" or w == 2]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize(("name", "world_size"), CASES)
def test_comm_debug_mode_counts_on_dstest_groups_equal_gloos(name, world_size):
    gloo = _own_gloo(name, world_size, checked=False)
    assert {kind for _, _, kind in gloo} == {"ProcessGroup"}  # torch's own gloo group
    assert all(counts for counts, _, _ in gloo), "the body issued no collective CommDebugMode saw"
    process = dstest.run(counted, world_size, world="process", args=(name,))
    assert {kind for _, _, kind in process} == {"CheckedGroup"}
    threaded = dstest.run(counted, world_size, args=(name,))
    for rank in range(world_size):
        assert process[rank][:2] == gloo[rank][:2], (rank, "process world", process[rank], gloo[rank])
        assert threaded[rank][:2] == gloo[rank][:2], (rank, "threaded world", threaded[rank], gloo[rank])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_checked_groups_formed_by_the_test_itself_count_as_gloo():
    """The compat plugins' road: a test forms its own world in the worker, on checked groups."""
    gloo = _own_gloo("every_method", 2, checked=False)
    checked = _own_gloo("every_method", 2, checked=True)
    assert {kind for _, _, kind in checked} == {"CheckedGroup"}
    assert [c[:2] for c in checked] == [g[:2] for g in gloo]


def mismatched_under_the_mode(ctx):
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode():
        dist.all_reduce(torch.ones(3 if ctx.rank == 0 else 4))


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_a_mismatch_seen_by_the_mode_is_still_caught(world):
    """The check across ranks runs on the dispatcher's road too (contract E2): routing loses nothing."""
    with pytest.raises(dstest.RankFailure, match="all_reduce"):
        dstest.run(mismatched_under_the_mode, 2, world=world)


def direct_op_call(ctx):
    torch.ops.c10d.barrier(torch.empty(1), dist.group.WORLD.boxed(), [], True, -1)


def test_an_op_called_directly_on_a_dstest_group_is_refused_by_name():
    with pytest.raises(dstest.RankFailure, match="called directly on a dstest group"):
        dstest.run(direct_op_call, 2, world="process")


class Seeing(torch.Tensor):
    """A tensor subclass that notes the c10d ops its ``__torch_dispatch__`` sees, as a wrapper subclass of a
    user's (a quantized or sharded tensor type) would handle them."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Seeing:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        made.inner, made.seen = inner, []
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten, tree_map_only

        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Seeing) and func.namespace == "c10d":
                t.seen.append(func.__name__)
        plain = tree_map_only(Seeing, lambda t: t.inner, (args, kwargs or {}))
        return func(*plain[0], **plain[1])


def subclass_in_collectives(ctx):
    t = Seeing(torch.full((3,), float(ctx.rank + 1)))
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    return t.seen, t.inner.tolist()


def subclass_on_own_gloo(ctx, path):
    with torch_internals.hidden_c10d_world(checked=False):
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=ctx.rank, world_size=ctx.world_size)
        try:
            return subclass_in_collectives(ctx)
        finally:
            dist.destroy_process_group()


def test_a_tensor_subclass_sees_the_collectives_it_takes_part_in_as_on_gloo():
    path = os.path.join(tempfile.gettempdir(), f"dstest-e16-{uuid.uuid4().hex}")
    gloo = dstest.run(subclass_on_own_gloo, 2, world="process", args=(path,))
    assert gloo[0] == (["allreduce_.default", "broadcast_.default"], [3.0, 3.0, 3.0])
    assert dstest.run(subclass_in_collectives, 2, world="process") == gloo
    assert dstest.run(subclass_in_collectives, 2) == gloo
