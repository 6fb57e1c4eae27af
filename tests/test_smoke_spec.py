import pytest
import torch
import torch.distributed as dist

import dstest


@dstest.spec(world_size=[1, 2, 3, 4], contract="E1")
def test_all_reduce_sums_ranks(ctx):
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    n = ctx.world_size
    assert t.tolist() == [n * (n + 1) / 2] * 3


@pytest.mark.parametrize("scale", [1.0, 2.0])
@dstest.spec(world_size=[2], contract="E1")
def test_param_reaches_ranks(ctx, scale):
    t = torch.full((2,), scale)
    dist.all_reduce(t)
    assert t.tolist() == [2 * scale] * 2
