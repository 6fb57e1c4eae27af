"""torch's own stacks on dstest's CPU worlds (contract E6; issue 9, items 2 and 8).

Each spec is what a user of DeviceMesh, DTensor, functional collectives, FSDP2, tensor parallel, DDP,
FSDP1, DCP, pipelining or the object collectives would write: run the distributed code on every rank and
compare it with a single-process reference computed inside the spec from the same seed and the same data
(the full model on one rank-local copy, trained on the concatenated global batch).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import mlp
from packaging.version import Version

import dstest
from dstest.worlds.request import RunRequest

pytestmark = [
    pytest.mark.cpu,
    # torch 2.13 deprecates these spellings, which downstream code still calls: the specs call them on purpose.
    pytest.mark.filterwarnings("ignore:`torch.distributed._functional_collectives.*` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The combination of ranks \\+ tag as process group identifier:FutureWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional.* is deprecated:FutureWarning"),
]

WORLDS = ["threaded", "process"]
SIZES = [2, 3, 4]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _close(got: torch.Tensor, want: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(got, want, **(tol or TOL))


def _global(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank (and in the reference): drawn from a private generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _cpu_mesh(*shape: int, names: tuple[str, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


# -- DeviceMesh --------------------------------------------------------------------------------------------
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_device_mesh_1d(ctx):
    """A 1-D mesh: its group is the world; a collective over it gives the reference sum."""
    mesh = _cpu_mesh(ctx.world_size, names=("dp",))
    assert mesh.size() == ctx.world_size and mesh.ndim == 1
    assert mesh.get_local_rank() == ctx.rank == mesh.get_local_rank("dp")
    pg = mesh.get_group()
    assert dist.get_world_size(pg) == ctx.world_size and dist.get_rank(pg) == ctx.rank
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t, group=pg)
    assert t.item() == ctx.world_size * (ctx.world_size + 1) / 2
    assert mesh["dp"].get_group() is not None


@dstest.spec(world_size=[4], worlds=WORLDS, contract="E6")
def test_device_mesh_2d_submesh_and_flatten(ctx):
    """A (2, 2) mesh: dp and tp submesh groups hold the expected ranks; the flattened dp_tp group is the world."""
    mesh = _cpu_mesh(2, 2, names=("dp", "tp"))
    dp, tp = ctx.rank // 2, ctx.rank % 2
    assert list(mesh.get_coordinate()) == [dp, tp]
    dp_pg, tp_pg = mesh["dp"].get_group(), mesh["tp"].get_group()
    assert dist.get_process_group_ranks(dp_pg) == [tp, tp + 2]
    assert dist.get_process_group_ranks(tp_pg) == [2 * dp, 2 * dp + 1]
    # Each group sums only its members' values.
    for pg, members in ((dp_pg, [tp, tp + 2]), (tp_pg, [2 * dp, 2 * dp + 1])):
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=pg)
        assert t.item() == sum(members)
    assert mesh["dp"].size() == 2 and mesh["tp"].get_local_rank() == tp
    flat = mesh["dp", "tp"]._flatten()
    assert flat.size() == 4 and flat.ndim == 1
    flat_pg = flat.get_group()
    assert dist.get_process_group_ranks(flat_pg) == [0, 1, 2, 3]
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=flat_pg)
    assert t.item() == 6.0


# -- DTensor -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [8, 7])  # 7 rows: uneven at every W in SIZES; 8: uneven at W=3 only
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dtensor_distribute_and_full_tensor(ctx, rows):
    """distribute_tensor with Shard(0), Shard(1) and Replicate; local shards are torch.chunk's; full_tensor round-trips."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _cpu_mesh(ctx.world_size)
    full = _global(0, rows, 5)
    for placement, dim in ((Shard(0), 0), (Shard(1), 1), (Replicate(), None)):
        dt = distribute_tensor(full, mesh, [placement])
        assert dt.shape == full.shape and dt.placements == (placement,)
        if dim is None:
            assert torch.equal(dt.to_local(), full)
        else:
            chunks = torch.chunk(full, ctx.world_size, dim=dim)
            want = chunks[ctx.rank] if ctx.rank < len(chunks) else full.narrow(dim, 0, 0)
            assert torch.equal(dt.to_local(), want)
        assert torch.equal(dt.full_tensor(), full)


