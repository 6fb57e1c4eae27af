"""Strict where the backends are strict (contracts E2, E10): ranks' buffers must agree in dtype and element count, as
gloo and NCCL require, not in shape; ``strict_shapes`` also refuses shape-only differences.

Measured with gloo here (torch 2.13, 2 processes): a float32 ``[2, 1, 1]`` broadcast into ``[2]`` delivers the
root's two values; a 0-d all_reduce with a ``[1]`` sums; a send of ``[2, 3]`` into a recv of ``[6]`` delivers
the six values in order. DeepSpeed's pipeline engine (``_aggregate_total_loss``) does the first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import RankFailure

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]


# -- the two DeepSpeed patterns, and the other collectives that move flat buffers -------------------------
def broadcast_into_other_shape(ctx):
    """DeepSpeed's PipelineEngine: a [2, 1, 1] loss tensor from the last stage into [2] on the others."""
    t = torch.tensor([[[3.0]], [[4.0]]]) if ctx.rank == 0 else torch.zeros(2)
    dist.broadcast(t, src=0)
    return t.reshape(-1).tolist()


def all_reduce_0d_with_1(ctx):
    t = torch.tensor(float(ctx.rank + 1)) if ctx.rank == 0 else torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.reshape(-1).tolist(), list(t.shape)


def every_collective_with_other_shapes(ctx):
    w, r = ctx.world_size, ctx.rank
    shape = (2, 3) if r % 2 == 0 else (6,)  # six elements everywhere, two shapes
    out = {}
    t = torch.full(shape, float(r))
    dist.all_reduce(t)
    out["all_reduce"] = t.reshape(-1).tolist()
    t = torch.arange(6.0).reshape(shape) if r == 0 else torch.zeros(shape)
    dist.broadcast(t, src=0)
    out["broadcast"] = t.reshape(-1).tolist()
    # each rank's own output and input agree in shape (gloo checks that locally); the ranks differ
    gathered = torch.empty((w * shape[0], *shape[1:]))
    dist.all_gather_into_tensor(gathered, torch.full(shape, float(r)))
    out["all_gather_into_tensor"] = gathered.reshape(-1).tolist()
    outs = [torch.empty(shape) for _ in range(w)]
    dist.all_gather(outs, torch.full(shape, float(r)))
    out["all_gather"] = [o.reshape(-1).tolist() for o in outs]
    scattered = torch.empty(shape)
    dist.reduce_scatter_tensor(scattered, torch.ones((w * shape[0], *shape[1:])))
    out["reduce_scatter_tensor"] = scattered.reshape(-1).tolist()
    if r == 0:
        dist.send(torch.arange(6.0).reshape(2, 3), 1)
    elif r == 1:
        got = torch.empty(6)
        dist.recv(got, 0)
        out["recv"] = got.tolist()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_a_broadcast_into_another_shape_of_the_same_size_is_accepted(world):
    assert dstest.run(broadcast_into_other_shape, 3, world=world) == [[3.0, 4.0]] * 3


@pytest.mark.parametrize("world", WORLDS)
def test_a_0d_all_reduce_with_a_1_element_tensor_is_accepted(world):
    got = dstest.run(all_reduce_0d_with_1, 2, world=world)
    assert got == [([3.0], []), ([3.0], [1])]  # each rank keeps its own shape


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_moves_flat_buffers_of_the_same_size(world, world_size):
    got = dstest.run(every_collective_with_other_shapes, world_size, world=world)
    w = world_size
    for r, out in enumerate(got):
        assert out["all_reduce"] == [float(sum(range(w)))] * 6
        assert out["broadcast"] == [float(i) for i in range(6)]
        assert out["all_gather_into_tensor"] == [float(k) for k in range(w) for _ in range(6)]
        assert out["all_gather"] == [[float(k)] * 6 for k in range(w)]
        assert out["reduce_scatter_tensor"] == [float(w)] * 6
        if r == 1:
            assert out["recv"] == [float(i) for i in range(6)]


# -- strict mode refuses them, naming both shapes ---------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    ("body", "shapes"),
    [
        (broadcast_into_other_shape, ("float32[2, 1, 1]@cpu", "float32[2]@cpu")),
        (all_reduce_0d_with_1, ("float32[]@cpu", "float32[1]@cpu")),
    ],
)
def test_strict_shapes_refuses_a_difference_in_shape_only(world, body, shapes):
    with pytest.raises(RankFailure) as info:
        dstest.run(body, 2, world=world, strict_shapes=True)
    text = str(info.value)
    assert "CollectiveMismatch" in text and all(s in text for s in shapes), text
    assert dstest.run(body, 2, world=world)  # the same program, not strict: passes on the same world


def p2p_other_shape(ctx):
    if ctx.rank == 0:
        dist.send(torch.arange(6.0).reshape(2, 3), 1)
        return None
    got = torch.empty(6)
    dist.recv(got, 0)
    return got.tolist()


@pytest.mark.parametrize("world", WORLDS)
def test_strict_shapes_refuses_a_transfer_of_another_shape(world):
    assert dstest.run(p2p_other_shape, 2, world=world)[1] == [float(i) for i in range(6)]
    with pytest.raises(RankFailure) as info:
        dstest.run(p2p_other_shape, 2, world=world, strict_shapes=True)
    assert "point-to-point mismatch" in str(info.value)


@dstest.spec(world_size=[2], worlds=WORLDS, strict_shapes=True)
def strict_spec(ctx):
    dist.all_reduce(torch.zeros(2, 1) if ctx.rank == 0 else torch.zeros(2))


@pytest.mark.parametrize("world", WORLDS)
def test_a_spec_declared_strict_refuses_a_difference_in_shape_only(world):
    with pytest.raises(RankFailure, match=r"float32\[2, 1\]@cpu"):
        dstest.run(strict_spec, 2, world=world)


# -- what the backends do check is still a mismatch -------------------------------------------------------
def different_counts(ctx):
    dist.all_reduce(torch.zeros(6 if ctx.rank == 0 else 7))


def different_dtypes(ctx):
    dist.all_reduce(torch.zeros(6, dtype=torch.float32 if ctx.rank == 0 else torch.float64))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("body", [different_counts, different_dtypes])
def test_element_counts_and_dtypes_must_still_match(world, body):
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        dstest.run(body, 2, world=world)


def test_strict_shapes_must_be_a_bool():
    from dstest.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"strict_shapes='yes': must be True or False"):
        dstest.run(broadcast_into_other_shape, 2, strict_shapes="yes")  # type: ignore[arg-type]
