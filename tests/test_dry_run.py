"""Dry runs at scale: DeviceMesh, DTensor and FSDP2 on the fake world at 1,024 and 8,192 ranks.

A sharding plan is checked on one CPU: the fake world plays rank 0 and rank N-1 of N (no data moves),
torch's own stacks build their meshes and shard their parameters, and the test compares local shard
shapes, per-rank parameter, gradient and optimizer bytes, and the bytes of every collective of one
training step (``ctx.comm``) with values computed by hand below. Nothing is trained: the values of the
tensors are meaningless in the fake world, their shapes are exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dstest.worlds.fake import FakeWorld
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

SIZES = [1024, 8192]
TP = 8  # tensor-parallel width of the 2-D mesh: (W / 8) x 8


def _mesh_and_dtensor(ctx: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    W = ctx.world_size
    mesh = init_device_mesh("cpu", (W // TP, TP), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    with ctx.comm.window() as placing:
        weight = distribute_tensor(torch.empty(1000, 30), mesh, [Shard(0), Shard(1)])
        bias = distribute_tensor(torch.empty(30), mesh, [Replicate(), Shard(0)])
    return {
        "sizes": (dp.size(), tp.size()),
        "coordinate": tuple(mesh.get_coordinate() or ()),
        "tp_ranks": dist.get_process_group_ranks(tp),
        "dp_ranks": dist.get_process_group_ranks(dp)[:3] + dist.get_process_group_ranks(dp)[-1:],
        "weight": tuple(weight.to_local().shape),
        "bias": tuple(bias.to_local().shape),
        "placing": placing.counts(),
    }


@pytest.mark.parametrize("world_size", SIZES)
def test_device_mesh_and_dtensor_shards(world_size: int) -> None:
    W, dp = world_size, world_size // TP
    first, last = FakeWorld().run(RunRequest(_mesh_and_dtensor, W, timeout=600))
    for got in (first, last):
        assert got["sizes"] == (dp, TP)
        # distribute_tensor places mesh dim by mesh dim: the weight scatters on dp and on tp, the bias is
        # broadcast on dp (Replicate) and scattered on tp
        assert got["placing"] == {"scatter": 3, "broadcast": 1}
    assert first["coordinate"] == (0, 0) and last["coordinate"] == (dp - 1, TP - 1)
    assert first["tp_ranks"] == list(range(TP)) and last["tp_ranks"] == list(range(W - TP, W))
    assert first["dp_ranks"] == [0, TP, 2 * TP, W - TP] and last["dp_ranks"] == [TP - 1, 2 * TP - 1, 3 * TP - 1, W - 1]
    # 1000 rows over dp ranks in torch.chunk pieces of ceil(1000 / dp): W=1024 (dp 128): 8 rows for the first
    # 125 ranks, none after; W=8192 (dp 1024): 1 row for the first 1000. 30 columns over tp=8: 4 per rank,
    # the last rank 30 - 7 * 4 = 2.
    assert first["weight"] == (8 if W == 1024 else 1, 4) and last["weight"] == (0, 2)
    assert first["bias"] == (4,) and last["bias"] == (2,)


def _fsdp2_step(ctx: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    W = ctx.world_size
    mesh = init_device_mesh("cpu", (W,))
    model = nn.Sequential(nn.Linear(16, 3 * W + 1), nn.Linear(3 * W + 1, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())

    def nbytes(ts: Any) -> int:
        return sum(t.to_local().numel() * t.to_local().element_size() for t in ts)

    with ctx.comm.window() as forward:
        loss = model(torch.ones(2, 16)).sum()
    with ctx.comm.window() as backward:
        loss.backward()
    with ctx.comm.window() as step:
        opt.step()
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {
        "shards": [tuple(p.to_local().shape) for p in model.parameters()],
        "param_bytes": nbytes(model.parameters()),
        "grad_bytes": nbytes(p.grad for p in model.parameters()),
        "optimizer_bytes": nbytes(moments),
        "forward": [(c.op, c.shapes, c.nbytes) for c in forward.calls],
        "backward": [(c.op, c.shapes, c.nbytes) for c in backward.calls],
        "step": step.count(),
    }


@pytest.mark.parametrize("world_size", SIZES)
def test_fsdp2_plan_bytes_per_rank_and_per_collective(world_size: int) -> None:
    """Linear(16, 3W+1) then Linear(3W+1, 4), fully_shard on the root, AdamW, one step.

    FSDP2 shards dim 0 in torch.chunk pieces of c = ceil(rows / W), padded to c rows:
    w1 (3W+1, 16): c = 4, so rank 0 holds 4 x 16 and rank N-1 none (only ceil((3W+1)/4) ranks hold rows);
    b1 (3W+1,): 4 and 0; w2 (4, 3W+1): c = 1, rank 0 one row of 3W+1, rank N-1 none; b2 (4,): 1 and 0.
    One all-gather per step forward (the root keeps its parameters for backward) and one reduce-scatter
    in backward, over the padded shards: 4*16 + 4 + (3W+1) + 1 = 3W + 70 elements per rank.
    """
    W = world_size
    flat = 3 * W + 70
    first, last = FakeWorld().run(RunRequest(_fsdp2_step, W, timeout=600))
    assert first["shards"] == [(4, 16), (4,), (1, 3 * W + 1), (1,)]
    assert last["shards"] == [(0, 16), (0,), (0, 3 * W + 1), (0,)]
    mine = 4 * (4 * 16 + 4 + (3 * W + 1) + 1)  # rank 0's fp32 bytes
    assert (first["param_bytes"], first["grad_bytes"], first["optimizer_bytes"]) == (mine, mine, 2 * mine)
    assert (last["param_bytes"], last["grad_bytes"], last["optimizer_bytes"]) == (0, 0, 0)
    for got in (first, last):
        assert got["forward"] == [("all_gather_into_tensor", ((flat,), (W * flat,)), 4 * W * flat)]
        assert got["backward"] == [("reduce_scatter_tensor", ((W * flat,), (flat,)), 4 * W * flat)]
        assert got["step"] == 0  # AdamW on local shards: no collective