@pytest.mark.parametrize("rows", [12, 7])
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dtensor_redistribute(ctx, rows):
    """redistribute among Shard(0), Shard(1), Replicate and Partial; every result's full tensor is the reference."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = _cpu_mesh(ctx.world_size)
    full = _global(1, rows, 6)
    placements = [Shard(0), Shard(1), Replicate()]
    for src in placements:
        for dst in placements:
            dt = distribute_tensor(full, mesh, [src]).redistribute(mesh, [dst])
            assert dt.placements == (dst,)
            _close(dt.full_tensor(), full)
    # Partial: each rank holds a term of the sum; the reference is the sum of every rank's term.
    terms = [_global(100 + r, rows, 6) for r in range(ctx.world_size)]
    want = torch.stack(terms).sum(0)
    for dst in placements:
        p = DTensor.from_local(terms[ctx.rank], mesh, [Partial()])
        got = p.redistribute(mesh, [dst])
        assert got.placements == (dst,)
        _close(got.full_tensor(), want)
    avg = DTensor.from_local(terms[ctx.rank], mesh, [Partial("avg")]).redistribute(mesh, [Replicate()])
    _close(avg.to_local(), want / ctx.world_size)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dtensor_matmul_forward_backward(ctx):
    """Row-sharded x times column-sharded w, forward and backward, equals the single-process matmul."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _cpu_mesh(ctx.world_size)
    x_full, w_full = _global(2, 6, 5), _global(3, 5, 7)
    ref_x, ref_w = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (torch.tanh(ref_x @ ref_w) ** 2).sum().backward()
    for xp, wp in ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(1), Shard(0))):
        x = distribute_tensor(x_full, mesh, [xp]).requires_grad_()
        w = distribute_tensor(w_full, mesh, [wp]).requires_grad_()
        y = x @ w
        _close(y.full_tensor(), (x_full @ w_full), rtol=1e-5, atol=1e-5)
        (torch.tanh(y) ** 2).sum().backward()
        _close(x.grad.full_tensor(), ref_x.grad, rtol=1e-5, atol=1e-5)
        _close(w.grad.full_tensor(), ref_w.grad, rtol=1e-5, atol=1e-5)


@dstest.spec(world_size=[4], worlds=WORLDS, contract="E6")
def test_dtensor_2d_mesh(ctx):
    """On a (2, 2) mesh: [Shard(0), Shard(1)] holds the expected blocks; redistribute and matmul match the reference."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _cpu_mesh(2, 2, names=("dp", "tp"))
    full = _global(4, 6, 5)  # 5 columns over 2: uneven
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    dp, tp = ctx.rank // 2, ctx.rank % 2
    assert torch.equal(dt.to_local(), full.chunk(2, 0)[dp].chunk(2, 1)[tp])
    assert torch.equal(dt.full_tensor(), full)
    for dst in ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()], [Shard(1), Shard(0)]):
        _close(dt.redistribute(mesh, dst).full_tensor(), full)
    w_full = _global(5, 5, 4)
    w = distribute_tensor(w_full, mesh, [Replicate(), Shard(1)]).requires_grad_()
    x = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    y = x @ w
    _close(y.full_tensor(), full @ w_full, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    ref_w = w_full.clone().requires_grad_()
    (full @ ref_w).sum().backward()
    _close(w.grad.full_tensor(), ref_w.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [9, 7, 5, 2])
@dstest.spec(world_size=[4], worlds=WORLDS, contract="E6")
def test_uneven_2d_full_tensor(ctx, rows):
    """Uneven shards on a 2-D mesh round-trip on every rank. On the threaded world DTensor's process-wide
    caches are keyed through DeviceMesh, and every rank's mesh compared equal: one rank's plan and local
    shapes reached another (wrong values in 5 of 9 fresh runs, CollectiveMismatch in the others)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(rows * 5.0).reshape(rows, 5)
    for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)]):
        assert torch.equal(distribute_tensor(x, mesh, placements).full_tensor(), x)


