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


@dstest.spec(world_size=[2, 3, 4], contract="A4")
def test_readme_non_member_is_left_alone(ctx):
    """The README's example, verbatim."""
    group = ctx.groups.excluding(0)  # rank 0 is not a member (torch: size -1)
    t = torch.ones(2)
    if ctx.rank != 0:
        dist.all_reduce(t, group=group)
    assert t.tolist() == ([1.0, 1.0] if ctx.rank == 0 else [ctx.world_size - 1.0] * 2)
