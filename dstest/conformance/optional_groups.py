"""contracts part A: optional process groups (absent, single-rank, non-member, multi-rank) and the W = 1 path.

Each call site is run on every topology of :data:`dstest.groups.TOPOLOGIES` the world size allows, and
compared with an fp64 computation on the full (unsharded) tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dstest
from dstest.conformance._helpers import (
    batch,
    block_offset,
    build,
    collectives_issued,
    config,
    gathered,
    members,
    mse,
    shared_randn,
    topology,
)
from dstest.groups import TOPOLOGIES
from dstest.targets import require

OPS = ("mean", "sum")


def _issues_nothing(ctx: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only, then an all-reduce on every rank: had ``fn`` issued a collective (or
    hung in one), the world would report the mismatch (or the stall) instead of this check passing."""
    result = fn() if ctx.rank == 0 else None
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size
    return result


# -- A1-A4: is_parallel --------------------------------------------------------------------------------
@dstest.spec(world_size=[1, 2, 3], contract="A1")
def test_a1_none_is_absent(ctx: Any) -> None:
    """None is "absent", never the world: False on every rank, and it issues nothing."""
    require(ctx.target, "is_parallel")
    assert ctx.target.is_parallel(None) is False
    assert _issues_nothing(ctx, lambda: ctx.target.is_parallel(None)) in (False, None)


@dstest.spec(world_size=[1, 2, 3, 4], contract="A2")
def test_a2_multi_rank_group_with_caller(ctx: Any) -> None:
    require(ctx.target, "is_parallel")
    W = ctx.world_size
    assert ctx.target.is_parallel(ctx.groups.world()) is (W >= 2), f"world group at W={W}"
    if W >= 2:
        pair = ctx.groups.of([0, 1])
        assert ctx.target.is_parallel(pair) is (ctx.rank in (0, 1)), "a 2-rank group: True for its members only"


@dstest.spec(world_size=[1, 2, 3], contract="A3")
def test_a3_single_rank_group(ctx: Any) -> None:
    require(ctx.target, "is_parallel")
    assert ctx.target.is_parallel(ctx.groups.single()) is False


@dstest.spec(world_size=[2, 3, 4], contract="A4")
def test_a4_non_member(ctx: Any) -> None:
    """Rank 0 is outside the group (torch reports -1): False, without a collective or a hang."""
    require(ctx.target, "is_parallel")
    group = ctx.groups.excluding(0)
    if ctx.rank == 0:
        assert dist.get_world_size(group) == -1, "premise: torch reports a non-member's group size as -1"
    assert _issues_nothing(ctx, lambda: ctx.target.is_parallel(group)) in (False, None)
    if ctx.rank != 0:
        assert ctx.target.is_parallel(group) is (ctx.world_size - 1 >= 2)