def test_device_meshes_of_different_ranks_differ_and_a_ranks_own_meshes_are_equal():
    """What torch's own threaded group gets from ``_thread_id``: in a world of processes each rank's mesh is
    its own; here rank threads' meshes of the same shape compare and hash unequal, a rank's two equal."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = dstest.run(lambda ctx: (init_device_mesh("cpu", (3,)), init_device_mesh("cpu", (3,))), 3)
    for rank, (a, b) in enumerate(meshes):
        assert a == b and hash(a) == hash(b)
        for other, (c, _) in enumerate(meshes):
            if other != rank:
                assert a != c and hash(a) != hash(c)


# -- functional collectives, torch.distributed.nn --------------------------------------------------------
@pytest.mark.parametrize("group_kind", ["world", "mesh", "ranks", "name"])
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_functional_collectives(ctx, group_kind):
    """funcol all_reduce / all_gather_tensor / reduce_scatter_tensor / all_to_all_single against the reference."""
    import torch.distributed._functional_collectives as funcol

    w = ctx.world_size
    group = {
        "world": lambda: dist.group.WORLD,
        "mesh": lambda: _cpu_mesh(w),
        "ranks": lambda: list(range(w)),
        "name": lambda: dist.group.WORLD.group_name,  # looked up in c10d's registry by name
    }[group_kind]()
    per_rank = [_global(10 + r, 2 * w, 3) for r in range(w)]
    mine = per_rank[ctx.rank]
    total = torch.stack(per_rank).sum(0)
    wait = funcol.wait_tensor
    _close(wait(funcol.all_reduce(mine, "sum", group)), total)
    _close(wait(funcol.all_reduce(mine, "max", group)), torch.stack(per_rank).amax(0))
    _close(wait(funcol.all_gather_tensor(mine, 0, group)), torch.cat(per_rank, 0))
    _close(wait(funcol.all_gather_tensor(mine, 1, group)), torch.cat(per_rank, 1))
    _close(wait(funcol.reduce_scatter_tensor(mine, "sum", 0, group)), total.chunk(w, 0)[ctx.rank])
    _close(wait(funcol.reduce_scatter_tensor(mine, "avg", 0, group)), (total / w).chunk(w, 0)[ctx.rank])
    got = wait(funcol.all_to_all_single(mine, None, None, group))
    _close(got, torch.cat([p.chunk(w, 0)[ctx.rank] for p in per_rank], 0))
    _close(wait(funcol.broadcast(mine, 1 % w, group)), per_rank[1 % w])
    many = funcol.all_reduce_coalesced([mine, mine * 2], "sum", group)
    _close(wait(many[0]), total)
    _close(wait(many[1]), total * 2)
    # The async tensor waits on first use, as user code relies on.
    _close(funcol.all_reduce(mine, "sum", group) * 1, total)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_functional_collectives_autograd(ctx):
    """The autograd variants' backward is the adjoint collective, as in a single-process reference."""
    import torch.distributed._functional_collectives as funcol

    w, group = ctx.world_size, dist.group.WORLD
    per_rank = [_global(20 + r, w, 3) for r in range(w)]
    coeff = _global(30, w * w, 3)  # the same downstream weights on every rank
    # all_gather: y = cat(x_r); loss_r = sum(coeff * y) on every rank -> dx_r = sum over ranks of coeff chunk
    x = per_rank[ctx.rank].clone().requires_grad_()
    y = funcol.all_gather_tensor_autograd(x, 0, group)
    y = funcol.wait_tensor(y)
    _close(y, torch.cat(per_rank, 0))
    (y * coeff * (ctx.rank + 1)).sum().backward()
    # Reference: the global loss is sum_r (r+1) * sum(coeff * cat(x)); d/dx_me = sum_r (r+1) * coeff[me chunk].
    scale = sum(r + 1 for r in range(w))
    _close(x.grad, coeff.chunk(w, 0)[ctx.rank] * scale)
    # reduce_scatter: z_r = chunk_r(sum_s x_s); backward all-gathers the output gradient.
    big = [_global(40 + r, w * 2, 3) for r in range(w)]
    xb = big[ctx.rank].clone().requires_grad_()
    z = funcol.wait_tensor(funcol.reduce_scatter_tensor_autograd(xb, "sum", 0, group))
    _close(z, torch.stack(big).sum(0).chunk(w, 0)[ctx.rank])
    c2 = _global(50, w * 2, 3)
    (z * c2.chunk(w, 0)[ctx.rank]).sum().backward()
    _close(xb.grad, c2)
    # all_to_all_single_autograd: backward is the inverse all-to-all.
    xa = big[ctx.rank].clone().requires_grad_()
    a = funcol.wait_tensor(funcol.all_to_all_single_autograd(xa, None, None, group))
    _close(a, torch.cat([b.chunk(w, 0)[ctx.rank] for b in big], 0))
    (a * (ctx.rank + 1)).sum().backward()
    want = torch.cat([torch.full((2, 3), float(r + 1)) for r in range(w)], 0)
    _close(xa.grad, want)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_distributed_nn_functional_all_reduce_backward(ctx):
    """torch.distributed.nn.functional.all_reduce: value is the sum, backward all-reduces the gradient."""
    import torch.distributed.nn.functional as dnn

    w = ctx.world_size
    per_rank = [_global(60 + r, 4) for r in range(w)]
    x = per_rank[ctx.rank].clone().requires_grad_()
    y = dnn.all_reduce(x * 2)
    _close(y, 2 * torch.stack(per_rank).sum(0))
    (y * (ctx.rank + 1)).sum().backward()
    # global loss = sum_r (r+1) * sum(2 * sum_s x_s) -> d/dx_me = 2 * sum_r (r+1)
    _close(x.grad, torch.full((4,), 2.0 * sum(r + 1 for r in range(w))))
    # all_gather and broadcast from the same module
    g = dnn.all_gather(per_rank[ctx.rank].clone().requires_grad_())
    assert len(g) == w and all(torch.equal(a, b) for a, b in zip(g, per_rank))
    b = dnn.broadcast(per_rank[ctx.rank].clone(), src=0)
    _close(b, per_rank[0])


