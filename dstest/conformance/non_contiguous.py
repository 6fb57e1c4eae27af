"""contract A5-A7 at every call site of A6, with the non-contiguous tensors real models give them.

The specs of :mod:`dstest.conformance.optional_groups` drive each call site with contiguous tensors. Models hand
it views instead: weights kept ``[in, out]`` and used as ``w.t()``, features-first activations read as
``[N, D]``, one part of a wider (fused) activation, sequence-first batches ``[S, B, D]`` read batch-first,
and losses read through such views, so that the gradients flowing back are views as well (see
:data:`LAYOUTS`). Each spec here runs a call site on every topology the world allows (absent, single-rank,
non-member, multi-rank), forward and backward, and compares it with a one-process fp64 computation on the
full tensors. In the ``transposed`` layout the input gradient that the column-parallel layer all-reduces
backward is column-major: a call site that reduces a contiguous copy and keeps the original shows up as a
wrong input gradient (A7), here and, through the layer before the pair, in the engine's gradients.

What part A checks at each call site of A6 (O: ``optional_groups``, N: this module; every row on the four
topologies, at the world sizes of its spec)::

    call site                     forward       backward               contiguous  non-contiguous
    guarded all-reduce (A5, A7)   result        -                      O A5        O A7 (transposed, world
                                                                                   group), N (3 layouts)
    tensor-parallel pair (A6)     output        w, b, input grads      O           N (3 layouts, weights w.t())
    vocab-parallel CE (A6)        loss          logit grads            O (uneven,  N (3 layouts, uneven
                                                                       empty)      shards, none empty)
    global-norm helper (A6)       norm of       norm of gradients      O           N (3 layouts, both)
                                  tensors       from a backward
    ZeRO model-parallel (A6)      output        grads, norm (0-2)      O (norm,    N (features-first input,
                                                                       counts)     weights w.t(), stages 0-2)

A5 (not parallel: the caller computes alone, unchanged) and A6 (no -1 as a size) are part of every row:
the ranks for which the group is not parallel must equal the full computation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dstest
from dstest.conformance._helpers import block_offset, config, gathered, members, shared_randn, topology
from dstest.groups import TOPOLOGIES
from dstest.targets import require

#: How a model holds the tensor a call site receives; each is a view that is not contiguous.
#: ``transposed``: the last two dimensions swapped (a weight kept ``[in, out]``, a features-first
#: activation); ``sliced``: the middle of a wider last dimension (one part of a fused projection);
#: ``permuted``: dimensions 0 and 1 swapped (a sequence-first batch read batch-first; 3 dimensions).
LAYOUTS = ("transposed", "sliced", "permuted")

_PAD = (1, 2)  # elements before and after the slice in the "sliced" layout


def _store(full: torch.Tensor, layout: str) -> torch.Tensor:
    """The contiguous tensor a model keeps for ``full`` in ``layout``; :func:`_view` of it equals ``full``."""
    if layout == "transposed":
        return full.transpose(-1, -2).contiguous()
    if layout == "sliced":
        before, after = _PAD
        stored = torch.full((*full.shape[:-1], before + full.shape[-1] + after), 7.0, dtype=full.dtype)
        stored[..., before : before + full.shape[-1]] = full
        return stored
    if layout == "permuted":
        return full.transpose(0, 1).contiguous()
    raise ValueError(f"layout={layout!r}; allowed: {list(LAYOUTS)}")


def _view(stored: torch.Tensor, layout: str) -> torch.Tensor:
    """The view of ``stored`` (from :func:`_store`) that the call site receives."""
    if layout == "transposed":
        return stored.transpose(-1, -2)
    if layout == "sliced":
        return stored.narrow(-1, _PAD[0], stored.shape[-1] - sum(_PAD))
    return stored.transpose(0, 1)


def _leaf(full: torch.Tensor, layout: str, device: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stored leaf that collects the gradient, the view of it equal to ``full``)."""
    leaf = _store(full, layout).to(device=device, dtype=dtype).requires_grad_()
    return leaf, _view(leaf, layout)


def _batch(layout: str) -> tuple[int, ...]:
    """The leading (batch) dimensions of a call site's input: 6 rows, or 2 x 3 where dimensions are permuted."""
    return (2, 3) if layout == "permuted" else (6,)


