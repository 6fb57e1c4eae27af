"""contracts part B: ``gradient_allreduce_op`` "mean" | "sum" at stages 0-2, and B2 and B8 at stage 3.

The stage-3 specs (``test_b2_stage3_*``, ``test_b8_stage3_*``) use :class:`Hidden13` (hidden size 13) and
skip a target without the "stage3" feature; their reduction paths are
:data:`~dstest.conformance._helpers.STAGE3_PATHS`.

Every gradient check compares with an exact fp64 reference computed from every rank's data (which any
rank can regenerate), on a model whose parameter sizes are not divisible by W, with different data per
rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.conformance._helpers import (
    PATHS,
    STAGE3_PATHS,
    Hidden13,
    WideNet,
    assert_close_rel,
    batch,
    build,
    config,
    mse,
    path_config,
    reference_grads,
    rel_err,
    train_step,
)
from dstest.targets import require

STAGES = (0, 1, 2)
OPS = ("mean", "sum")
_PATH_FEATURES = {
    "reduce_scatter": ("reduce_scatter_path",),
    "all_reduce_fallback": ("all_reduce_path",),
    "non_contiguous": ("non_contiguous_path",),
    "overlap": ("overlap_comm",),
}
_PATH_CASES = [(s, p) for p, (stages, _, _) in PATHS.items() for s in stages]


def _reference(ctx: Any, op: str, gas: int = 1, step: int = 0) -> dict[str, torch.Tensor]:
    batches = [[batch(ctx.seed, r, step * gas + k) for k in range(gas)] for r in range(ctx.world_size)]
    return reference_grads(build, batches, op)


@pytest.mark.parametrize(
    "value", ["mean", "sum", "MEAN", "Sum", "avg", "average", "", "meansum", 1, None, ["mean"]], ids=repr
)
@dstest.spec(world_size=[1], contract="B1")
def test_b1_reduce_op_values(ctx: Any, value: Any) -> None:
    """Default "mean"; "mean"/"sum" case-insensitively; anything else is a clear config-time error."""
    target = ctx.target
    require(target, "config_check")
    cfg = config(0)
    del cfg["gradient_allreduce_op"]
    target.check_config(cfg)  # the key is optional
    cfg["gradient_allreduce_op"] = value
    if isinstance(value, str) and value.lower() in OPS:
        target.check_config(cfg)
        return
    with pytest.raises(target.config_errors) as err:
        target.check_config(cfg)
    msg = str(err.value)
    assert "gradient_allreduce_op" in msg, msg
    assert repr(value) in msg, f"the message must show the value received ({value!r}): {msg}"
    assert "mean" in msg and "sum" in msg, f"the message must list the allowed values: {msg}"


@pytest.mark.parametrize("value", [None, "MEAN", "Sum"], ids=["default", "MEAN", "Sum"])
@dstest.spec(world_size=[1, 2, 3], contract="B1")
def test_b1_default_mean_and_case_insensitive_behaviour(ctx: Any, value: str | None) -> None:
    """Not only accepted: the default trains as "mean", and "MEAN"/"Sum" train as "mean"/"sum"."""
    require(ctx.target, "stage0")
    cfg = config(0)
    if value is None:
        del cfg["gradient_allreduce_op"]
    else:
        cfg["gradient_allreduce_op"] = value
    engine = ctx.target.initialize(build(device=ctx.device), cfg)
    _, grads = train_step(ctx, engine, 0)
    op = "mean" if value is None else value.lower()
    assert_close_rel(grads, _reference(ctx, op), 1e-6, f"gradient_allreduce_op={value!r}")


@pytest.mark.parametrize("stage,path", _PATH_CASES, ids=[f"stage{s}-{p}" for s, p in _PATH_CASES])
@dstest.spec(world_size=[1, 2, 3], contract="B2")
def test_b2_sum_is_w_times_mean(ctx: Any, stage: int, path: str) -> None:
    """mean delivers (1/W)·Σ g_r, sum delivers Σ g_r = W x mean, on every reduction path."""
    require(ctx.target, f"stage{stage}", *_PATH_FEATURES.get(path, ()))
    gas = PATHS[path][2].get("gradient_accumulation_steps", 1)
    got = {}
    for op in OPS:
        engine = ctx.target.initialize(build(device=ctx.device), path_config(stage, path, op))
        _, got[op] = train_step(ctx, engine, 0, gas)
        assert_close_rel(got[op], _reference(ctx, op, gas), 1e-6, f"{op} at stage {stage}, path {path}")
    W = ctx.world_size
    assert_close_rel(got["sum"], {k: W * v for k, v in got["mean"].items()}, 1e-6, "sum vs W x mean")


@pytest.mark.parametrize("factor", [3.5, 16.0, "W"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", STAGES)
@dstest.spec(world_size=[1, 2, 3], contract="B3")
def test_b3_predivide_keeps_exact_mean_and_sum(ctx: Any, stage: int, op: str, factor: Any) -> None:
    require(ctx.target, f"stage{stage}")
    f = float(ctx.world_size) if factor == "W" else factor
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, op, gradient_predivide_factor=f))
    _, grads = train_step(ctx, engine, 0)
    assert_close_rel(grads, _reference(ctx, op), 1e-6, f"{op} with gradient_predivide_factor={f}")


@pytest.mark.parametrize("stage", STAGES)
@dstest.spec(world_size=[1, 2, 3], contract="B3")
def test_b3_prescale_is_exact_mean(ctx: Any, stage: int) -> None:
    require(ctx.target, f"stage{stage}")
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, "mean", prescale_gradients=True))
    _, grads = train_step(ctx, engine, 0)
    assert_close_rel(grads, _reference(ctx, "mean"), 1e-6, "mean with prescale_gradients")


@dstest.spec(world_size=[1], contract="B3")
def test_b3_no_setting_silently_ignored(ctx: Any) -> None:
    """prescale_gradients has no meaning with "sum"; with prescaling a predivide factor would be ignored."""
    target = ctx.target
    require(target, "config_check")
    for cfg, names in [
        (config(0, "sum", prescale_gradients=True), ("prescale_gradients", "sum")),
        (config(0, "mean", prescale_gradients=True, gradient_predivide_factor=4.0), ("gradient_predivide_factor",)),
    ]:
        with pytest.raises(target.config_errors) as err:
            target.check_config(cfg)
        for name in names:
            assert name in str(err.value), f"{name!r} missing from: {err.value}"


class _EmbNet(torch.nn.Module):
    """Embedding(13, 5) (sparse gradients when sparse=True) -> mean over tokens -> Linear(5, 7)."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 5, sparse=sparse)
        self.head = torch.nn.Linear(5, 7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(tokens).mean(dim=1))
        return out


