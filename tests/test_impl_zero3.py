"""impl's stage 3 beyond the conformance specs and the component checks (those, with the mutants they
catch, are in ``test_impl_zero3_components.py``): the D2 message, engine-level counts (D2, D4, D6), why
saved views are recorded by identity, mixed precision, overflow, checkpoints, shared parameters, and the
pool and partition helpers on their own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import dstest
from dstest.conformance import Deep13, Hidden13, assert_close_rel, batch, build, config, micro_step, mse
from impl.zero.gather import BufferPool
from impl.zero.partition import (
    RegistrationError,
    balanced_counts,
    padded_layout,
    padded_shard_size,
    partition,
    uneven_layout,
)

pytestmark = pytest.mark.cpu


def _engine(ctx: Any, stage: int, cls: type = Hidden13, **cfg: Any) -> Any:
    import impl

    model = build(cls, device=ctx.device)
    return impl.initialize(model=model, config=config(stage, cfg.pop("op", "mean"), **cfg))


def _step(ctx: Any, engine: Any, step: int, cls: type = Hidden13) -> float:
    loss = micro_step(ctx, engine, step, cls)
    engine.step()
    return loss


# -- the registration error ------------------------------------------------------------------------------


def test_d2_error_message_names_parameter_rank_and_sizes() -> None:
    def body(ctx: Any) -> str:
        from impl.zero.partition import check_registration, partition_parameters

        _, shards = partition_parameters([("layer.weight", torch.ones(13, 7))], ctx.world_size, ctx.rank)
        if ctx.rank == 1:
            shards[0].tensor = torch.zeros(30)
        with pytest.raises(RegistrationError) as err:
            check_registration(shards, torch.distributed.group.WORLD)
        return str(err.value)

    messages = dstest.run(body, 3)
    assert len(set(messages)) == 1, "every rank must raise the same error"
    assert messages[0] == (
        "stage-3 registration check failed: parameter 'layer.weight': rank 1 holds a local shard of 30 "
        "elements, expected P = ceil(91 / 3) = 31"
    )


# -- engine-level counts ---------------------------------------------------------------------------------


def test_engine_registration_is_one_all_gather() -> None:
    def body(ctx: Any) -> dict[str, int]:
        engine = _engine(ctx, 3)
        return dict(engine.comm_stats.total)

    counts = dstest.run(body, 3)[0]
    n_params = 8  # Hidden13: three Linear layers and a LayerNorm
    assert counts == {"broadcast": n_params, "all_gather": 1}, counts


def test_engine_regathers_allocate_nothing_after_the_first_step() -> None:
    """D4 at engine level: the first step fills the pool, steps 2-5 allocate nothing; D6: each module's
    parameters are gathered in one launch per forward."""

    def body(ctx: Any) -> tuple[list[int], int, int]:
        engine = _engine(ctx, 3)
        stage = engine.stage
        allocations = []
        for step in range(5):
            _step(ctx, engine, step)
            allocations.append(stage.pool.allocations)
        before = stage.gatherer.launches
        with torch.no_grad():
            engine(torch.zeros(2, 5))
        return allocations, stage.gatherer.launches - before, stage.gatherer.compactions

    for allocations, forward_launches, _ in dstest.run(body, 3):
        assert allocations[0] > 0 and len(set(allocations)) == 1, f"pool allocations per step: {allocations}"
        assert forward_launches == 4, f"4 modules own parameters: {forward_launches} gather launches in forward"


def test_parameters_are_views_of_pool_buffers_during_forward() -> None:
    def body(ctx: Any) -> None:
        engine = _engine(ctx, 3)
        stage = engine.stage
        model = engine.module
        seen = []

        def probe(module: torch.nn.Module, args: Any, out: Any) -> None:
            for p in module.parameters():
                i = stage._index[id(p)]
                buf = stage.gatherer.buffer(i)
                seen.append(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())

        model.mid.register_forward_hook(probe, prepend=True)
        engine(torch.zeros(2, 5))
        assert seen == [True, True], seen
        assert all(p.numel() == 0 for p in model.parameters())

    dstest.run(body, 2)


def test_saved_views_are_recorded_by_identity_not_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.Linear saves ``weight.t()``, a view into the gather buffer, which the next layer's gather reuses.
    With the saved-tensor hooks stage 3 equals stage 0 exactly; without them the gradients are wrong."""

    def body(ctx: Any) -> tuple[int, bool]:
        ref, s3 = _engine(ctx, 0, Deep13), _engine(ctx, 3, Deep13)
        for engine in (ref, s3):
            micro_step(ctx, engine, 0, Deep13)
        grads_ref, grads_s3 = ref.full_gradients(), s3.full_gradients()
        same = all(torch.equal(grads_ref[k], grads_s3[k]) for k in grads_ref)
        return s3.stage.pool.allocations, same

    for allocations, same in dstest.run(body, 2):
        assert same, "stage 3 gradients differ from stage 0"
        assert allocations < 6, f"the six layers must share pooled buffers ({allocations} allocated)"

    from impl.zero.stage3 import Stage3

    monkeypatch.setattr(Stage3, "_pack", lambda self, t: t)
    assert not any(same for _, same in dstest.run(body, 2)), "without the hooks the reuse must corrupt gradients"


