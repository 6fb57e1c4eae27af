"""Contract E1: a SUM of bool tensors moves the bytes gloo moves (found by tests/test_rank_rng_ported.py).

gloo adds bools as bytes: True on three ranks sums to the byte 0x03, True to torch but other bits; the threaded
world gave 0x01 (a logical or), and DTensor's ``any()``, which sums bool partials on torch 2.11-2.13, diverged
bit for bit between the worlds. Each collective that reduces is compared with the process world (gloo) byte for
byte, at several world sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dstest

pytestmark = pytest.mark.cpu


def bool_reductions(ctx):
    w, r = ctx.world_size, ctx.rank
    pattern = torch.tensor([True, False, r % 2 == 0, r == 0, True, r > 0])
    out = {}
    t = pattern.clone()
    dist.all_reduce(t)
    out["all_reduce"] = t.view(torch.uint8).tolist()
    t = pattern.clone()
    dist.reduce(t, dst=w - 1)
    out["reduce"] = t.view(torch.uint8).tolist() if r == w - 1 else None
    rs = torch.empty(2, dtype=torch.bool)
    dist.reduce_scatter_tensor(rs, torch.cat([pattern[:2]] * w))
    out["reduce_scatter_tensor"] = rs.view(torch.uint8).tolist()
    for op in ("PRODUCT", "MAX", "MIN"):
        t = pattern.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = t.view(torch.uint8).tolist()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bool_reductions_give_glooss_bytes(world_size):
    threaded = dstest.run(bool_reductions, world_size)
    assert threaded == dstest.run(bool_reductions, world_size, world="process")
    assert threaded[0]["all_reduce"][0] == world_size  # every rank's True, added as bytes