# -- FSDP2 ---------------------------------------------------------------------------------------------------
def _global_batches(steps: int, world_size: int, per_rank: int, din: int, dout: int):
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(world_size * per_rank, din, generator=g), torch.randn(world_size * per_rank, dout, generator=g))
        for _ in range(steps)
    ]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _reference_train(model: nn.Module, opt_kind: str, batches) -> nn.Module:
    ref = copy.deepcopy(model)
    opt = _optimizer(opt_kind, ref.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    return ref


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_fsdp2_fully_shard_matches_single_process(ctx, opt_kind, reshard):
    """FSDP2 over a 1-D mesh, per-layer and root fully_shard, 3 steps: parameters equal the reference's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    w, per_rank = ctx.world_size, 2
    model = mlp(0)
    batches = _global_batches(3, w, per_rank, 5, 3)
    ref = _reference_train(model, opt_kind, batches)
    mesh = _cpu_mesh(w)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = _optimizer(opt_kind, model.parameters())
    with ctx.replicas_checked(model):  # G4: what must stay replicated does, after every step
        for x, y in batches:
            opt.zero_grad()
            mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_fsdp2_mixed_precision_bf16(ctx):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): equals a reference that computes each rank's
    local loss with bf16 copies of the fp32 parameters and averages the fp32-cast gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    w, per_rank = ctx.world_size, 2
    model = mlp(1)
    batches = _global_batches(2, w, per_rank, 5, 3)
    # Reference.
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(w):
            low = copy.deepcopy(ref).to(torch.bfloat16)
            sl = slice(r * per_rank, (r + 1) * per_rank)
            out = low(x[sl].to(torch.bfloat16))
            nn.functional.mse_loss(out, y[sl].to(torch.bfloat16)).backward()
            for acc, p in zip(grads, low.parameters()):
                acc += p.grad.float() / w
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr
        ref_opt.step()
    mesh = _cpu_mesh(w)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ctx.replicas_checked(model):
        for x, y in batches:
            opt.zero_grad()
            sl = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
            out = model(x[sl].to(torch.bfloat16))
            assert out.dtype == torch.bfloat16
            nn.functional.mse_loss(out, y[sl].to(torch.bfloat16)).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        _close(p.full_tensor(), q.detach(), rtol=1e-2, atol=1e-3)


# torch 2.13 warns that the root returns a view (RowwiseParallel's to_local output); nothing here edits it in place.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
@dstest.spec(world_size=[4], worlds=WORLDS, contract="E6")
def test_fsdp2_with_tensor_parallel_on_a_2d_mesh(ctx):
    """2-D parallelism on a (dp=2, tp=2) mesh: Colwise/Rowwise on tp, fully_shard on dp, 2 SGD steps; the dp
    ranks split the global batch, the tp ranks of one dp index see the same rows: equals the reference."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _cpu_mesh(2, 2, names=("dp", "tp"))
    dp = ctx.rank // 2
    model = mlp(8, dims=(5, 6, 3))  # hidden 6 over tp=2; 6 rows over dp=2 after the tp split: 3 -> uneven
    batches = _global_batches(2, 2, 2, 5, 3)
    ref = _reference_train(model, "sgd", batches)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer("sgd", model.parameters())
    with ctx.replicas_checked(model):  # the tp dimension's Replicate placements, across each tp group
        for x, y in batches:
            opt.zero_grad()
            sl = slice(dp * 2, dp * 2 + 2)
            nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.device_mesh.ndim == 2
        _close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5)