def _tokens(ctx_seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dstest.context import rank_seed

    g = torch.Generator().manual_seed(rank_seed(ctx_seed + 77, rank))
    n_tok = 2 + rank  # a different number of distinct rows per rank: uneven sparse sizes
    return torch.randint(0, 13, (3, n_tok), generator=g), torch.randn(3, 7, generator=g)


@pytest.mark.parametrize("factor", [1.0, 3.5])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage,sparse_path", [(0, True), (0, False), (1, False), (2, False)])
@dstest.spec(world_size=[1, 2, 3], contract="B4")
def test_b4_sparse_gradients_mean_and_sum(ctx: Any, stage: int, sparse_path: bool, op: str, factor: float) -> None:
    require(ctx.target, f"stage{stage}", *(["sparse_gradients"] if sparse_path else []))
    model = build(lambda: _EmbNet(sparse=True), device=ctx.device)
    cfg = config(stage, op, gradient_predivide_factor=factor, sparse_gradients=sparse_path)
    engine = ctx.target.initialize(model, cfg)
    tokens, y = _tokens(ctx.seed, ctx.rank)
    engine.backward(mse(engine(tokens.to(ctx.device)), y.to(ctx.device)))
    grads = engine.full_gradients()
    engine.step()
    ref = build(lambda: _EmbNet(sparse=False)).double()
    want = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(ctx.world_size):
        t, yr = _tokens(ctx.seed, r)
        ref.zero_grad()
        mse(ref(t), yr.double()).backward()  # type: ignore[no-untyped-call]
        for n, p in ref.named_parameters():
            assert p.grad is not None
            want[n] += p.grad
    if op == "mean":
        want = {n: v / ctx.world_size for n, v in want.items()}
    assert_close_rel(grads, want, 1e-6, f"sparse {op}, factor {factor}, stage {stage}")


@pytest.mark.parametrize("comm_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", STAGES)
@dstest.spec(world_size=[1, 2, 3], contract="B5")
def test_b5_communication_data_type(ctx: Any, stage: int, op: str, comm_dtype: str) -> None:
    require(ctx.target, f"stage{stage}")
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, op, communication_data_type=comm_dtype))
    _, grads = train_step(ctx, engine, 0)
    eps = torch.finfo(torch.float16 if comm_dtype == "fp16" else torch.bfloat16).eps
    tol = 4 * eps  # a few roundings of the operands and the sum
    err = rel_err(grads, _reference(ctx, op))
    assert err <= tol, f"{op} over {comm_dtype}: relative error {err:.3e} > {tol:.1e}"
    if op == "sum" and ctx.world_size > 1:
        # Honoured, not just tolerated: a sum that went over the wire in that dtype (and is not rescaled
        # afterwards) consists of values that dtype can represent.
        wire = torch.float16 if comm_dtype == "fp16" else torch.bfloat16
        for name, g in grads.items():
            assert torch.equal(g.to(wire).float(), g.float()), f"{name}: values not representable in {comm_dtype}"


