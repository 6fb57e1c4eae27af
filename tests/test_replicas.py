"""Replica checks (G4): ``ctx.assert_replicas`` and ``ctx.replicas_checked`` on both CPU worlds.

Five planted bugs in small real models, each left on purpose so that replicas that must be identical drift
apart, each caught (the message names the tensor and the ranks, and every rank raises the same message) and
each passing with the fix: (a) a DDP parameter left out of the reduction, (b) BatchNorm statistics never
broadcast, (c) noise drawn from a rank-seeded generator in the update, (d) a ZeRO shard updated twice,
(e) a tensor-parallel replicated LayerNorm weight whose gradient is not all-reduced. Then correct DDP,
FSDP2 and DTensor tensor-parallel bodies pass, tolerances, argument errors, and subgroup verdicts.

Bodies are module-level functions (the process world finds them by reference) that return the message of
the ``ReplicasDiverge`` they caught, or None; each test asserts the ranks all return the same.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import mlp

import dstest
from dstest.errors import InvalidArgument, ReplicasDiverge

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]


def _local_batch(ctx, din: int = 5, dout: int = 3, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank (data parallelism), from the rank's own generator."""
    return ctx.randn(rows, din), ctx.randn(rows, dout)


def _caught(ctx, model, **kwargs) -> str | None:
    try:
        ctx.assert_replicas(model, **kwargs)
    except ReplicasDiverge as e:
        return str(e)
    return None


def _same_everywhere(results: list[str | None]) -> str | None:
    assert all(r == results[0] for r in results), f"ranks disagree: {results}"
    return results[0]


# -- (a) DDP with a parameter left out of the reduction ---------------------------------------------------------
def ddp_ignored_parameter(ctx, fixed: bool, steps: int) -> str | None:
    """``_set_params_and_buffers_to_ignore_for_model`` (what code that manages a parameter itself calls) on
    '0.bias', which nothing else reduces: its gradient stays local and the step leaves each rank its own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp(0)
    if not fixed:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["0.bias"])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        with ctx.replicas_checked(ddp):  # checks after every opt.step()
            for _ in range(steps):
                x, y = _local_batch(ctx)
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
    except ReplicasDiverge as e:
        return str(e)
    return None


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_a_ddp_parameter_left_out_of_the_reduction(world, world_size, steps):
    msg = _same_everywhere(dstest.run(ddp_ignored_parameter, world_size, world=world, args=(False, steps)))
    assert msg is not None
    assert "parameter '0.bias'" in msg and "after optimizer step 1 (SGD)" in msg
    assert " vs ".join(f"ranks [{r}]" for r in range(world_size)) in msg
    assert "float32[7]" in msg and "largest absolute difference" in msg
    assert "'0.weight'" not in msg  # averaged by DDP: identical
    assert _same_everywhere(dstest.run(ddp_ignored_parameter, world_size, world=world, args=(True, steps))) is None


# -- (b) BatchNorm statistics never broadcast -------------------------------------------------------------------
def batchnorm_buffers(ctx, fixed: bool, steps: int) -> str | None:
    """BatchNorm's running statistics follow each rank's own batches; ``broadcast_buffers=False`` never makes
    them agree (``broadcast_buffers=False``, ``forward_sync_buffers=False`` from torch 2.13), so evaluation
    sees different statistics on every rank. With the default (True), DDP
    broadcasts rank 0's buffers before each forward: the evaluation forward starts from the same ones."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    # torch 2.13 renames the option (the old name warns); ``False`` under either name: no sync before forward.
    named = (
        "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
    )
    ddp = DDP(model, **{named: fixed})
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = _local_batch(ctx)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x + ctx.rank), y).backward()
        opt.step()
    ddp.eval()
    ddp(ctx.randn(2, 5))  # an evaluation forward (grad enabled: DDP syncs buffers first when told to)
    return _caught(ctx, ddp)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_b_batchnorm_buffers_not_broadcast(world, world_size):
    msg = _same_everywhere(dstest.run(batchnorm_buffers, world_size, world=world, args=(False, 2)))
    assert msg is not None
    assert "buffer '1.running_mean' (float32[6])" in msg and "also different: buffer '1.running_var'" in msg
    assert "ranks [0] vs ranks [1]" in msg
    assert _same_everywhere(dstest.run(batchnorm_buffers, world_size, world=world, args=(True, 2))) is None