# -- tensor parallel -----------------------------------------------------------------------------------------
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_tensor_parallel_colwise_rowwise(ctx):
    """parallelize_module with ColwiseParallel then RowwiseParallel: output, grads and an SGD step match."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    w = ctx.world_size
    model = mlp(2, dims=(6, 4 * w, 5))  # hidden divisible by W: colwise output feeds rowwise input
    ref = copy.deepcopy(model)
    mesh = _cpu_mesh(w)
    tp = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _global(7, 3, 6)
    out = tp(x)
    want = ref(x)
    _close(out, want, rtol=1e-5, atol=1e-5)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for p, q in zip(tp.parameters(), ref.parameters()):
        _close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5)
    torch.optim.SGD(tp.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    ctx.assert_replicas(tp)  # G4: Replicate placements (the rowwise bias) equal on every rank
    for p, q in zip(tp.parameters(), ref.parameters()):
        _close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_tensor_parallel_sequence_parallel(ctx):
    """SequenceParallel LayerNorm on sequence-sharded input, then Colwise/Rowwise linears (Megatron SP layout)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    w = ctx.world_size
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 2 * w), nn.ReLU(), nn.Linear(2 * w, 6))
    ref = copy.deepcopy(model)
    mesh = _cpu_mesh(w)
    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
    }
    tp = parallelize_module(model, mesh, plan)
    x = _global(8, 2, 2 * w, 6)  # SequenceParallel's from_local assumes even sequence shards
    x_local = x.chunk(w, 1)[ctx.rank]
    out = tp(x_local)
    want = ref(x)
    _close(out, want.chunk(w, 1)[ctx.rank], rtol=1e-5, atol=1e-5)
    out.sum().backward()
    want.sum().backward()
    for p, q in zip(tp.parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        _close(grad, q.grad, rtol=1e-4, atol=1e-5)


# -- DDP, FSDP1 ----------------------------------------------------------------------------------------------
def _ddp_buckets(ctx, mode):
    """DDP with a tiny bucket cap (one bucket per parameter). ``no_sync``: each step accumulates a micro-batch
    without communication, then a synced one; ``static_graph``: synced steps (torch's reducer refuses no_sync
    before the first synced iteration of a static graph, on gloo too)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    w, per_rank = ctx.world_size, 2
    model = mlp(3)
    batches = _global_batches(4, w, per_rank, 5, 3)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = DDP(model, bucket_cap_mb=1e-5, static_graph=mode == "static_graph")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sl = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    with ctx.replicas_checked(ddp):  # G4: every parameter and buffer equal on every rank after each step
        _ddp_steps(ddp, opt, ref, ref_opt, batches, sl, mode)
    # After the first iteration DDP rebuilds its buckets by bucket_cap_mb: one per parameter here.
    assert len(ddp.reducer._get_zeros_like_grad_buckets()) == len(list(model.parameters()))
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        _close(p.detach(), q.detach(), rtol=1e-5, atol=1e-5)


def _ddp_steps(ddp, opt, ref, ref_opt, batches, sl, mode):
    if mode == "no_sync":
        for i in range(0, len(batches), 2):
            (x1, y1), (x2, y2) = batches[i], batches[i + 1]
            ref_opt.zero_grad()
            (nn.functional.mse_loss(ref(x1), y1) + nn.functional.mse_loss(ref(x2), y2)).backward()
            ref_opt.step()
            opt.zero_grad()
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x1[sl]), y1[sl]).backward()
            nn.functional.mse_loss(ddp(x2[sl]), y2[sl]).backward()
            opt.step()
    else:
        for x, y in batches:
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            opt.step()


test_ddp_buckets = pytest.mark.parametrize("mode", ["no_sync", "static_graph"])(
    dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")(_ddp_buckets)
)


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_fsdp1_cpu(ctx):
    """FSDP1 (FullyShardedDataParallel, FULL_SHARD, flat parameters) on CPU: 2 SGD steps match the reference."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    w, per_rank = ctx.world_size, 2
    model = mlp(4)
    batches = _global_batches(2, w, per_rank, 5, 3)
    ref = _reference_train(model, "sgd", batches)
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = _optimizer("sgd", fsdp.parameters())
    sl = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x[sl]), y[sl]).backward()
        opt.step()
    with FSDP.summon_full_params(fsdp):
        for p, q in zip(fsdp.module.parameters(), ref.parameters()):
            _close(p.detach(), q.detach(), rtol=1e-5, atol=1e-5)