# -- A5: guarded collectives -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A5")
def test_a5_guarded_all_reduce(ctx: Any, kind: str) -> None:
    """Absent, single-rank and non-member groups leave the tensor unchanged; a parallel group sums."""
    require(ctx.target, "guarded_all_reduce", "is_parallel")
    group = topology(ctx, kind)
    t = ctx.randn(6)
    before = t.clone()
    everyone = gathered(before)
    ctx.target.all_reduce(t, group)
    if ctx.target.is_parallel(group):
        want = sum(everyone[r] for r in members(ctx, kind))
        torch.testing.assert_close(t, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(t, before), f"{kind}: a guarded all-reduce changed the tensor"


# -- A6: call sites with optional groups -------------------------------------------------------------------
class _TPNet(torch.nn.Module):
    def __init__(self, col: torch.nn.Module, row: torch.nn.Module) -> None:
        super().__init__()
        self.col, self.row = col, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.row(torch.tanh(self.col(x)))
        return out


_D, _H, _O = 5, 7, 3  # hidden 7: uneven shards over 2, 3 and 4 ranks


def _tp_weights() -> tuple[torch.Tensor, ...]:
    return shared_randn(11, _H, _D), shared_randn(12, _H), shared_randn(13, _O, _H), shared_randn(14, _O)


@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A6")
def test_a6_tensor_parallel_linear_pair(ctx: Any, kind: str) -> None:
    require(ctx.target, "tensor_parallel_linear", "is_parallel")
    group = topology(ctx, kind)
    w1, b1, w2, b2 = _tp_weights()
    col = ctx.target.column_parallel_linear(w1.float(), b1.float(), group).to(ctx.device)
    row = ctx.target.row_parallel_linear(w2.float(), b2.float(), group).to(ctx.device)
    h = col.weight.shape[0]
    assert h >= 0 and row.weight.shape[1] == h, f"shard shapes {tuple(col.weight.shape)}, {tuple(row.weight.shape)}"
    if not ctx.target.is_parallel(group):
        assert h == _H, f"{kind}: a rank that is not parallel holds the whole layer, got {h} of {_H} rows"
    x = shared_randn(15, 4, _D).float().to(ctx.device).requires_grad_()
    y = row(torch.tanh(col(x)))
    y.pow(2).sum().backward()

    ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    xr = shared_randn(15, 4, _D).requires_grad_()
    yr = F.linear(torch.tanh(F.linear(xr, ref[0], ref[1])), ref[2], ref[3])
    yr.pow(2).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(y.double().cpu(), yr.detach(), rtol=1e-5, atol=1e-6)
    o = block_offset(w1.float(), col.weight.detach().cpu(), 0)
    grads = [col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad, x.grad]
    g1, gb1, g2, gb2 = (t.grad for t in ref)
    assert g1 is not None and gb1 is not None and g2 is not None
    wants = [g1[o : o + h], gb1[o : o + h], g2[:, o : o + h], gb2, xr.grad]
    for name, got, want in zip(["w1", "b1", "w2", "b2", "x"], grads, wants, strict=True):
        assert got is not None, f"no gradient for {name}"
        assert want is not None
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= 1e-6 + 1e-5 * want.abs().max().item(), f"gradient of {name}: max error {err:.3e}"


_VOCAB = 11
_UNEVEN = {1: [11], 2: [7, 4], 3: [5, 0, 6], 4: [1, 5, 0, 5]}  # zero-size shards included


@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A6")
def test_a6_vocab_parallel_cross_entropy(ctx: Any, kind: str) -> None:
    require(ctx.target, "vocab_parallel_cross_entropy", "is_parallel")
    group = topology(ctx, kind)
    parallel = ctx.target.is_parallel(group)
    sizes = _UNEVEN[dist.get_world_size(group)] if parallel else [_VOCAB]
    grank = dist.get_rank(group) if parallel else 0
    start = sum(sizes[:grank])
    logits = shared_randn(21, 6, _VOCAB)
    target = torch.tensor([0, 3, 5, 6, 10, 7])
    local = logits[:, start : start + sizes[grank]].float().clone().to(ctx.device).requires_grad_()
    loss = ctx.target.vocab_parallel_cross_entropy(local, target.to(ctx.device), group, start)
    loss.backward()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, target)
    want.backward()  # type: ignore[no-untyped-call]
    assert full.grad is not None and local.grad is not None
    got, ref = float(loss.detach()), float(want.detach())
    assert abs(got - ref) <= 1e-6 * abs(ref), f"{kind}: loss {got} != {ref}"
    torch.testing.assert_close(
        local.grad.double().cpu(), full.grad[:, start : start + sizes[grank]], rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A6")
def test_a6_global_norm_helper(ctx: Any, kind: str) -> None:
    require(ctx.target, "global_norm", "is_parallel")
    group = topology(ctx, kind)
    full = [shared_randn(31, 7, 3), shared_randn(32, 5)]  # rows split unevenly over the group
    if ctx.target.is_parallel(group):
        T, grank = dist.get_world_size(group), dist.get_rank(group)
        mine = [torch.tensor_split(t, T)[grank] for t in full]
    else:
        mine = full
    got = ctx.target.global_norm([t.float().to(ctx.device) for t in mine], group)
    want = math.sqrt(sum(float(t.pow(2).sum()) for t in full))
    assert abs(float(got) - want) <= 1e-6 * want, f"{kind}: norm {float(got)} != {want}"


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3], contract="A6")
def test_a6_zero_model_parallel_reductions(ctx: Any, kind: str, stage: int) -> None:
    """An engine over a tensor-parallel model: the global norm covers the full model (shards once each,
    replicated parameters once), and a non-parallel model-parallel group adds no collective."""
    require(ctx.target, "mp_group", "tensor_parallel_linear", "is_parallel", f"stage{stage}")
    group = topology(ctx, kind)
    w1, b1, w2, b2 = _tp_weights()
    model = _TPNet(
        ctx.target.column_parallel_linear(w1.float(), b1.float(), group),
        ctx.target.row_parallel_linear(w2.float(), b2.float(), group),
    ).to(ctx.device)
    # Data parallelism is not the point here: every rank is its own data-parallel group.
    engine = ctx.target.initialize(model, config(stage, "mean"), dp_group=ctx.groups.single(), mp_group=group)
    x = shared_randn(15, 4, _D).float().to(ctx.device)
    with collectives_issued(ctx, engine) as issued:
        engine.backward(engine(x).pow(2).sum())
        engine.step()
    ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    F.linear(torch.tanh(F.linear(shared_randn(15, 4, _D), ref[0], ref[1])), ref[2], ref[3]).pow(2).sum().backward()  # type: ignore[no-untyped-call]
    want = math.sqrt(sum(float(t.grad.pow(2).sum()) for t in ref if t.grad is not None))
    norm = engine.get_global_grad_norm()
    assert norm is not None and abs(float(norm) - want) <= 1e-5 * want, f"{kind}: norm {norm} != {want}"
    if not ctx.target.is_parallel(group):  # counted by the world: any collective on any group
        assert sum(issued.values()) == 0, f"{kind}: {issued}"