# -- (c) a rank-dependent op in the update -----------------------------------------------------------------------
def noisy_update(ctx, fixed: bool, steps: int) -> str | None:
    """Gradient noise added after the all-reduce, drawn from the rank's own generator (``ctx.generator`` is
    seeded per rank): every rank's step differs. The fix draws from a generator seeded the same everywhere."""
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        x, y = _local_batch(ctx)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
            noise = torch.randn(p.shape, generator=shared if fixed else ctx.generator)
            p.grad += 1e-3 * noise
        opt.step()
    return _caught(ctx, model)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("world", WORLDS)
def test_c_rank_dependent_noise_in_the_update(world, steps):
    msg = _same_everywhere(dstest.run(noisy_update, 2, world=world, args=(False, steps)))
    assert msg is not None and "parameter '0.weight' (float32[7, 5])" in msg and "ranks [0] vs ranks [1]" in msg
    assert "also different: parameter '0.bias', parameter '2.weight', parameter '2.bias'" in msg
    assert _same_everywhere(dstest.run(noisy_update, 2, world=world, args=(True, steps))) is None


# -- (d) a ZeRO shard updated twice -------------------------------------------------------------------------------
def zero_shard_twice(ctx, fixed: bool, steps: int) -> str | None:
    """A hand-written ZeRO-1 step over one flat buffer the parameters are views of: each rank updates its shard
    of the fp32 master copy and all-gathers it. The planted bug: the owner also writes the update into its own
    parameters after the gather (a leftover "apply" of the old in-place path), so the owner's copy of its
    shard is updated twice while every other rank's copy of it is updated once."""
    model = mlp(2)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    w, lr = ctx.world_size, 0.1
    shard = -(-flat.numel() // w)
    padded = torch.zeros(shard * w)
    padded[: flat.numel()] = flat
    lo, hi = ctx.rank * shard, (ctx.rank + 1) * shard
    master = padded[lo:hi].clone()
    for _ in range(steps):
        x, y = _local_batch(ctx)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grad = torch.zeros(shard * w)
        grad[: flat.numel()] = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(grad)
        update = lr * grad[lo:hi] / w
        master -= update
        gathered = torch.empty(shard * w)
        dist.all_gather(list(gathered.chunk(w)), master)
        flat.copy_(gathered[: flat.numel()])
        if not fixed:
            end = min(hi, flat.numel())
            if end > lo:
                flat[lo:end] -= update[: end - lo]
    return _caught(ctx, model)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_d_zero_shard_updated_twice(world, world_size):
    msg = _same_everywhere(dstest.run(zero_shard_twice, world_size, world=world, args=(False, 1)))
    assert msg is not None
    # 66 elements: 0.weight (35) holds rank 0's shard at W = 2 and the shards of ranks 0 and 1 at W = 4.
    assert "parameter '0.weight' (float32[7, 5])" in msg
    assert " vs ".join(f"ranks [{r}]" for r in range(world_size)) in msg or "ranks [0] vs ranks [1" in msg
    assert _same_everywhere(dstest.run(zero_shard_twice, world_size, world=world, args=(True, 1))) is None


# -- (e) tensor parallel: a replicated LayerNorm whose gradient is not all-reduced --------------------------------
class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


class TPBlock(nn.Module):
    """LayerNorm (replicated) -> column-parallel Linear -> GELU -> row-parallel Linear, hidden split over W."""

    def __init__(self, rank: int, world_size: int, dim: int = 6, hidden: int = 8, reduce_ln_grad: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.norm = nn.LayerNorm(dim)
        w1, w2 = torch.randn(hidden, dim, generator=g) / dim**0.5, torch.randn(dim, hidden, generator=g) / hidden**0.5
        part = hidden // world_size
        self.up = nn.Parameter(w1[rank * part : (rank + 1) * part].clone())
        self.down = nn.Parameter(w2[:, rank * part : (rank + 1) * part].clone())
        self.reduce_ln_grad = reduce_ln_grad

    def forward(self, x):
        h = self.norm(x)
        if self.reduce_ln_grad:
            h = _CopyToTP.apply(h)
        h = nn.functional.gelu(h @ self.up.T)
        return _ReduceFromTP.apply(h @ self.down.T)


def tp_layernorm(ctx, fixed: bool, steps: int) -> str | None:
    """Every TP rank sees the same batch; only the sharded weights may differ. Without the backward all-reduce
    (Megatron's f) the LayerNorm weight and bias get each rank's partial gradient and drift apart."""
    block = TPBlock(ctx.rank, ctx.world_size, reduce_ln_grad=fixed)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    replicated = {"norm.weight": block.norm.weight, "norm.bias": block.norm.bias}
    g = torch.Generator().manual_seed(7)  # the same batch on every TP rank
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        opt.zero_grad()
        block(x).pow(2).mean().backward()
        opt.step()
    return _caught(ctx, replicated, what="TPBlock's replicated parameters")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_e_tensor_parallel_layernorm_gradient_not_reduced(world, world_size):
    msg = _same_everywhere(dstest.run(tp_layernorm, world_size, world=world, args=(False, 2)))
    assert msg is not None
    assert msg.startswith("replicas of TPBlock's replicated parameters diverge over ranks")
    assert "tensor 'norm.weight' (float32[6])" in msg and "also different: tensor 'norm.bias'" in msg
    assert "ranks [0] vs ranks [1]" in msg
    assert _same_everywhere(dstest.run(tp_layernorm, world_size, world=world, args=(True, 2))) is None


# -- correct stacks pass -----------------------------------------------------------------------------------------
def _cpu_mesh(*shape: int, names: tuple[str, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@dstest.spec(world_size=[2, 4], worlds=WORLDS, contract="G4")
def test_correct_ddp_passes_after_every_step(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(mlp(0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    with ctx.replicas_checked(ddp):
        for _ in range(3):
            x, y = _local_batch(ctx)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    ctx.assert_replicas(ddp)
    dstest.assert_replicas(ddp.module)


@dstest.spec(world_size=[2, 4], worlds=WORLDS, contract="G4")
def test_correct_fsdp2_passes(ctx):
    """FSDP2 on the world's mesh: shards differ by design, nothing of them is compared; the full parameters
    agree (full_tensor), and so does a BatchNorm buffer the body keeps in sync."""
    from torch.distributed.fsdp import fully_shard

    model = mlp(4)
    fully_shard(model, mesh=_cpu_mesh(ctx.world_size))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ctx.replicas_checked(model):
        for _ in range(2):
            x, y = _local_batch(ctx)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ctx.assert_replicas({name: p.full_tensor() for name, p in model.named_parameters()})


def fsdp2_replicas(ctx, fixed: bool) -> str | None:
    """Two FSDP2 replicas of 2 ranks each (a hand-made HSDP without gradient exchange between replicas, both
    fed the same batches): each parameter's mesh is half the world, so its full tensor is compared across the
    world. The bug feeds the second replica other data."""
    from torch.distributed.fsdp import fully_shard

    mesh = _cpu_mesh(2, 2, names=("replica", "shard"))
    model = mlp(5)
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replica, shard = ctx.rank // 2, ctx.rank % 2
    g = torch.Generator().manual_seed(10 + shard + (0 if fixed else 100 * replica))
    x, y = torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return _caught(ctx, model)


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_full_tensors_across_replicas(world):
    msg = _same_everywhere(dstest.run(fsdp2_replicas, 4, world=world, args=(False,)))
    assert msg is not None and "parameter '0.weight' (full tensor) (float32[7, 5])" in msg
    assert "ranks [0, 1] vs ranks [2, 3]" in msg
    assert _same_everywhere(dstest.run(fsdp2_replicas, 4, world=world, args=(True,))) is None


def dtensor_tp(ctx, corrupt: bool) -> str | None:
    """DTensor tensor parallel: Colwise then Rowwise. The Rowwise bias is Replicate: its local tensors are
    compared over the mesh; the LayerNorm before them stays a plain tensor, compared over the world."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    w = ctx.world_size
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 2 * w), nn.ReLU(), nn.Linear(2 * w, 6))
    parallelize_module(model, _cpu_mesh(w), {"1": ColwiseParallel(), "3": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    with ctx.replicas_checked(model):
        model(x).pow(2).sum().backward()
        opt.step()
    if corrupt and ctx.rank == w - 1:
        with torch.no_grad():
            model[3].bias.to_local()[2] += 0.5
    return _caught(ctx, model)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_tensor_parallel(world, world_size):
    assert _same_everywhere(dstest.run(dtensor_tp, world_size, world=world, args=(False,))) is None
    msg = _same_everywhere(dstest.run(dtensor_tp, world_size, world=world, args=(True,)))
    last = world_size - 1
    assert msg is not None and "parameter '3.bias' (local, Replicate on mesh dim 0) (float32[6])" in msg
    assert f"ranks {list(range(last))} vs ranks [{last}]" in msg
    assert "largest absolute difference 0.5 at index (2,)" in msg


def fsdp2_tp_2d(ctx, corrupt: bool) -> str | None:
    """FSDP2 on dp over tensor parallel on tp, a (2, 2) mesh: a Rowwise bias is (Shard(0) on dp, Replicate on
    tp): its local shard is compared over each tp group ({0, 1} and {2, 3}). Corrupting rank 3's copy shows in
    group {2, 3} only; ranks 0 and 1 raise the same error (the verdict is agreed over the world)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _cpu_mesh(2, 2, names=("dp", "tp"))
    model = mlp(8, dims=(5, 6, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(20 + ctx.rank // 2)  # dp ranks split the batch; tp ranks share it
    x, y = torch.randn(2, 5, generator=g), torch.randn(2, 4, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if corrupt and ctx.rank == 3:
        with torch.no_grad():
            model[2].bias.to_local().add_(1.0)
    return _caught(ctx, model)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_with_tensor_parallel_subgroup_verdict(world):
    assert _same_everywhere(dstest.run(fsdp2_tp_2d, 4, world=world, args=(False,))) is None
    msg = _same_everywhere(dstest.run(fsdp2_tp_2d, 4, world=world, args=(True,)))
    assert msg is not None and "parameter '2.bias' (local, Replicate on mesh dim 1 'tp')" in msg
    assert "ranks [2] vs ranks [3]" in msg


# -- tolerances, structure, arguments ------------------------------------------------------------------------------
@dstest.spec(world_size=[2, 4], worlds=WORLDS, contract="G4")
def test_tolerance(ctx):
    """A difference of 1e-4 fails bit for bit, passes with atol=1e-3, fails with atol=1e-5; rtol scales with
    the lowest rank's value."""
    base = torch.linspace(1, 2, 12).reshape(3, 4)
    t = base.clone()
    if ctx.rank == 1:
        t[2, 3] += 1e-4
    with pytest.raises(ReplicasDiverge, match=r"tensor 'x' \(float32\[3, 4\]\) differs bit for bit") as info:
        ctx.assert_replicas({"x": t})
    assert "at index (2, 3)" in str(info.value)
    want = " vs ".join(["ranks [0" + "".join(f", {r}" for r in range(2, ctx.world_size)) + "]", "ranks [1]"])
    assert want in str(info.value)
    ctx.assert_replicas({"x": t}, atol=1e-3)
    ctx.assert_replicas({"x": t}, rtol=1e-4)  # 1e-4 <= 1e-4 * 2
    with pytest.raises(ReplicasDiverge, match="beyond rtol=0, atol=1e-05"):
        ctx.assert_replicas({"x": t}, atol=1e-5)
    ctx.assert_replicas([base, torch.arange(5), torch.ones(2, dtype=torch.bool)])
    with pytest.raises(ReplicasDiverge, match=r"tensor \[0\] \(bool\[3\]\) differs beyond"):  # no tolerance for bool
        ctx.assert_replicas([torch.tensor([True, False, ctx.rank == 1])], atol=1.0)


@dstest.spec(world_size=[2], worlds=WORLDS, contract="G4")
def test_other_dtypes_and_odd_sizes(ctx):
    """bf16 (which numpy does not know), complex, float64, int8 and sizes that are no multiple of a word."""
    for dtype, size in ((torch.bfloat16, 7), (torch.complex64, 5), (torch.float64, 2051), (torch.int8, 13)):
        t = (torch.arange(size) % 5).to(dtype)
        ctx.assert_replicas({"t": t})
        if ctx.rank == 1:
            t[size - 1] += 1
        with pytest.raises(ReplicasDiverge) as info:
            ctx.assert_replicas({"t": t})
        name = str(dtype).removeprefix("torch.")
        assert f"tensor 't' ({name}[{size}]) differs bit for bit: ranks [0] vs ranks [1]" in str(info.value)
        assert f"largest absolute difference 1 at index ({size - 1},)" in str(info.value)
    # Every float bit pattern counts: -0.0 is not 0.0, a NaN is equal to itself.
    ctx.assert_replicas([torch.tensor([float("nan"), 1.0])])
    with pytest.raises(ReplicasDiverge, match=r"tensor \[0\] \(float32\[1\]\) differs bit for bit"):
        ctx.assert_replicas([torch.tensor([-0.0 if ctx.rank else 0.0])])


@dstest.spec(world_size=[2], worlds=WORLDS, contract="G4")
def test_permuted_values_and_integer_tensors(ctx):
    """The same multiset of values in other positions differs; integer and bool tensors compare too."""
    t = torch.arange(6.0)
    if ctx.rank == 1:
        t = t.flip(0)
    with pytest.raises(ReplicasDiverge, match=r"tensor \[0\] \(float32\[6\]\)"):
        ctx.assert_replicas([t])
    flags = torch.tensor([True, ctx.rank == 0])
    with pytest.raises(
        ReplicasDiverge, match=r"tensor 'flags' \(bool\[2\]\) differs bit for bit: ranks \[0\] vs ranks \[1\]"
    ):
        ctx.assert_replicas({"flags": flags})
    with pytest.raises(ReplicasDiverge, match="index \\(1,\\) \\(rank 0: 7, rank 1: 8\\)"):
        ctx.assert_replicas({"n": torch.tensor([3, 7 + ctx.rank])})


@dstest.spec(world_size=[2, 4], worlds=WORLDS, contract="G4")
def test_shapes_and_structure_that_differ(ctx):
    with pytest.raises(
        ReplicasDiverge, match=r"tensor 'x' has different shapes or dtypes: ranks \[0\] float32\[2\] vs ranks \[1"
    ):
        ctx.assert_replicas({"x": torch.zeros(2 + min(ctx.rank, 1))})
    with pytest.raises(ReplicasDiverge, match=r"different shapes or dtypes: .*float32.* vs .*float64"):
        ctx.assert_replicas({"x": torch.zeros(2, dtype=torch.float64 if ctx.rank else torch.float32)})
    names = {"a": torch.zeros(1)} if ctx.rank == 0 else {"a": torch.zeros(1), "b": torch.zeros(1)}
    others = list(range(1, ctx.world_size))
    with pytest.raises(ReplicasDiverge) as info:
        ctx.assert_replicas(names)
    want = f"the ranks hold different tensors (rank 0 holds 1: tensor 'a'): ranks {others} hold tensor 'b' extra"
    assert want in str(info.value)
    ctx.assert_replicas({"x": torch.zeros(3)})  # the world goes on


@dstest.spec(world_size=[4], worlds=WORLDS, contract="G4")
def test_subgroups(ctx):
    """Over a subgroup, only its ranks call; each pair compares its own copies."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[ctx.rank // 2]
    t = torch.tensor([float(ctx.rank // 2)])
    ctx.assert_replicas([t], group=mine)
    with pytest.raises(
        ReplicasDiverge, match=r"over ranks \[0, 1, 2, 3\]: tensor \[0\] .* ranks \[0, 1\] vs ranks \[2, 3\]"
    ):
        ctx.assert_replicas([t])
    if ctx.rank < 2:
        with pytest.raises(InvalidArgument, match=r"rank [01] is not a member"):
            ctx.assert_replicas([t], group=pairs[1])


@dstest.spec(world_size=[2], worlds=WORLDS, contract="G4")
def test_argument_errors(ctx):
    """Raised before any collective: the world's calls stay matched (a rank raising alone hangs nothing)."""
    t = torch.zeros(2)
    with pytest.raises(InvalidArgument, match=r"rtol=-1.0: must be a finite number >= 0"):
        ctx.assert_replicas([t], rtol=-1.0)
    with pytest.raises(InvalidArgument, match=r"atol=nan"):
        ctx.assert_replicas([t], atol=float("nan"))
    with pytest.raises(InvalidArgument, match="tensor 'b' is a int, not a tensor"):
        ctx.assert_replicas({"a": t, "b": 3})
    with pytest.raises(InvalidArgument, match=r"tensor 'a' is a torch\.sparse_coo tensor on cpu; it compares dense"):
        ctx.assert_replicas({"a": t.to_sparse()})
    with pytest.raises(InvalidArgument, match="assert_replicas got a str"):
        ctx.assert_replicas("model")
    with pytest.raises(InvalidArgument, match=r"group=3: must be a torch\.distributed ProcessGroup"):
        ctx.assert_replicas([t], group=3)
    with pytest.raises(InvalidArgument, match="replicas_checked: module is a list"):
        ctx.replicas_checked([t])
    if ctx.rank == 0:  # one rank alone: nothing was sent
        with pytest.raises(InvalidArgument):
            ctx.assert_replicas([t], rtol=-1)
    dist.barrier()


def test_outside_a_rank_body_is_an_invalid_argument():
    with pytest.raises(InvalidArgument, match="not initialized"):
        dstest.assert_replicas([torch.zeros(1)])


def test_replicas_checked_removes_its_hook():
    from torch.optim import optimizer as optimizer_module

    before = len(optimizer_module._global_optimizer_post_hooks)

    def body(ctx):
        m = nn.Linear(2, 2)
        with ctx.replicas_checked(m):
            inside = len(optimizer_module._global_optimizer_post_hooks)
        return inside, len(optimizer_module._global_optimizer_post_hooks)

    assert dstest.run(body, 2) == [(before + 1, before)] * 2
    assert len(optimizer_module._global_optimizer_post_hooks) == before


def _swap_and_change(ctx) -> list[str | None]:
    t = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    out = [_caught(ctx, [t])]
    swapped = t.clone()
    if ctx.rank == 1:
        swapped[[5, 17]] = swapped[[17, 5]]  # the same values in other places
    out.append(_caught(ctx, [swapped]))
    return out


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_elements_found_on_both_paths(monkeypatch, path):
    """The elements that differ are found with numpy where it is there and with torch where it is not (torch runs
    without numpy): both name the swapped pair; the digest reads bytes without numpy either way."""
    from dstest.replicas import values

    if path == "torch":
        monkeypatch.setattr(values, "_numpy", lambda: None)
    results = dstest.run(_swap_and_change, 2)
    assert results[0] == results[1]
    assert results[0][0] is None
    assert "tensor [0] (float32[3000]) differs bit for bit: ranks [0] vs ranks [1]" in str(results[0][1])
    assert "at index (17,)" in str(results[0][1]) or "at index (5,)" in str(results[0][1])
    t = torch.arange(10.0)
    assert values._digest(t) == values._digest(t.clone())
    assert values._digest(t) != values._digest(t.flip(0))


@dstest.spec(world_size=[2], worlds=WORLDS, contract="G4")
def test_replicas_checked_follows_only_the_modules_optimizers(ctx):
    """An optimizer of other parameters (rank-local ones, different by design) triggers no check; the module's
    own optimizer does, at each step, and the step count is in the message."""
    model, local = mlp(0), nn.Linear(2, 2)
    with torch.no_grad():
        local.weight.fill_(float(ctx.rank))
    shared_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    with ctx.replicas_checked(model):
        for step in range(1, 4):
            local(ctx.randn(1, 2)).sum().backward()
            local_opt.step()  # no check: not the module's parameters
            model(torch.ones(1, 5)).sum().backward()
            if step == 3 and ctx.rank == 1:
                model[0].bias.grad[0] += 1.0
            if step < 3:
                shared_opt.step()
                continue
            with pytest.raises(ReplicasDiverge, match=r"replicas of Sequential after optimizer step 3 \(SGD\)"):
                shared_opt.step()
    shared_opt.step()  # outside the block: no check


# -- issue 40, finding 1: differences that a linear fingerprint let cancel ------------------------------------------
# Each body returns what every rank caught (a ReplicasDiverge's message, or None): the test asserts that all ranks
# agree and that the replicas which differ are reported. Before the digest of the bytes, the first three passed
# silently (two wrapping sums of 8-byte words, one weighted with a period of 1024 words, cancel them).
def sign_flipped_linspace(ctx) -> str | None:
    """Rank 1 holds -t: the words of t and -t differ in the sign bit only, and 2048 sign bits cancel in a wrapping
    sum of 2**63s."""
    t = torch.linspace(1, 2, 2048, dtype=torch.float64)
    return _caught(ctx, {"w": t if ctx.rank == 0 else -t})


def two_negative_zeros(ctx) -> str | None:
    """Two elements 0.0 on rank 0, -0.0 on rank 1 (each adds 2**63 to a wrapping sum: together nothing)."""
    t = torch.ones(1024, dtype=torch.float64)
    t[[10, 500]] = -0.0 if ctx.rank == 1 else 0.0
    return _caught(ctx, {"w": t})


def rows_swapped(ctx) -> str | None:
    """Rows 0 and 1 of a [4, 2048] float32 tensor swapped on rank 1: a move by 1024 words, the weights' period."""
    t = torch.arange(4 * 2048, dtype=torch.float32).reshape(4, 2048)
    if ctx.rank == 1:
        t = t[[1, 0, 2, 3]]
    return _caught(ctx, {"w": t})


@pytest.mark.parametrize("body", [sign_flipped_linspace, two_negative_zeros, rows_swapped])
@pytest.mark.parametrize("world", WORLDS)
def test_differences_a_linear_fingerprint_cancels_are_caught(world, body):
    msg = _same_everywhere(dstest.run(body, 2, world=world))
    assert msg is not None, f"{body.__name__}: replicas that differ passed"
    assert "tensor 'w' (" in msg and "differs bit for bit: ranks [0] vs ranks [1]" in msg


def identical_conjugate_views(ctx) -> list[str | None]:
    """A conjugate view (``conj()``: a flag, not a copy) and a negative view (``conj().imag``) compared as the
    values they stand for: identical ones pass, and a changed one is reported with its logical values."""
    z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10).reshape(2, 3)
    out = [_caught(ctx, {"conj": z.conj(), "neg": z.conj().imag, "t": z.conj().t()})]
    w = z.clone()
    if ctx.rank == 1:
        w[1, 2] = complex(5, 16)  # conj: 5-16j against rank 0's 5-15j
    out.append(_caught(ctx, {"conj": w.conj()}))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_conjugate_and_negative_views(world):
    same, changed = _same_everywhere([tuple(r) for r in dstest.run(identical_conjugate_views, 2, world=world)])
    assert same is None
    assert changed is not None and "tensor 'conj' (complex64[2, 3]) differs bit for bit" in changed
    assert "at index (1, 2) (rank 0: (5-15j), rank 1: (5-16j))" in changed


def dict_in_another_order(ctx) -> list[str | None]:
    """The same keys, inserted in another order on rank 1: compared by key, so equal; and a difference is named
    by its key whatever the order."""
    a, b = torch.arange(3.0), torch.arange(5)
    same = {"a": a, "b": b} if ctx.rank == 0 else {"b": b, "a": a}
    changed = {"a": a, "b": b + ctx.rank} if ctx.rank == 0 else {"b": b + ctx.rank, "a": a}
    return [_caught(ctx, same), _caught(ctx, changed)]


@pytest.mark.parametrize("world", WORLDS)
def test_dict_insertion_order_does_not_matter(world):
    same, changed = _same_everywhere([tuple(r) for r in dstest.run(dict_in_another_order, 2, world=world)])
    assert same is None
    assert changed is not None and "tensor 'b' (int64[5]) differs bit for bit: ranks [0] vs ranks [1]" in changed


def keys_missing_and_extra(ctx) -> str | None:
    """Rank 0 holds a, b, c; rank 1 lacks b and holds d instead (a renamed key), in another order."""
    t = torch.zeros(2)
    held = {"a": t, "b": t, "c": t} if ctx.rank == 0 else {"d": t, "c": t, "a": t}
    return _caught(ctx, held)


@pytest.mark.parametrize("world", WORLDS)
def test_missing_and_extra_keys_are_named(world):
    msg = _same_everywhere(dstest.run(keys_missing_and_extra, 2, world=world))
    assert msg is not None and "the ranks hold different tensors" in msg
    assert "ranks [1] lack tensor 'b' and hold tensor 'd' extra" in msg


def tolerance_edges(ctx) -> list[str | None]:
    """Under a tolerance: int64 values one apart near 2**60 (equal once rounded to float64) are one apart, not
    zero; an infinity is close to itself only (|5 - inf| <= rtol * inf holds in IEEE arithmetic)."""
    big = torch.tensor([2**60 + ctx.rank, 3])
    inf = torch.tensor([float("inf") if ctx.rank == 0 else 5.0, 1.0])
    same_inf = torch.tensor([float("inf"), float("-inf"), float("nan")])
    return [
        _caught(ctx, {"big": big}, atol=0.5),
        _caught(ctx, {"big": big}, atol=1),
        _caught(ctx, {"inf": inf}, rtol=0.1),
        _caught(ctx, {"same": same_inf}, rtol=0.1),
    ]


@pytest.mark.parametrize("world", WORLDS)
def test_tolerance_edges(world):
    one_apart, within, inf, same = _same_everywhere([tuple(r) for r in dstest.run(tolerance_edges, 2, world=world)])
    assert one_apart is not None and "tensor 'big' (int64[2]) differs beyond rtol=0, atol=0.5" in one_apart
    assert "largest absolute difference 1 at index (0,)" in one_apart
    assert within is None
    assert inf is not None and "tensor 'inf' (float32[2]) differs beyond rtol=0.1, atol=0" in inf
    assert "largest absolute difference inf at index (0,) (rank 0: inf, rank 1: 5)" in inf
    assert same is None


def one_element_of_a_strided_view(ctx) -> list[str | None]:
    """One element of a strided view: ``contiguous()`` keeps a one-element tensor's stride (it counts as
    contiguous), and a flat view of it with stride 2 cannot be read as bytes. Found by the properties of
    tests/test_checker_properties_replicas.py."""
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        phys = torch.full((1, 3), 5 + (ctx.rank if dtype == torch.int64 else 0)).to(dtype)
        phys[0, 1] = 2
        out.append(_caught(ctx, {"v": phys[:, 1:2:2]}))  # [1, 1], strides (3, 2), holding 2 on every rank
    out.append(_caught(ctx, {"v": torch.full((1, 3), float(ctx.rank))[:, 1:2:2]}))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_one_element_of_a_strided_view(world):
    *same, changed = _same_everywhere([tuple(r) for r in dstest.run(one_element_of_a_strided_view, 2, world=world)])
    assert same == [None, None, None]
    assert changed is not None and "tensor 'v' (float32[1, 1]) differs bit for bit: ranks [0] vs ranks [1]" in changed


class _Alike:
    """A dict key that prints as the string 'a' does: a name assert_replicas cannot tell from 'a'."""

    def __repr__(self) -> str:
        return "'a'"


def names_alike(ctx) -> list[str]:
    """Rank 1 holds 'a' and a key printing alike: every rank raises the same InvalidArgument (the names are judged
    from what the ranks gathered), and the world goes on to a check that passes."""
    t = torch.zeros(2)
    held = {"a": t} if ctx.rank == 0 else {"a": t, _Alike(): t}
    with pytest.raises(InvalidArgument) as info:
        ctx.assert_replicas(held)
    ctx.assert_replicas({"a": t})
    return [str(info.value)]


@pytest.mark.parametrize("world", WORLDS)
def test_names_alike_are_an_invalid_argument_on_every_rank(world):
    (msg,) = _same_everywhere([tuple(r) for r in dstest.run(names_alike, 2, world=world)])
    assert "rank 1 holds two tensors named tensor 'a'" in msg and "give them names that differ" in msg