# -- DCP ----------------------------------------------------------------------------------------------------
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dcp_plain_tensors(ctx, tmp_path):
    """dcp.save/load of plain (replicated) tensors and a Python value round-trips on every rank."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "plain")
    state = {"a": _global(70, 4, 3), "b": torch.arange(5), "step": 3}
    dcp.save(state, checkpoint_id=path)
    loaded = {"a": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    dcp.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["step"] == 3


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dcp_dtensor_resharding(ctx):
    """Save a Shard(0) DTensor (uneven rows) from W ranks; load it into Replicate, Shard(1) and a plain tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # The directory rank 0 makes, broadcast to the others.
    box = [tempfile.mkdtemp(prefix="dstest-dcp-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    mesh = _cpu_mesh(ctx.world_size)
    full = _global(71, 2 * ctx.world_size + 1, 4)
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=path)
    for placement in (Replicate(), Shard(1), Shard(0)):
        target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [placement])}
        dcp.load(target, checkpoint_id=path)
        assert target["w"].placements == (placement,)
        assert torch.equal(target["w"].full_tensor(), full)
    plain = {"w": torch.zeros_like(full)}
    dcp.load(plain, checkpoint_id=path)
    assert torch.equal(plain["w"], full)
    dist.barrier()
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(box[0])


