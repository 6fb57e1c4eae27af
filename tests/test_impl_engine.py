"""impl.Engine: optimizer arithmetic, loss scaling, checkpoints, collective counts, overlap, no global state."""

from __future__ import annotations

import importlib
import pkgutil
import re
import types
from typing import Any

import pytest
import torch

import dstest
import impl
from dstest.conformance import batch, build, config, mse
from impl.engine import CheckpointError
from impl.loss_scaler import LossScaler

pytestmark = pytest.mark.cpu


def test_matches_torch_optim_bit_for_bit() -> None:
    """Single process (torch.distributed not initialised): every stage is torch's AdamW / SGD exactly."""
    for optimizer, params in [
        ("AdamW", {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
        ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
        ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ]:
        for stage in (0, 1, 2):
            cfg = config(stage, optimizer=optimizer)
            cfg["optimizer"]["params"] = params
            engine = impl.initialize(model=build(), config=cfg)
            plain = build()
            cls = torch.optim.AdamW if optimizer == "AdamW" else torch.optim.SGD
            opt = cls(plain.parameters(), foreach=False, **params)  # type: ignore[operator]
            for step in range(3):
                x, y = batch(0, 0, step)
                engine.backward(mse(engine(x), y))
                engine.step()
                opt.zero_grad()
                mse(plain(x), y).backward()
                opt.step()
                got = engine.full_parameters()
                for name, p in plain.named_parameters():
                    assert torch.equal(got[name], p.detach()), (optimizer, stage, step, name)
                    assert torch.equal(dict(engine.module.named_parameters())[name].detach(), p.detach())


def test_loss_scaler_rules() -> None:
    s = LossScaler(16.0, dynamic=True, window=2, hysteresis=2, min_scale=4.0)
    s.update(overflow=True)
    assert s.scale == 16.0  # hysteresis absorbs the first overflow
    s.update(overflow=True)
    assert s.scale == 8.0
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 4.0  # not below min_scale
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 8.0  # a window of good steps doubles it
    state = s.state_dict()
    t = LossScaler(1.0, dynamic=True)
    t.load_state_dict(state)
    assert t.scale == 8.0
    static = LossScaler(2.0, dynamic=False)
    static.update(overflow=True)
    assert static.scale == 2.0


def test_fp16_dynamic_scale_skips_overflow() -> None:
    cfg = config(1, fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    engine = impl.initialize(model=build(), config=cfg)
    assert engine.module.w2.dtype == torch.float16
    for step in range(40):
        x, y = batch(0, 0, step)
        engine.backward(mse(engine(x.half()), y))
        engine.step()
        if engine.get_global_grad_norm() != float("inf"):
            break
    assert engine.skipped_steps >= 1 and engine.loss_scale() < 2.0**40
    assert engine.global_steps == step + 1
    assert engine.stage.step_count == 1  # only the finite step reached the optimizer


def test_gradient_accumulation_steps_only_at_boundary() -> None:
    engine = impl.initialize(model=build(), config=config(2, gradient_accumulation_steps=3))
    before = engine.full_parameters()
    for k in range(2):
        x, y = batch(0, 0, k)
        engine.backward(mse(engine(x), y))
        engine.step()
        assert all(torch.equal(before[n], v) for n, v in engine.full_parameters().items())
    assert engine.is_gradient_accumulation_boundary()
    x, y = batch(0, 0, 2)
    engine.backward(mse(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 3
    assert any(not torch.equal(before[n], v) for n, v in engine.full_parameters().items())


def _resume_body(ctx: Any, stage: int, directory: str) -> None:
    cfg = config(stage, "sum", optimizer="AdamW", fp16={"enabled": True, "initial_scale_power": 4})
    a = impl.initialize(model=build(), config=cfg)
    for step in range(2):
        x, y = batch(ctx.seed, ctx.rank, step)
        a.backward(mse(a(x.half()), y))
        a.step()
    a.save_checkpoint(directory)
    b = impl.initialize(model=build(), config=cfg)
    b.load_checkpoint(directory)
    assert b.global_steps == 2 and b.loss_scale() == a.loss_scale()
    for step in range(2, 4):
        for e in (a, b):
            x, y = batch(ctx.seed, ctx.rank, step)
            e.backward(mse(e(x.half()), y))
            e.step()
    pa, pb = a.full_parameters(), b.full_parameters()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    wrong = impl.initialize(model=build(), config=config(0 if stage else 1))
    with pytest.raises(CheckpointError, match="stage"):
        wrong.load_checkpoint(directory)
    with pytest.raises(CheckpointError, match="impl_checkpoint"):
        wrong.load_state_dict({"something": "else"})


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_resume_is_exact(stage: int, tmp_path: Any) -> None:
    dstest.run(_resume_body, 2, args=(stage, str(tmp_path)))


_COUNTS = {
    # (stage, zero extras) -> collectives of one step at W = 2 (SpecNet: 5 parameters, 83 elements)
    (0, ()): {"all_reduce": 1},
    (0, (("contiguous_gradients", False),)): {"all_reduce": 5},
    (1, ()): {"reduce_scatter": 1, "all_reduce": 2, "all_gather": 1},
    (2, (("reduce_scatter", False),)): {"all_reduce": 3, "all_gather": 1},
    (2, (("reduce_bucket_size", 40),)): {"reduce_scatter": 4, "all_reduce": 2, "all_gather": 1},
    (2, (("compute_grad_norm", False),)): {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1},
}


def _counts_body(ctx: Any) -> list[dict[str, int]]:
    out = []
    for stage, extras in _COUNTS:
        engine = impl.initialize(model=build(), config=config(stage, zero=dict(extras)))
        x, y = batch(ctx.seed, ctx.rank, 0)
        engine.backward(mse(engine(x), y))
        engine.step()
        out.append(engine.collective_counts())
    return out


def test_collective_counts_per_path() -> None:
    """The communication pattern of each path, counted (documents what C6 and A8 build on)."""
    got = dstest.run(_counts_body, 2)[0]
    assert dict(zip(_COUNTS, got, strict=True)) == _COUNTS


def _overlap_body(ctx: Any) -> None:
    engine = impl.initialize(model=build(), config=config(2, zero={"overlap_comm": True, "reduce_bucket_size": 8}))
    stage = engine.stage
    x, y = batch(ctx.seed, ctx.rank, 0)
    stage.prepare_backward(True)
    mse(engine(x), y).backward()
    early = set(stage._reduced)
    assert early, "with overlap_comm, buckets are reduced during backward"
    assert all(stage.params[i].grad is None for b in early for i in stage.buckets[b]), "stage 2 frees grads"
    stage.reduce_gradients()
    assert stage._reduced == set(range(len(stage.buckets)))


def test_overlap_reduces_during_backward() -> None:
    dstest.run(_overlap_body, 2)


def _impl_modules() -> list[types.ModuleType]:
    import impl as pkg

    names = [m.name for m in pkgutil.walk_packages(pkg.__path__, "impl.") if not m.name.startswith("impl.ops")]
    return [importlib.import_module(n) for n in names]


def test_no_module_level_mutable_state() -> None:
    """Ranks may be threads of one process: impl keeps nothing mutable at module level."""
    offenders = []
    for module in _impl_modules():
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            if isinstance(value, (dict, list, set, bytearray)) or type(value).__name__ in ("Counter", "local"):
                offenders.append(f"{module.__name__}.{name}: {type(value).__name__}")
    assert not offenders, offenders


def test_build_stage_names_every_available_stage() -> None:
    """An unknown stage number is a clear error listing the stages this impl has, stage 3 included."""
    import importlib.util

    from impl.config import NotSupportedError
    from impl.zero import build_stage

    allowed = "[0, 1, 2, 3]" if importlib.util.find_spec("impl.zero.stage3") is not None else "[0, 1, 2]"
    with pytest.raises(
        NotSupportedError,
        match=re.escape(f"zero_optimization.stage=7 is not available in this impl; allowed: {allowed}"),
    ):
        build_stage(7, None)  # type: ignore[arg-type]
