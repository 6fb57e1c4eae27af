"""impl.comm and impl.parallel: predicates, guarded collectives, and the optional-group call sites."""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dstest
from impl.comm import collectives
from impl.comm.collectives import Comm, CommStats
from impl.comm.pg_utils import effective_rank, effective_size, is_member, is_parallel
from impl.parallel import global_norm, shard_range, shard_sizes, vocab_parallel_cross_entropy

pytestmark = pytest.mark.cpu


def test_is_parallel_none_touches_nothing_before_init() -> None:
    """A1: no process group exists here, and any call into torch.distributed would fail the test."""
    assert not dist.is_initialized()
    boom = mock.Mock(side_effect=AssertionError("is_parallel(None) touched torch.distributed"))
    with mock.patch.object(dist, "get_world_size", boom), mock.patch.object(dist, "is_initialized", boom):
        assert is_parallel(None) is False
        assert effective_size(None) == 1 and effective_rank(None) == 0 and is_member(None) is False


def test_non_member_and_uninitialised() -> None:
    assert is_parallel(dist.GroupMember.NON_GROUP_MEMBER) is False
    assert effective_size(dist.GroupMember.NON_GROUP_MEMBER) == 1
    assert is_parallel(object()) is False  # torch.distributed not initialised: nothing is parallel


def test_guarded_collectives_without_a_group() -> None:
    stats = CommStats()
    comm = Comm(stats)
    t = torch.arange(4.0)
    assert comm.all_reduce(t, None) is t and t.tolist() == [0, 1, 2, 3]
    out = torch.empty(4)
    comm.reduce_scatter(out, t, None)
    comm.all_gather_into(out, t + 1, None)
    assert out.tolist() == [1, 2, 3, 4]
    assert comm.all_gather(t, None)[0] is t
    comm.broadcast(t, 0, None)
    comm.barrier(None)
    assert sum(stats.total.values()) == 0
    with pytest.raises(ValueError, match="one-rank reduce_scatter"):
        comm.reduce_scatter(torch.empty(2), t, None)
    with pytest.raises(ValueError, match="one-rank all_gather"):
        comm.all_gather_into(torch.empty(8), t, None)


def test_version_tolerant_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.13 has all_gather_single/reduce_scatter_single; older releases only the old names."""
    if hasattr(dist, "reduce_scatter_single"):
        assert collectives._reduce_scatter_fn() is dist.reduce_scatter_single
        assert collectives._all_gather_fn() is dist.all_gather_single
        monkeypatch.delattr(dist, "reduce_scatter_single")
        monkeypatch.delattr(dist, "all_gather_single")
    assert collectives._reduce_scatter_fn() is dist.reduce_scatter_tensor
    assert collectives._all_gather_fn() is dist.all_gather_into_tensor


def test_collectives_on_a_threaded_world() -> None:
    def body(ctx: Any) -> dict[str, int]:
        stats = CommStats()
        comm = Comm(stats)
        group = ctx.groups.world()
        W = ctx.world_size
        x = torch.arange(2 * W, dtype=torch.float32) + ctx.rank
        out = torch.empty(2)
        comm.reduce_scatter(out, x, group)
        base = torch.arange(2 * W, dtype=torch.float32)[2 * ctx.rank : 2 * ctx.rank + 2]
        assert out.tolist() == (W * base + sum(range(W))).tolist()
        full = torch.empty(2 * W)
        comm.all_gather_into(full, out, group)
        strided = torch.zeros(3, 2).t()  # non-contiguous output: written back (A7)
        comm.broadcast(strided, 0, group) if ctx.rank else comm.broadcast(strided.fill_(7.0), 0, group)
        assert bool((strided == 7).all())
        m = torch.tensor([float(ctx.rank)])
        comm.all_reduce(m, group, "max")
        assert m.item() == W - 1
        with pytest.raises(ValueError, match="reduce op"):
            comm.all_reduce(m, group, "avg")
        return dict(stats.total)

    counts = dstest.run(body, 3)
    assert counts[0] == {"reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_reduce": 1}


@given(total=st.integers(0, 50), parts=st.integers(1, 9))
def test_shard_sizes(total: int, parts: int) -> None:
    sizes = shard_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert shard_range(total, None) == (0, total)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_cross_entropy_unsharded(reduction: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 8, -100, 4, 4])
    got = vocab_parallel_cross_entropy(logits, target, None, reduction=reduction)
    ref_logits = logits.detach().clone().requires_grad_()
    want = F.cross_entropy(ref_logits, target, reduction=reduction)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(logits, target, None, reduction="avg")


def _ce_body(ctx: Any, sizes: list[int], n: int, seed: int) -> None:
    V = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, V, (n,), generator=g)
    target[0] = -100
    start = sum(sizes[: ctx.rank])
    local = logits[:, start : start + sizes[ctx.rank]].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ctx.groups.world(), start)
    loss.backward()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, target)
    want.backward()
    assert full.grad is not None and local.grad is not None
    torch.testing.assert_close(loss.detach(), want.detach())
    torch.testing.assert_close(local.grad, full.grad[:, start : start + sizes[ctx.rank]])


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    n=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_vocab_cross_entropy_uneven_shards(sizes: list[int], n: int, seed: int) -> None:
    """A6: any uneven layout (zero-size shards included) equals F.cross_entropy on the full logits."""
    dstest.run(_ce_body, len(sizes), args=(sizes, n, seed))


def test_global_norm_inf_and_errors() -> None:
    ts = [torch.tensor([1.0, -5.0]), torch.tensor([3.0]), torch.empty(0)]
    assert float(global_norm(ts, None, math.inf)) == 5.0
    assert math.isclose(float(global_norm(ts, None)), math.sqrt(35.0), rel_tol=1e-6)
    assert math.isclose(float(global_norm(ts, None, 1.0)), 9.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match="norm_type"):
        global_norm(ts, None, 0)