@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_dcp_fsdp2_state_dict(ctx, tmp_path):
    """get_model_state_dict of an FSDP2 model after a step, saved with DCP, loaded into a fresh FSDP2 model and
    into a full (unsharded) state dict: both equal the trained single-process reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    w, per_rank = ctx.world_size, 2
    path = str(tmp_path / "fsdp2")
    model = mlp(5)
    fresh = mlp(6)
    batches = _global_batches(1, w, per_rank, 5, 3)
    ref = _reference_train(model, "sgd", batches)
    mesh = _cpu_mesh(w)
    fully_shard(model, mesh=mesh)
    opt = _optimizer("sgd", model.parameters())
    x, y = batches[0]
    sl = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
    opt.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fully_shard(fresh, mesh=mesh)
    sd = get_model_state_dict(fresh)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(fresh, sd)
    for p, q in zip(fresh.parameters(), ref.parameters()):
        _close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5)
    full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    for key, value in ref.state_dict().items():
        _close(full[key], value, rtol=1e-5, atol=1e-5)


# -- pipelining ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
# torch 2.11's schedules warm up the neighbours by sending a 0-d tensor into a 1-element buffer
# (PipelineStage._get_init_p2p_neighbors_ops): equal element counts, which gloo and dstest's worlds accept.
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_pipelining_schedules(ctx, schedule):
    """W stages of a Linear chain, 4 microbatches: the last stage's losses and every stage's grads equal the
    single-process reference (the mean of the microbatch losses)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    w, micro = ctx.world_size, 4
    torch.manual_seed(0)
    full = mlp(7, dims=tuple([4] * (w + 1)))
    linears = [m for m in full if isinstance(m, nn.Linear)]
    assert len(linears) == w
    x, y = _global(80, 8, 4), _global(81, 8, 4)
    ref = copy.deepcopy(full)
    ref_losses = [nn.functional.mse_loss(ref(xm), ym) for xm, ym in zip(x.chunk(micro), y.chunk(micro))]
    torch.stack(ref_losses).mean().backward()  # schedules scale grads by 1/n_microbatches (scale_grads=True)
    ref_linears = [m for m in ref if isinstance(m, nn.Linear)]

    # Stage r: linear r followed by the Tanh that follows it in the full model (none after the last).
    stage_mod = nn.Sequential(linears[ctx.rank], nn.Tanh()) if ctx.rank < w - 1 else nn.Sequential(linears[ctx.rank])
    stage = PipelineStage(stage_mod, ctx.rank, w, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=micro, loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    if ctx.rank == 0:
        sched.step(x)
    elif ctx.rank == w - 1:
        out = sched.step(target=y, losses=losses)
        _close(out, ref(x), rtol=1e-5, atol=1e-5)
        assert len(losses) == micro
        for got, want in zip(losses, ref_losses):
            _close(got, want.detach(), rtol=1e-5, atol=1e-5)
    else:
        sched.step()
    mine, theirs = linears[ctx.rank], ref_linears[ctx.rank]
    _close(mine.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-6)
    _close(mine.bias.grad, theirs.bias.grad, rtol=1e-5, atol=1e-6)


# -- object collectives, barrier, subgroups -----------------------------------------------------------------
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_object_collectives_barrier_subgroups(ctx):
    """all_gather_object, broadcast_object_list, gather_object, scatter_object_list, barrier, new_subgroups."""
    w, r = ctx.world_size, ctx.rank
    got = [None] * w
    dist.all_gather_object(got, {"rank": r, "payload": list(range(r))})
    assert got == [{"rank": i, "payload": list(range(i))} for i in range(w)]
    box = [("from", r), r * 10] if r == w - 1 else [None, None]
    dist.broadcast_object_list(box, src=w - 1)
    assert box == [("from", w - 1), (w - 1) * 10]
    gathered = [None] * w if r == 0 else None
    dist.gather_object(f"r{r}", gathered, dst=0)
    if r == 0:
        assert gathered == [f"r{i}" for i in range(w)]
    out = [None]
    dist.scatter_object_list(out, [{"to": i} for i in range(w)] if r == 1 else None, src=1)
    assert out == [{"to": r}]
    dist.barrier()
    size = 2 if w % 2 == 0 else 1
    sub, subgroups = dist.new_subgroups(group_size=size)
    assert len(subgroups) == w // size and dist.get_world_size(sub) == size
    members = dist.get_process_group_ranks(sub)
    assert r in members and members == list(range(r // size * size, r // size * size + size))
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=sub)
    assert t.item() == sum(members)
    names = [None] * size
    dist.all_gather_object(names, r, group=sub)
    assert names == members
    dist.barrier(group=sub)
    groups, _ = dist.new_subgroups_by_enumeration([list(range(0, w, 2)), list(range(1, w, 2))])
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=groups)
    assert t.item() == len(range(r % 2, w, 2))


# -- torch's own limits on a custom backend --------------------------------------------------------------------
@dstest.spec(world_size=[2, 3], worlds=WORLDS, contract="E6")
def test_monitored_barrier(ctx):
    """monitored_barrier is gloo-only in torch: the process world runs it; the threaded world says so."""
    from datetime import timedelta

    if ctx.world == "process":
        dist.monitored_barrier(timeout=timedelta(seconds=30))
        return
    from dstest.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="gloo"):
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.barrier()  # the world is still usable afterwards