def _read(y: torch.Tensor, layout: str) -> torch.Tensor:
    """The output as the loss reads it: through a view, so the gradient flowing back into ``y`` is a view."""
    if layout == "transposed":
        return y.transpose(-1, -2)
    if layout == "sliced":
        return y.narrow(-1, 1, y.shape[-1] - 1)
    return y.transpose(0, 1)


def _loss(v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (v * c.to(v)).sum() + v.pow(2).sum() / 2


def _check(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    """``got`` equals the fp64 ``want`` within fp32 rounding (relative to the largest entry of ``want``)."""
    assert got is not None, f"{what}: no value (no gradient reached it)"
    assert want is not None
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.numel():
        return
    err = (got.detach().double().cpu() - want).abs().max().item()
    assert err <= 1e-6 + 1e-5 * want.abs().max().item(), (
        f"{what}: max error {err:.3e} (|want| <= {want.abs().max():.3g})"
    )


_D, _H, _O = 5, 7, 3  # hidden 7: uneven shards over 2, 3 and 4 ranks


def _pair_weights() -> tuple[torch.Tensor, ...]:
    return shared_randn(41, _H, _D), shared_randn(42, _H), shared_randn(43, _O, _H), shared_randn(44, _O)


def _kept_in_out(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in]) as a model that keeps its weights ``[in, out]`` passes it: ``stored.t()``."""
    return _view(_store(w.float(), "transposed"), "transposed")


# -- A7: the guarded all-reduce on every topology ------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A7")
def test_a7_guarded_all_reduce_views(ctx: Any, kind: str, layout: str) -> None:
    """The reduced values land in the caller's view (its storage around a slice untouched); a group that
    is not parallel leaves the view as it was (A5)."""
    require(ctx.target, "guarded_all_reduce", "is_parallel")
    group = topology(ctx, kind)
    full = ctx.randn(2, 3, 4)
    stored = _store(full, layout).to(ctx.device)
    t = _view(stored, layout)
    assert not t.is_contiguous()
    everyone = gathered(full.to(ctx.device))
    outside = stored.clone()
    out = ctx.target.all_reduce(t, group)
    ranks = members(ctx, kind) if ctx.target.is_parallel(group) else []
    want = torch.stack([everyone[r] for r in ranks]).sum(0) if ranks else full.to(ctx.device)
    torch.testing.assert_close(t, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{kind}/{layout}: the view: {m}")
    _view(outside, layout).copy_(want)
    torch.testing.assert_close(stored, outside, rtol=1e-6, atol=1e-6, msg=lambda m: f"{kind}/{layout}: storage: {m}")
    if out is not None:
        assert out.data_ptr() == t.data_ptr() and out.stride() == t.stride(), "the result must be the caller's view"


# -- A6/A7: the tensor-parallel pair ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A7")
def test_a7_tensor_parallel_pair_views(ctx: Any, kind: str, layout: str) -> None:
    """Column then row layer, built from weights kept ``[in, out]`` (the layers get ``w.t()``), on an input
    view, with the loss read through a view of the output. Output, every shard's gradient and the input's
    gradient (all-reduced by the column layer backward) equal the full one-process computation."""
    require(ctx.target, "tensor_parallel_linear", "is_parallel")
    group = topology(ctx, kind)
    w1, b1, w2, b2 = _pair_weights()
    col = ctx.target.column_parallel_linear(_kept_in_out(w1), b1.float(), group).to(ctx.device)
    row = ctx.target.row_parallel_linear(_kept_in_out(w2), b2.float(), group).to(ctx.device)
    h = col.weight.shape[0]
    if not ctx.target.is_parallel(group):
        assert h == _H, f"{kind}: a rank that is not parallel holds the whole layer, got {h} of {_H} rows"
    full_x = shared_randn(45, *_batch(layout), _D)
    leaf, x = _leaf(full_x, layout, ctx.device, torch.float32)
    assert not x.is_contiguous()
    y = row(torch.tanh(col(x)))
    c = shared_randn(46, *_read(y, layout).shape)
    _loss(_read(y, layout), c).backward()  # type: ignore[no-untyped-call]

    ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    rleaf, rx = _leaf(full_x, layout, "cpu", torch.float64)
    yr = F.linear(torch.tanh(F.linear(rx, ref[0], ref[1])), ref[2], ref[3])
    _loss(_read(yr, layout), c).backward()  # type: ignore[no-untyped-call]
    what = f"{kind}/{layout}"
    _check(y, yr.detach(), f"{what}: output")
    o = block_offset(w1.float(), col.weight.detach().cpu(), 0)
    g1, gb1, g2, gb2 = (t.grad for t in ref)
    assert g1 is not None and gb1 is not None and g2 is not None
    _check(leaf.grad, rleaf.grad, f"{what}: gradient of the input (all-reduced by the column layer backward)")
    _check(col.weight.grad, g1[o : o + h], f"{what}: gradient of the column layer's weight shard")
    _check(col.bias.grad, gb1[o : o + h], f"{what}: gradient of the column layer's bias shard")
    _check(row.weight.grad, g2[:, o : o + h], f"{what}: gradient of the row layer's weight shard")
    _check(row.bias.grad, gb2, f"{what}: gradient of the row layer's bias")


# -- A6/A7: the vocab-parallel cross-entropy ----------------------------------------------------------------
_VOCAB = 11
#: Uneven vocabulary shards with none empty (empty shards are the contiguous spec's), so that a result
#: here is about the layout alone.
_SHARDS = {1: [11], 2: [6, 5], 3: [4, 3, 4], 4: [3, 3, 3, 2]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A7")
def test_a7_vocab_parallel_cross_entropy_views(ctx: Any, kind: str, layout: str) -> None:
    """The rank's logits are a view (vocabulary-major logits transposed, one shard of the full logits'
    storage, sequence-first logits read batch-first): loss and the gradient reaching the logits' storage
    equal ``F.cross_entropy`` on the full logits."""
    require(ctx.target, "vocab_parallel_cross_entropy", "is_parallel")
    group = topology(ctx, kind)
    parallel = ctx.target.is_parallel(group)
    sizes = _SHARDS[dist.get_world_size(group)] if parallel else [_VOCAB]
    grank = dist.get_rank(group) if parallel else 0
    start, n = sum(sizes[:grank]), sizes[grank]
    logits = shared_randn(51, *_batch(layout), _VOCAB)
    target = torch.randint(0, _VOCAB, _batch(layout), generator=torch.Generator().manual_seed(52))
    leaf, local = _leaf(logits[..., start : start + n], layout, ctx.device, torch.float32)
    assert not local.is_contiguous()
    loss = ctx.target.vocab_parallel_cross_entropy(local, target.to(ctx.device), group, start)
    loss.backward()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, _VOCAB), target.reshape(-1))
    want.backward()  # type: ignore[no-untyped-call]
    assert full.grad is not None and leaf.grad is not None
    got, ref = float(loss.detach()), float(want.detach())
    assert abs(got - ref) <= 1e-6 * abs(ref), f"{kind}/{layout}: loss {got} != {ref}"
    _check(_view(leaf.grad, layout), full.grad[..., start : start + n], f"{kind}/{layout}: gradient of the logits")


# -- A6/A7: the global-norm helper ----------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["tensors", "gradients"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3, 4], contract="A7")
def test_a7_global_norm_views(ctx: Any, kind: str, layout: str, source: str) -> None:
    """The norm over the group of each rank's shards, passed as views: of the tensors themselves, or of
    the gradients a backward through such views leaves (rows split unevenly, empty shards at W = 4)."""
    require(ctx.target, "global_norm", "is_parallel")
    group = topology(ctx, kind)
    full = [shared_randn(61, 7, 2, 3), shared_randn(62, 3, 4, 5)]
    if ctx.target.is_parallel(group):
        T, grank = dist.get_world_size(group), dist.get_rank(group)
        mine = [torch.tensor_split(t, T)[grank] for t in full]
    else:
        mine = full
    tensors = []
    for t in mine:
        if source == "tensors":
            tensors.append(_view(_store(t.float(), layout).to(ctx.device), layout))
        else:
            leaf, v = _leaf(torch.zeros_like(t), layout, ctx.device, torch.float32)
            (v * t.float().to(ctx.device)).sum().backward()  # type: ignore[no-untyped-call]
            assert leaf.grad is not None
            tensors.append(_view(leaf.grad, layout))
    got = ctx.target.global_norm(tensors, group)
    want = float(torch.sqrt(sum(t.pow(2).sum() for t in full)))  # type: ignore[arg-type]
    assert abs(float(got) - want) <= 1e-6 * want, f"{kind}/{layout}/{source}: norm {float(got)} != {want}"


# -- A6/A7: the ZeRO model-parallel reductions ------------------------------------------------------------------
_IN = 4


class _FeaturesFirstNet(torch.nn.Module):
    """A replicated layer whose activation is computed features-first and read as ``[N, D]`` (column-major),
    feeding the tensor-parallel pair: the column layer's input gradient is column-major, and the
    replicated layer's gradient is right only if the column layer's backward all-reduce lands."""

    def __init__(self, w0: torch.Tensor, col: torch.nn.Module, row: torch.nn.Module) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(w0.float().clone())
        self.col, self.row = col, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.w0 @ x.t()).t()
        out: torch.Tensor = self.row(torch.tanh(self.col(h)))
        return out


def _features_first(w0: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                    x: torch.Tensor) -> torch.Tensor:  # fmt: skip
    h = torch.tanh(w0 @ x.t()).t()
    return F.linear(torch.tanh(F.linear(h, w1, b1)), w2, b2)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", TOPOLOGIES)
@dstest.spec(world_size=[1, 2, 3], contract="A7")
def test_a7_zero_model_parallel_views(ctx: Any, kind: str, stage: int) -> None:
    """An engine over :class:`_FeaturesFirstNet` (pair built from weights kept ``[in, out]``, input a
    transposed view, loss read through the output transposed): the gradients the optimizer receives
    (shards, and the replicated layers') and the global norm equal the full one-process computation."""
    require(ctx.target, "mp_group", "tensor_parallel_linear", "is_parallel", f"stage{stage}")
    group = topology(ctx, kind)
    w0 = shared_randn(71, _D, _IN)
    w1, b1, w2, b2 = _pair_weights()
    col = ctx.target.column_parallel_linear(_kept_in_out(w1), b1.float(), group)
    row = ctx.target.row_parallel_linear(_kept_in_out(w2), b2.float(), group)
    h = col.weight.shape[0]
    o = block_offset(w1.float(), col.weight.detach().cpu(), 0)
    model = _FeaturesFirstNet(w0, col, row).to(ctx.device)
    # Data parallelism is not the point here: every rank is its own data-parallel group.
    engine = ctx.target.initialize(model, config(stage, "mean"), dp_group=ctx.groups.single(), mp_group=group)
    full_x = shared_randn(72, 6, _IN)
    _, x = _leaf(full_x, "transposed", ctx.device, torch.float32)
    x = x.detach()
    y = engine(x)
    c = shared_randn(73, *y.t().shape)
    engine.backward(_loss(y.t(), c))
    grads = engine.full_gradients()
    engine.step()

    ref = [t.clone().requires_grad_() for t in (w0, w1, b1, w2, b2)]
    yr = _features_first(ref[0], ref[1], ref[2], ref[3], ref[4], full_x)
    _loss(yr.t(), c).backward()  # type: ignore[no-untyped-call]
    g0, g1, gb1, g2, gb2 = (t.grad for t in ref)
    assert g0 is not None and g1 is not None and gb1 is not None and g2 is not None and gb2 is not None
    what = f"{kind}/stage {stage}"
    _check(y, yr.detach(), f"{what}: output")
    wants = {
        "w0": g0, "col.weight": g1[o : o + h], "col.bias": gb1[o : o + h], "row.weight": g2[:, o : o + h], "row.bias": gb2,
    }  # fmt: skip
    assert set(grads) == set(wants), f"{what}: parameters {sorted(grads)}, expected {sorted(wants)}"
    for name, want in wants.items():
        _check(grads[name], want, f"{what}: gradient of {name} (w0: through the column all-reduce)")
    norm = engine.get_global_grad_norm()
    full_norm = float(torch.sqrt(sum(t.pow(2).sum() for t in (g0, g1, gb1, g2, gb2))))  # type: ignore[arg-type]
    assert norm is not None and abs(float(norm) - full_norm) <= 1e-5 * full_norm, f"{what}: norm {norm} != {full_norm}"
