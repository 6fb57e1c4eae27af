"""contracts part D through the engine: ZeRO-3 partitioning (D1), training (D7) and memory (D8).

Every spec here drives ``ctx.target`` only and skips a target without stage 3 (or without the accessors it
reads). What the implementation's own pieces do with buffers, launches and the registration check (D1-D6
asked of impl's partitioner and gatherer directly) is impl's business and is tested in
``tests/test_impl_zero3_components.py``; the stage-3 B2 and B8 specs sit with the other B specs in
:mod:`dstest.conformance.grad_reduction`.

Parameter sizes cover 0, 1, W-1, W+1, primes and hidden size 13 (:data:`~dstest.conformance._helpers.SIZE_KINDS`).
"""

from __future__ import annotations

import gc
import math
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.conformance._helpers import SIZE_KINDS, Deep13, Hidden13, assert_close_rel, build, config, micro_step
from dstest.targets import require

__all__ = [
    "test_d1_engine_partitions_to_p",
    "test_d7_stage3_trains_like_stage0",
    "test_d8_state_is_partitioned_between_steps",
]

WORLD_SIZES = [1, 2, 3, 4]


class _AllSizes(torch.nn.Module):
    """One parameter of every size in SIZE_KINDS (for W), used as an additive bias so all get gradients."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.shapes = {k: f(world_size) for k, f in SIZE_KINDS.items()}
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(s)) for s in self.shapes.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum((p.sum() for p in self.ps), torch.zeros(()))


# -- D1 ---------------------------------------------------------------------------------------------


@dstest.spec(world_size=WORLD_SIZES, contract="D1")
def test_d1_engine_partitions_to_p(ctx: Any) -> None:
    """A stage-3 engine over parameters of every awkward size holds ΣP fp32 master elements per rank."""
    require(ctx.target, "stage3", "state_bytes")
    W = ctx.world_size
    model = build(lambda: _AllSizes(W), device=ctx.device)
    numels = [p.numel() for p in model.parameters()]
    engine = ctx.target.initialize(model, config(3, "mean"))
    held = engine.state_bytes()
    want = 4 * sum(math.ceil(n / W) for n in numels)
    assert held["master_params"] == want, (
        f"W={W}: master parameters take {held['master_params']} bytes, expected 4·ΣP = {want} for sizes {numels}"
    )
    full = engine.full_parameters()
    for (name, _), n in zip(model.named_parameters(), numels, strict=True):
        assert full[name].numel() == n, f"{name}: full_parameters() has {full[name].numel()} elements, not {n}"


# -- D7 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@dstest.spec(world_size=[1, 2, 3], contract="D7")
def test_d7_stage3_trains_like_stage0(ctx: Any, optimizer: str) -> None:
    """5 steps, hidden size 13 (no parameter size divisible by W): same losses and fp32 parameters
    (relative 1e-6) at stage 3 as at stage 0."""
    require(ctx.target, "stage0", "stage3")
    engines = {
        s: ctx.target.initialize(build(Hidden13, device=ctx.device), config(s, "mean", optimizer=optimizer, lr=0.05))
        for s in (0, 3)
    }
    for step in range(5):
        losses = {}
        for s, engine in engines.items():
            losses[s] = micro_step(ctx, engine, step, Hidden13)
            engine.step()
        assert abs(losses[3] - losses[0]) <= 1e-6 * abs(losses[0]), f"step {step}: loss {losses[3]} != {losses[0]}"
        assert_close_rel(
            engines[3].full_parameters(), engines[0].full_parameters(), 1e-6, f"step {step}: fp32 parameters"
        )


# -- D8 ---------------------------------------------------------------------------------------------

_STOP_TYPES: tuple[type, ...] = (types.ModuleType, type, dist.ProcessGroup)


def _reachable_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and closures (with ``.grad``),
    stopping at modules, classes and process groups (which lead to other ranks' state)."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _STOP_TYPES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            continue
        if type(obj).__module__.startswith(("dstest.worlds", "torch.distributed")):
            continue
        stack.extend(gc.get_referents(obj))
    return found


def _filled(cell: Any) -> bool:
    """Whether a closure cell holds a value (an unassigned one raises on access)."""
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes per distinct storage (by data pointer) of the strided, non-meta tensors among ``tensors``."""
    out: dict[int, int] = {}
    for t in tensors:
        if t.layout != torch.strided or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        out[s.data_ptr()] = max(out.get(s.data_ptr(), 0), s.nbytes())
    return out


@dstest.spec(world_size=WORLD_SIZES, contract="D8")
def test_d8_state_is_partitioned_between_steps(ctx: Any) -> None:
    """Between steps: no parameter holds data; master params, gradients and AdamW state are ΣP fp32
    elements each; all tensors reachable from the engine add up to that plus communication buffers
    bounded by one layer, not the model. During forward only the running layer is gathered."""
    require(ctx.target, "stage3", "state_bytes", "comm_buffer_bytes")
    W = ctx.world_size
    depth = 6
    model = build(lambda: Deep13(depth), device=ctx.device)
    layers = list(model.layers)  # type: ignore[arg-type]
    numels = [p.numel() for p in model.parameters()]
    layer_numel = 13 * 13 + 13
    share = 4 * sum(math.ceil(n / W) for n in numels)
    full = 4 * sum(numels)
    cfg = config(3, "mean", optimizer="AdamW", zero={"reduce_bucket_size": layer_numel})
    engine = ctx.target.initialize(model, cfg)

    seen_during_forward: list[tuple[int, list[int]]] = []

    def probe(k: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
            seen_during_forward.append((k, sizes))

        return hook

    for k, layer in enumerate(layers):
        # registered after the engine's hooks: runs after the gather, before the release
        layer.register_forward_hook(probe(k), prepend=True)

    for step in range(3):
        seen_during_forward.clear()
        micro_step(ctx, engine, step, Deep13)
        engine.step()
        for k, sizes in seen_during_forward:
            want = [layer_numel if j == k else 0 for j in range(depth)]
            assert sizes == want, f"step {step}, layer {k} running: gathered sizes per layer {sizes}, want {want}"
        for name, p in model.named_parameters():
            assert p.numel() == 0 and p.grad is None, f"step {step}: {name} still holds {p.numel()} elements"
        held = engine.state_bytes()
        for key, want in (("master_params", share), ("gradients", share), ("optimizer_state", 2 * share)):
            assert held[key] == want, f"step {step}: {key} = {held[key]} bytes, expected ΣP·4 = {want}"
        comm = engine.comm_buffer_bytes()
        # One layer's worth: the grouped gather's result (N) with its send row and W-row receive buffer,
        # and one bucket's reduce-scatter staging (W rows in, one row out); a row is ΣP of the layer.
        row = math.ceil(13 * 13 / W) + math.ceil(13 / W)
        bound = 4 * (layer_numel + 2 * (W + 1) * row) if W > 1 else 0
        assert comm <= bound, f"step {step}: comm buffers hold {comm} bytes, more than one layer's {bound}"
        if W > 1:
            assert comm < full, f"comm buffers ({comm} bytes) as large as the whole model ({full})"
        alive = sum(_storage_bytes(_reachable_tensors(engine)).values())
        assert alive <= 4 * share + comm + 4 * 64, (
            f"step {step}: {alive} bytes of tensors alive, partitioned state is {4 * share} + comm {comm}"
        )