# -- training paths --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_stage3_trains_like_stage0(dtype: str) -> None:
    top = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 4}}}[dtype]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def body(ctx: Any) -> None:
        import impl

        engines = {}
        for s in (0, 3):
            model = build(Hidden13, device=ctx.device)
            engines[s] = impl.initialize(model=model, config=config(s, "mean", optimizer="AdamW", lr=0.01, **top))
        assert engines[3].state_bytes()["param_shards"] > 0, "half-precision shards beside the fp32 master"
        for step in range(3):
            for engine in engines.values():
                x, y = batch(ctx.seed, ctx.rank, step, d_in=5, d_out=5)
                engine.backward(mse(engine(x.to(torch_dtype)), y))
                engine.step()
            assert_close_rel(engines[3].full_parameters(), engines[0].full_parameters(), 1e-6, f"step {step}")

    dstest.run(body, 3)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    def body(ctx: Any) -> None:
        import impl

        model = build(Hidden13, device=ctx.device)
        fp16 = {"fp16": {"enabled": True, "initial_scale_power": 4}}
        engine = impl.initialize(model=model, config=config(3, "mean", **fp16))
        before = engine.full_parameters()
        x, y = batch(ctx.seed, ctx.rank, 0, d_in=5, d_out=5)
        if ctx.rank == 1:
            x[0, 0] = float("inf")
        engine.backward(mse(engine(x.half()), y))
        engine.step()
        assert engine.skipped_steps == 1 and engine.get_global_grad_norm() == math.inf
        after = engine.full_parameters()
        assert all(torch.equal(before[k], after[k]) for k in before), "an overflow step changed parameters"
        assert engine.stage.gathered_parameters() == []

    dstest.run(body, 3)


def test_checkpoint_roundtrip(tmp_path: Path) -> None:
    def body(ctx: Any, root: str) -> None:
        straight = _engine(ctx, 3, optimizer="AdamW")
        saved = _engine(ctx, 3, optimizer="AdamW")
        for step in range(2):
            _step(ctx, straight, step)
            _step(ctx, saved, step)
        saved.save_checkpoint(root)
        resumed = _engine(ctx, 3, optimizer="AdamW")
        resumed.load_checkpoint(root)
        for step in range(2, 4):
            loss_a = _step(ctx, straight, step)
            loss_b = _step(ctx, resumed, step)
            assert loss_a == loss_b, f"step {step}: {loss_a} != {loss_b}"
        a, b = straight.full_parameters(), resumed.full_parameters()
        assert all(torch.equal(a[k], b[k]) for k in a)

    dstest.run(body, 2, kwargs={"root": str(tmp_path)})


class _Shared(torch.nn.Module):
    """One layer called twice, and a weight tied between two layers."""

    d_in, d_out = 13, 13

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(13, 13)
        self.b = torch.nn.Linear(13, 13)
        self.b.weight = self.a.weight
        self.unused = torch.nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.a(h))
        out: torch.Tensor = self.b(h)
        return out


def test_shared_and_tied_parameters_and_unused_ones() -> None:
    def body(ctx: Any) -> None:
        ref, s3 = _engine(ctx, 0, _Shared), _engine(ctx, 3, _Shared)
        for step in range(3):
            for engine in (ref, s3):
                micro_step(ctx, engine, step, _Shared)
            g0, g3 = ref.full_gradients(), s3.full_gradients()
            assert set(g3) == {"a.weight", "a.bias", "b.bias", "unused"}
            assert_close_rel(g3, g0, 1e-6, f"step {step}: gradients")
            assert torch.count_nonzero(g3["unused"]) == 0
            for engine in (ref, s3):
                engine.step()
            assert_close_rel(s3.full_parameters(), ref.full_parameters(), 1e-6, f"step {step}: parameters")

    dstest.run(body, 3)


def test_eval_forward_gathers_and_releases() -> None:
    def body(ctx: Any) -> None:
        ref, s3 = _engine(ctx, 0), _engine(ctx, 3)
        x = torch.ones(3, 5)
        with torch.no_grad():
            assert torch.equal(ref(x), s3(x))
        assert s3.stage.gathered_parameters() == [] and s3.stage.pool.in_use() == 0

    dstest.run(body, 2)


