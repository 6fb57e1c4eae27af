"""contracts part C: ``zero_optimization.compute_grad_norm`` (the gradient-norm fast path) and overflow protection."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

import dstest
from dstest.conformance._helpers import (
    DTYPE_CONFIGS,
    assert_close_rel,
    batch,
    broadcast_tmpdir,
    build,
    collectives_issued,
    config,
    micro_step,
    mse,
    reference_grads,
    train_step,
)
from dstest.targets import require

OPS = ("mean", "sum")
_NO_NORM = {"compute_grad_norm": False}


def _expect_config_error(target: Any, cfg: dict[str, Any], *names: str) -> str:
    with pytest.raises(target.config_errors) as err:
        target.check_config(cfg)
    msg = str(err.value)
    for name in names:
        assert name in msg, f"{name!r} missing from the error message: {msg}"
    return msg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@dstest.spec(world_size=[1], contract="C1")
def test_c1_false_only_at_stages_1_and_2(ctx: Any, stage: int) -> None:
    target = ctx.target
    require(target, "config_check", "compute_grad_norm")
    target.check_config(config(stage))  # the default (true) is valid everywhere
    cfg = config(stage, zero=_NO_NORM)
    if stage in (1, 2):
        target.check_config(cfg)
    else:
        msg = _expect_config_error(target, cfg, "compute_grad_norm", "stage")
        # "stage=3", "stage 3", "stage: 3": a bare digit elsewhere (a version in a link) does not count.
        assert re.search(rf"stage\s*[=:]?\s*{stage}\b", msg, re.IGNORECASE), (
            f"the message must name the stage received ({stage}): {msg}"
        )


@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1, 2], contract="C1")
def test_c1_default_is_true(ctx: Any, stage: int) -> None:
    require(ctx.target, f"stage{stage}")
    engine = ctx.target.initialize(build(device=ctx.device), config(stage))
    train_step(ctx, engine, 0)
    norm = engine.get_global_grad_norm()
    assert norm is not None and math.isfinite(float(norm)) and float(norm) > 0, norm


@pytest.mark.parametrize(
    "conflict,extra",
    [
        ("gradient_clipping", {"gradient_clipping": 1.0}),
        ("zenflow", {"zero": {"zenflow": {"topk_ratio": 0.1}}}),
        ("offload_optimizer", {"zero": {"offload_optimizer": {"device": "cpu"}}}),
    ],
    ids=["clipping", "zenflow", "offload"],
)
@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1], contract="C2")
def test_c2_false_rejected_with_clipping_zenflow_offload(ctx: Any, stage: int, conflict: str, extra: Any) -> None:
    target = ctx.target
    require(target, "config_check", "compute_grad_norm")
    zero = {**_NO_NORM, **extra.get("zero", {})}
    top = {k: v for k, v in extra.items() if k != "zero"}
    _expect_config_error(target, config(stage, zero=zero, **top), "compute_grad_norm", conflict)


@pytest.mark.parametrize("dtype", list(DTYPE_CONFIGS))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1, 2, 3], contract="C3")
def test_c3_false_matches_true_bit_for_bit(ctx: Any, stage: int, op: str, dtype: str) -> None:
    require(ctx.target, f"stage{stage}", "compute_grad_norm", *([dtype] if dtype != "fp32" else []))
    top, in_dtype = DTYPE_CONFIGS[dtype]
    on = ctx.target.initialize(build(device=ctx.device), config(stage, op, optimizer="AdamW", lr=0.01, **top))
    off = ctx.target.initialize(
        build(device=ctx.device), config(stage, op, optimizer="AdamW", lr=0.01, zero=_NO_NORM, **top)
    )
    for step in range(3):
        train_step(ctx, on, step, dtype=in_dtype)
        train_step(ctx, off, step, dtype=in_dtype)
        norm = on.get_global_grad_norm()
        assert norm is not None and math.isfinite(float(norm)), f"step {step} must be finite, norm {norm}"
        assert off.get_global_grad_norm() is None, f"compute_grad_norm=false: norm {off.get_global_grad_norm()}"
        p_on, p_off = on.full_parameters(), off.full_parameters()
        for name in p_on:
            assert torch.equal(p_on[name], p_off[name]), f"step {step}: {name} differs between true and false"


_C4_CASES = [(0, True), (1, True), (1, False), (2, True), (2, False)]


@pytest.mark.parametrize("poison", ["nan-loss", "inf-gain", "nan-gain"])
@pytest.mark.parametrize("dtype", list(DTYPE_CONFIGS))
@pytest.mark.parametrize("stage,compute_norm", _C4_CASES, ids=[f"stage{s}-norm{n}" for s, n in _C4_CASES])
@dstest.spec(world_size=[1, 2, 3], contract="C4")
def test_c4_overflow_on_one_rank_skips_step_everywhere(
    ctx: Any, stage: int, compute_norm: bool, dtype: str, poison: str
) -> None:
    require(
        ctx.target,
        f"stage{stage}",
        *([dtype] if dtype != "fp32" else []),
        *([] if compute_norm else ["compute_grad_norm"]),
    )
    top, in_dtype = DTYPE_CONFIGS[dtype]
    zero = {} if compute_norm else _NO_NORM
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, "mean", optimizer="AdamW", zero=zero, **top))
    train_step(ctx, engine, 0, dtype=in_dtype)  # a good step first: optimizer state exists
    before = engine.full_parameters()
    bad_rank = ctx.world_size - 1
    x, y = batch(ctx.seed, ctx.rank, 1, device=ctx.device)
    loss = mse(engine(x.to(in_dtype)), y)
    if ctx.rank == bad_rank:
        value, where = poison.split("-")
        if where == "loss":  # every gradient element of this rank
            loss = loss * float(value)
        else:  # one element (SpecNet.gain): after a reduce-scatter only its owner sees it
            loss = loss + (engine.module.gain.float() * float(value)).sum()
    engine.backward(loss)
    engine.step()
    after = engine.full_parameters()
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed although rank {bad_rank} overflowed"
    norm = engine.get_global_grad_norm()
    if compute_norm:
        assert norm is not None and math.isinf(float(norm)), f"norm after overflow: {norm}, expected inf"
    else:
        assert norm is None, f"norm with compute_grad_norm=false: {norm}"
    train_step(ctx, engine, 2, dtype=in_dtype)  # training resumes
    resumed = engine.full_parameters()
    assert any(not torch.equal(after[n], resumed[n]) for n in after), "the step after an overflow must update"
    assert all(bool(torch.isfinite(v).all()) for v in resumed.values())


@pytest.mark.parametrize("stage", [0, 1, 2])
@dstest.spec(world_size=[1, 2, 3], contract="C5")
def test_c5_scale_one_leaves_gradients_untouched(ctx: Any, stage: int) -> None:
    """fp32, no clipping: the optimizer applies the reduced gradient itself (SGD lr=1: p - g, bit for bit)."""
    require(ctx.target, f"stage{stage}")
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, "mean", lr=1.0))
    before = engine.full_parameters()
    _, grads = train_step(ctx, engine, 0)
    after = engine.full_parameters()
    for name in before:
        assert torch.equal(after[name], before[name].add(grads[name], alpha=-1.0)), name
    if ctx.target.supports("grad_multiplier"):
        assert engine.last_grad_multiplier() is None, f"multiplied by {engine.last_grad_multiplier()}"


@pytest.mark.parametrize("case", ["loss_scale_2", "clipping"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@dstest.spec(world_size=[1, 2, 3], contract="C5")
def test_c5_effective_scale_multiplies_by_inverse(ctx: Any, stage: int, case: str) -> None:
    """A static loss scale of 2 gives x0.5; clipping gives 1/((norm + 1e-6) / max_norm)."""
    require(ctx.target, f"stage{stage}", *(["fp16"] if case == "loss_scale_2" else []))
    batches = [[batch(ctx.seed, r, 0)] for r in range(ctx.world_size)]
    ref = reference_grads(build, batches, "mean")
    ref_norm = math.sqrt(sum(float(v.pow(2).sum()) for v in ref.values()))
    if case == "loss_scale_2":
        cfg, in_dtype, tol = config(stage, lr=1.0, fp16={"enabled": True, "loss_scale": 2}), torch.float16, 2e-2
        coef = 1.0
    else:
        max_norm = ref_norm / 3
        cfg, in_dtype, tol = config(stage, lr=1.0, gradient_clipping=max_norm), torch.float32, 1e-5
        coef = max_norm / (ref_norm + 1e-6)
    engine = ctx.target.initialize(build(device=ctx.device), cfg)
    before = engine.full_parameters()
    train_step(ctx, engine, 0, dtype=in_dtype)
    after = engine.full_parameters()
    step = {n: (before[n] - after[n]).double() for n in before}
    assert_close_rel(step, {n: coef * v for n, v in ref.items()}, tol, f"{case}: update")
    if ctx.target.supports("grad_multiplier"):
        mult = engine.last_grad_multiplier()
        want = 0.5 if case == "loss_scale_2" else coef
        assert mult is not None and abs(mult - want) <= 1e-6 * want, f"{case}: multiplier {mult}, expected {want}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1, 2, 3, 4], contract="C6")
def test_c6_false_issues_one_collective_fewer(ctx: Any, stage: int, op: str) -> None:
    """Counted per step by the world (``ctx.comm``: every collective the rank issues from its forward to
    its optimizer step, on any group; see ``collectives_issued``). At W = 1 nothing is exchanged at all (A8), so there is nothing
    to remove."""
    require(ctx.target, f"stage{stage}", "compute_grad_norm")
    counts = {}
    for compute_norm in (True, False):
        zero = {} if compute_norm else _NO_NORM
        engine = ctx.target.initialize(build(device=ctx.device), config(stage, op, zero=zero))
        for step in range(2):
            with collectives_issued(ctx, engine) as issued:
                micro_step(ctx, engine, step)
                engine.step()
            counts[compute_norm, step] = issued
    fewer = 1 if ctx.world_size > 1 else 0
    for step in range(2):
        on, off = counts[True, step], counts[False, step]
        assert sum(on.values()) - sum(off.values()) == fewer, f"step {step}: true {on}, false {off}"
        assert on.get("all_reduce", 0) - off.get("all_reduce", 0) == fewer, f"step {step}: true {on}, false {off}"


@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1, 2, 3], contract="C7")
def test_c7_checkpoint_never_overrides_clipping(ctx: Any, stage: int) -> None:
    target = ctx.target
    require(target, f"stage{stage}", "checkpoint", "compute_grad_norm")
    path, cleanup = broadcast_tmpdir()
    try:
        src = target.initialize(build(device=ctx.device), config(stage, gradient_clipping=1.0))
        train_step(ctx, src, 0)
        src.save_checkpoint(path, tag="clipped")
        saved = src.full_parameters()

        off = target.initialize(build(device=ctx.device), config(stage, zero=_NO_NORM))
        with pytest.raises(target.config_errors) as err:
            off.load_checkpoint(path, tag="clipped")
        msg = str(err.value)
        assert "gradient_clipping" in msg and "compute_grad_norm" in msg, msg

        for clip in (0.0, 0.25):
            dst = target.initialize(build(device=ctx.device), config(stage, lr=1.0, gradient_clipping=clip))
            dst.load_checkpoint(path, tag="clipped")
            assert dst.gradient_clipping() == clip, f"loading changed clipping {clip} to {dst.gradient_clipping()}"
            loaded = dst.full_parameters()
            for name in saved:
                assert torch.equal(loaded[name], saved[name]), f"{name} not restored"
            # the configured threshold, not the saved 1.0, governs the next step (loss x 100: norm > 1)
            _, grads = train_step(ctx, dst, 1, scale_loss=100.0)
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
            assert norm > 1.0, f"precondition: norm {norm} must exceed the saved threshold 1.0"
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            after = dst.full_parameters()
            step = {n: (loaded[n] - after[n]).double() for n in loaded}
            assert_close_rel(step, {n: coef * g.double() for n, g in grads.items()}, 1e-5, f"clip {clip}")
    finally:
        cleanup()