@pytest.mark.parametrize("clip", ["tight", "loose"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("stage", STAGES)
@dstest.spec(world_size=[1, 2, 3], contract="B6")
def test_b6_norm_and_clipping_use_reduced_gradient(ctx: Any, stage: int, op: str, clip: str) -> None:
    require(ctx.target, f"stage{stage}")
    ref = _reference(ctx, op)
    ref_norm = math.sqrt(sum(float(v.pow(2).sum()) for v in ref.values()))
    max_norm = ref_norm * (0.5 if clip == "tight" else 2.0)
    lr = 1.0  # a large step keeps the fp32 rounding of (before - after) well below the tolerance
    engine = ctx.target.initialize(build(device=ctx.device), config(stage, op, lr=lr, gradient_clipping=max_norm))
    before = engine.full_parameters()
    train_step(ctx, engine, 0)
    after = engine.full_parameters()
    norm = engine.get_global_grad_norm()
    assert norm is not None and abs(float(norm) - ref_norm) <= 1e-5 * ref_norm, f"norm {norm} != {ref_norm}"
    coef = min(1.0, max_norm / (ref_norm + 1e-6))
    step = {n: (before[n] - after[n]).double() for n in before}
    want = {n: lr * coef * v for n, v in ref.items()}
    assert_close_rel(step, want, 1e-5, f"update with clipping {max_norm:.4g} (coef {coef:.4g})")


@pytest.mark.parametrize("feature", ["zenflow", "deepcompile"])
@dstest.spec(world_size=[1, 2, 3], contract="B7")
def test_b7_sum_rejected_with_zenflow_and_compiled_path(ctx: Any, feature: str) -> None:
    target = ctx.target
    require(target, "config_check")
    if feature == "zenflow":
        cfg = config(2, "sum", zero={"zenflow": {"topk_ratio": 0.1}})
    else:
        cfg = config(2, "sum", compile={"deepcompile": True})
    with pytest.raises(target.config_errors) as err:
        target.check_config(cfg)
    msg = str(err.value)
    assert "gradient_allreduce_op" in msg and "'sum'" in msg and feature in msg.lower(), msg
    # Before any collective: only rank 0 tries; had it issued a collective, the all-reduce below would not
    # match it on the other ranks and the world would report the mismatch.
    if ctx.rank == 0:
        with pytest.raises(target.config_errors):
            target.initialize(build(device=ctx.device), cfg)
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@pytest.mark.parametrize("stage", STAGES)
@dstest.spec(world_size=[1, 2, 3], contract="B8")
def test_b8_sum_over_w_trains_like_mean(ctx: Any, stage: int, optimizer: str) -> None:
    """5 steps: a "sum" run whose loss is divided by W matches a "mean" run step by step."""
    require(ctx.target, f"stage{stage}")
    W = ctx.world_size
    mean = ctx.target.initialize(build(device=ctx.device), config(stage, "mean", optimizer=optimizer, lr=0.05))
    summ = ctx.target.initialize(build(device=ctx.device), config(stage, "sum", optimizer=optimizer, lr=0.05))
    for step in range(5):
        loss_m, grads_m = train_step(ctx, mean, step)
        loss_s, grads_s = train_step(ctx, summ, step, scale_loss=1.0 / W)
        assert abs(loss_m - loss_s) <= 1e-6 * max(abs(loss_m), 1e-12), f"step {step}: loss {loss_s} != {loss_m}"
        assert_close_rel(grads_s, grads_m, 1e-6, f"step {step}: full gradients")
        assert_close_rel(summ.full_parameters(), mean.full_parameters(), 1e-6, f"step {step}: fp32 parameters")


@pytest.mark.parametrize("stage", [1, 2])
@dstest.spec(world_size=[1, 2, 3, 4], contract="B9")
def test_b9_state_is_partitioned(ctx: Any, stage: int) -> None:
    """Between steps each rank holds ~1/W (plus padding) of master params, optimizer state (and grads)."""
    require(ctx.target, f"stage{stage}", "state_bytes")
    model = build(WideNet, device=ctx.device)
    n = sum(p.numel() for p in model.parameters())
    engine = ctx.target.initialize(model, config(stage, "mean", optimizer="AdamW"))
    x, y = batch(ctx.seed, ctx.rank, 0, d_in=WideNet.d_in, d_out=WideNet.d_out, device=ctx.device)
    engine.backward(mse(engine(x), y))
    engine.step()
    held = engine.state_bytes()
    share = math.ceil(n / ctx.world_size) * 4  # fp32 bytes of one partition, padding included
    expected = {"master_params": share, "optimizer_state": 2 * share}
    if stage == 2:
        expected["gradients"] = share
    for key, want in expected.items():
        got = held[key]
        assert abs(got - want) <= 0.05 * want, (
            f"stage {stage}, W={ctx.world_size}: {key} holds {got} bytes, expected {want} "
            f"(1/W of {n} fp32 elements plus padding) within 5%"
        )


# -- B2, B8 at stage 3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(STAGE3_PATHS))
@dstest.spec(world_size=[1, 2, 3], contract="B2")
def test_b2_stage3_sum_is_w_times_mean(ctx: Any, path: str) -> None:
    """Stage 3: mean is (1/W)·Σ g_r (fp64 reference), sum is Σ g_r = W x mean, on every reduction path."""
    require(ctx.target, "stage3")
    zero, top = STAGE3_PATHS[path]
    gas = top.get("gradient_accumulation_steps", 1)
    W = ctx.world_size
    batches = [[batch(ctx.seed, r, k, d_in=Hidden13.d_in, d_out=Hidden13.d_out) for k in range(gas)] for r in range(W)]
    got = {}
    for op in OPS:
        engine = ctx.target.initialize(build(Hidden13, device=ctx.device), config(3, op, zero=zero, **top))
        _, got[op] = train_step(ctx, engine, 0, gas, model_cls=Hidden13)
        want = reference_grads(lambda: build(Hidden13), batches, op)
        assert_close_rel(got[op], want, 1e-6, f"{op} at stage 3, path {path}")
    assert_close_rel(got["sum"], {k: W * v for k, v in got["mean"].items()}, 1e-6, "sum vs W x mean")


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@dstest.spec(world_size=[1, 2, 3], contract="B8")
def test_b8_stage3_sum_over_w_trains_like_mean(ctx: Any, optimizer: str) -> None:
    """Stage 3, 5 steps: a "sum" run whose loss is divided by W matches a "mean" run step by step."""
    require(ctx.target, "stage3")
    W = ctx.world_size
    mean = ctx.target.initialize(build(Hidden13, device=ctx.device), config(3, "mean", optimizer=optimizer, lr=0.05))
    summ = ctx.target.initialize(build(Hidden13, device=ctx.device), config(3, "sum", optimizer=optimizer, lr=0.05))
    for step in range(5):
        loss_m, grads_m = train_step(ctx, mean, step, model_cls=Hidden13)
        loss_s, grads_s = train_step(ctx, summ, step, scale_loss=1.0 / W, model_cls=Hidden13)
        assert abs(loss_m - loss_s) <= 1e-6 * max(abs(loss_m), 1e-12), f"step {step}: loss {loss_s} != {loss_m}"
        assert_close_rel(grads_s, grads_m, 1e-6, f"step {step}: full gradients")
        assert_close_rel(summ.full_parameters(), mean.full_parameters(), 1e-6, f"step {step}: fp32 parameters")