class _Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        if self.fail:
            raise RuntimeError("boom")
        return out


def test_a_failing_forward_leaves_nothing_gathered() -> None:
    def body(ctx: Any) -> None:
        import impl

        model = _Raises()
        engine = impl.initialize(model=model, config=config(3, "mean"))
        with pytest.raises(RuntimeError, match="boom"):
            engine(torch.ones(2, 5))
        assert engine.stage.gathered_parameters() == [] and engine.stage._saved_hooks == []
        assert [tuple(p.ds_shape) for p in model.parameters()] == [(5, 5), (5,)]
        assert [p.ds_numel for p in model.parameters()] == [25, 5]
        model.fail = False
        engine.backward(engine(torch.ones(2, 5)).sum())
        engine.step()
        assert engine.stage.gathered_parameters() == []

    dstest.run(body, 2)


def test_a8_single_rank_issues_nothing_and_holds_no_buffers() -> None:
    def body(ctx: Any) -> None:
        engine = _engine(ctx, 3)
        for step in range(2):
            _step(ctx, engine, step)
        assert engine.collective_counts() == {} and sum(engine.comm_stats.total.values()) == 0
        assert engine.comm_buffer_bytes() == 0

    dstest.run(body, 1)


# -- helpers on their own ------------------------------------------------------------------------------


def test_pool_best_fit_and_bounded_count() -> None:
    pool = BufferPool()
    a = pool.acquire(10, torch.float32, "cpu")
    pool.release(a)
    b = pool.acquire(4, torch.float32, "cpu")  # reuses the 10-element buffer
    assert pool.allocations == 1 and b.numel() == 4 and pool.buffer_of(b).numel() == 10
    c = pool.acquire(20, torch.float32, "cpu")  # nothing free: a second buffer
    pool.release(b)
    pool.release(c)
    d = pool.acquire(30, torch.float32, "cpu")  # too big for both: replaces the 20, count stays 2
    assert pool.allocations == 3 and pool.in_use() == 1 and pool.free_buffers() == 1
    pool.release(d)
    assert pool.nbytes() == 4 * (10 + 30)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(d)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.zeros(3))
    h = pool.acquire(10, torch.float16, "cpu")
    assert h.dtype == torch.float16 and pool.allocations == 4, "dtype is part of the key"
    pool.release(h)
    pool.clear()
    assert pool.nbytes() == 0


def test_pool_stops_allocating_on_a_repeating_sequence() -> None:
    pool = BufferPool()
    sizes = [7, 30, 3, 30, 11, 2, 40]
    counts = []
    for _ in range(4):
        held = []
        for k, n in enumerate(sizes):
            held.append(pool.acquire(n, torch.float32, "cpu"))
            if k % 2:  # pairs are in use together
                pool.release(held.pop(0))
                pool.release(held.pop(0))
        for h in held:
            pool.release(h)
        counts.append(pool.allocations)
    assert counts[-1] == counts[-2], f"allocations per round: {counts}"
    assert pool.free_buffers() <= 2, "never more buffers than were in use at once"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 13, 97, 169])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 7])
def test_padded_layout_formula(n: int, w: int) -> None:
    lay = padded_layout((n,), w)
    p = padded_shard_size(n, w)
    assert p == -(-n // w) and lay.shard_size == p
    assert sum(lay.counts) == n and all(0 <= c <= p for c in lay.counts)
    assert lay.padded_numel - n < w or n == 0
    if w == 1:
        assert lay.counts == (n,) and p == n
    full = torch.arange(n, dtype=torch.float32) + 1
    shards = [partition("p", full, lay, r).tensor for r in range(w)]
    assert all(s.numel() == p for s in shards)
    assert torch.equal(torch.cat(shards)[:n], full) and torch.count_nonzero(torch.cat(shards)[n:]) == 0


def test_uneven_layout_and_errors() -> None:
    assert balanced_counts(13, 4) == (4, 3, 3, 3)
    lay = uneven_layout((2, 3), [0, 4, 2])
    assert lay.shard_size == 4 and [lay.stored(r) for r in range(3)] == [0, 4, 2] and lay.offset(2) == 4
    with pytest.raises(ValueError, match="sum to 5"):
        uneven_layout((2, 3), [1, 4])
    with pytest.raises(ValueError, match=">= 0"):
        uneven_layout((0,), [1, -1])
    with pytest.raises(ValueError, match="does not match its layout"):
        partition("w", torch.ones(3), padded_layout((4,), 2), 0)