GLOO_SPLITS_UNBOUND = Version(torch.__version__.split("+")[0]) >= Version("2.15")


@dstest.spec(world_size=[2, 4], worlds=WORLDS, contract="E6")
def test_split_group(ctx):
    """dist.split_group as gloo answers it: before torch 2.15 it needs a device bound to the default group (a
    clear error, no hang); from 2.15 gloo splits without one, and so do dstest's groups, with gloo's results
    (checked against 4 gloo processes on 2.15: sizes, ranks, sums, and NON_GROUP_MEMBER outside the split)."""
    if not hasattr(dist, "split_group"):
        pytest.skip("torch has no dist.split_group")
    halves = [list(range(ctx.world_size // 2)), list(range(ctx.world_size // 2, ctx.world_size))]
    if not GLOO_SPLITS_UNBOUND:
        with pytest.raises(RuntimeError, match="No device associated with the default pg"):
            dist.split_group(split_ranks=halves)
        dist.barrier()  # raised at once on every rank: nothing hangs, the world goes on
        return
    half = dist.split_group(split_ranks=halves)
    mine = halves[0] if ctx.rank in halves[0] else halves[1]
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=half)
    assert (dist.get_world_size(half), dist.get_rank(half), t.item()) == (len(mine), mine.index(ctx.rank), sum(mine))
    solo = dist.split_group(split_ranks=[[0]])
    if ctx.rank == 0:
        assert dist.get_world_size(solo) == 1
    else:
        assert solo == dist.GroupMember.NON_GROUP_MEMBER
    with ctx.comm.window() as w:
        dist.all_reduce(torch.ones(2), group=half)  # a split group is recorded like any other
    assert w.count("all_reduce", group=half) == 1


# -- groups kept across worlds (torch.distributed.nn.functional's group=group.WORLD default) -------------------
def test_world_group_kept_from_an_earlier_world_acts_for_the_current_world():
    """A default argument evaluated at import (``group=group.WORLD``) holds the world group of whichever world
    imported it first; in a later world, of any size, it acts as the caller's world group (as each process of
    a world of processes holds its own), while any other group of a finished world raises, naming it."""
    from dstest.errors import InvalidArgument
    from dstest.worlds.threaded import ThreadedWorld

    world = ThreadedWorld()
    kept = world.run(RunRequest(lambda ctx: (dist.group.WORLD, dist.new_group([0, 1])), 2))
    kept_world, kept_sub = kept[1]

    def later(ctx):
        assert dist.get_rank(kept_world) == ctx.rank and dist.get_world_size(kept_world) == ctx.world_size
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=kept_world)
        assert t.item() == sum(range(ctx.world_size))
        with pytest.raises(InvalidArgument, match="earlier world"):
            dist.all_reduce(t, group=kept_sub)
        return True

    assert world.run(RunRequest(later, 3)) == [True] * 3


# -- the example of docs/worlds.md ("torch's stacks"), as written there -----------------------------------------
@dstest.spec(world_size=SIZES, worlds=WORLDS, contract="E6")
def test_readme_fsdp2_example(ctx):
    """docs/worlds.md "torch's stacks": torch.manual_seed then model construction on every rank, one FSDP2 step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * ctx.world_size, 5, generator=g), torch.randn(2 * ctx.world_size, 3, generator=g)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    fully_shard(model, mesh=_cpu_mesh(ctx.world_size))
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach())