# -- A7: non-contiguous tensors -------------------------------------------------------------------------
@dstest.spec(world_size=[1, 2, 3], contract="A7")
def test_a7_non_contiguous_result_written_back(ctx: Any) -> None:
    """The reduced values land in the caller's non-contiguous tensor (and its storage). The engine side
    of A7 is B2's "non_contiguous" path: SpecNet's ``w1`` and its gradient are not contiguous."""
    require(ctx.target, "guarded_all_reduce")
    base = ctx.randn(4, 6)
    t = base.t()
    assert not t.is_contiguous()
    want = sum(gathered(t.clone()))
    out = ctx.target.all_reduce(t, ctx.groups.world())
    torch.testing.assert_close(t, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base.t(), want, rtol=1e-6, atol=1e-6)
    if out is not None:
        assert out.data_ptr() == t.data_ptr(), "the result must be the caller's tensor"


# -- A8: data parallelism that is not parallel -------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", [0, 1, 2])
@dstest.spec(world_size=[1, 2, 3], contract="A8")
def test_a8_no_gradient_collective_at_w1(ctx: Any, stage: int, op: str) -> None:
    """W = 1 (the world of one rank, or each rank its own data-parallel group): no collective, no
    communication buffer, and results bit-equal to plain single-process training."""
    require(ctx.target, f"stage{stage}", "comm_buffer_bytes")
    dp = ctx.groups.world() if ctx.world_size == 1 else ctx.groups.single()
    lr = 0.1
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, op, lr=lr), dp_group=dp)
    plain = build(device=ctx.device)  # plain SGD, written out (importing torch.optim costs seconds)
    for step in range(2):
        x, y = batch(ctx.seed, ctx.rank, step, device=ctx.device)
        with collectives_issued(ctx, engine) as stepped:
            engine.backward(mse(engine(x), y))
            grads = engine.full_gradients()  # (a collective only where W > 1; none here)
            engine.step()
        plain.zero_grad()
        mse(plain(x), y).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for name, p in plain.named_parameters():
                assert p.grad is not None and torch.equal(grads[name], p.grad), f"step {step}: gradient {name}"
                p.add_(p.grad, alpha=-lr)
        params = engine.full_parameters()
        for name, p in plain.named_parameters():
            assert torch.equal(params[name], p.detach()), f"step {step}: parameter {name}"
        assert sum(stepped.values()) == 0, f"step {step}: collectives issued at W=1: {stepped}"
        assert engine.comm_buffer_bytes() == 0, f"communication buffers at W=1: {engine.comm_buffer_bytes()} bytes"
