"""What every ZeRO stage shares: the stage interface, flat layout, buckets, scaling and staging buffers.

See :mod:`impl.zero` for the interface contract a stage implements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from impl.comm.collectives import Comm
from impl.comm.pg_utils import effective_rank, effective_size, is_parallel
from impl.config import Config
from impl.optim import FlatOptimizer

__all__ = [
    "FlatLayout",
    "FlatStage",
    "ReductionSettings",
    "StageContext",
    "StagingBuffers",
    "make_buckets",
    "tensor_bytes",
]


@dataclass(frozen=True, kw_only=True)
class ReductionSettings:
    """How gradients are reduced over the data-parallel group (B2, B3, B5).

    ``op`` "mean" delivers (1/W)·Σ g_r, "sum" delivers Σ g_r. ``predivide`` f only moves the numerical range:
    gradients are multiplied by 1/f before the reduction and by f/W (mean) or f (sum) after it. ``prescale``
    (mean only) divides by W before the reduction instead.
    """

    op: str
    predivide: float = 1.0
    prescale: bool = False
    comm_dtype: torch.dtype | None = None
    bucket_size: int = 500_000_000
    overlap: bool = False
    contiguous: bool = True
    reduce_scatter: bool = True
    sparse: bool = False

    def factors(self, world_size: int) -> tuple[float | None, float | None]:
        """(pre, post) multipliers around a SUM reduction over ``world_size`` ranks; None means "do not multiply".

        At W = 1 nothing is reduced and nothing is multiplied (A8: results equal the W = 1 reference).
        """
        if world_size == 1:
            return None, None
        if self.prescale:
            return 1.0 / world_size, None
        pre = None if self.predivide == 1.0 else 1.0 / self.predivide
        post = self.predivide / world_size if self.op == "mean" else self.predivide
        return pre, (None if post == 1.0 else post)


@dataclass(kw_only=True)
class StageContext:
    """Everything a stage is built from; the engine creates it after casting and broadcasting the model."""

    module: torch.nn.Module
    named_params: list[tuple[str, torch.nn.Parameter]]
    dp_group: Any
    mp_group: Any
    config: Config
    reduction: ReductionSettings
    optimizer: FlatOptimizer
    compute_dtype: torch.dtype
    comm: Comm
    """Counted collectives (training work: C6, A8)."""
    observer_comm: Comm
    """Uncounted collectives (accessors, checkpoints)."""


def tensor_bytes(tensors: Any) -> int:
    """Bytes held by the storages of ``tensors``, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            total += tensor_bytes([t._indices(), t._values()])
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen and storage.nbytes() > 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class FlatLayout:
    """Parameters laid end to end in one flat index space of N elements, cut into W partitions of P.

    P = ceil(N / W); rank r owns flat elements [r·P, (r+1)·P); the tail of the last partition beyond N is
    zero padding. At W = 1 there is no padding (P = N).
    """

    def __init__(self, numels: list[int], world_size: int) -> None:
        self.numels = numels
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.world_size = world_size
        self.partition_numel = math.ceil(self.numel / world_size) if self.numel else 0
        self.padded_numel = self.partition_numel * world_size

    def partition_range(self, rank: int) -> tuple[int, int]:
        """The flat range of rank ``rank``'s partition that holds real elements (may be empty)."""
        lo = min(rank * self.partition_numel, self.numel)
        return lo, min(lo + self.partition_numel, self.numel)

    def intersect(self, lo: int, hi: int, rank: int) -> tuple[int, int]:
        """The part of flat range [lo, hi) that rank ``rank`` owns, as a flat range (empty: lo == hi)."""
        plo, phi = self.partition_range(rank)
        a, b = max(lo, plo), min(hi, phi)
        return (a, b) if a < b else (a, a)

    def fragments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(param index, start in param, length, start in partition) for each param piece rank owns."""
        plo, phi = self.partition_range(rank)
        out = []
        for i, n in enumerate(self.numels):
            a, b = max(self.offsets[i], plo), min(self.offsets[i] + n, phi)
            if a < b:
                out.append((i, a - self.offsets[i], b - a, a - plo))
        return out


def make_buckets(numels: list[int], bucket_size: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_size`` elements, last parameter first
    (gradients become ready roughly in reverse order). A parameter larger than the bucket gets its own.
    Each bucket is a consecutive run of indices, listed in ascending order."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(numels))):
        if current and filled + numels[i] > bucket_size:
            buckets.append(sorted(current))
            current, filled = [], 0
        current.append(i)
        filled += numels[i]
    if current:
        buckets.append(sorted(current))
    return buckets


class StagingBuffers:
    """Reusable flat communication buffers, allocated on first use (never at W = 1: A8)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.allocations = 0

    def get(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (role, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[key] = buf
            self.allocations += 1
        return buf[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class StageBase:
    """What every ZeRO stage (0-3) shares: its view of the data-parallel group and the checkpoint format.

    Each stage keeps a flat fp32 ``master`` (its partition, or all of it at stage 0), an optimizer
    ``state`` of flat tensors beside it and a ``step_count``; ``_after_load`` brings the model's
    parameters in line with the loaded master values.
    """

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.names = [n for n, _ in ctx.named_params]
        self.params = [p for _, p in ctx.named_params]
        self.dp_group = ctx.dp_group
        self.parallel = is_parallel(ctx.dp_group)
        self.world_size = effective_size(ctx.dp_group)
        self.rank = effective_rank(ctx.dp_group)
        self.reduction = ctx.reduction
        self.pre, self.post = ctx.reduction.factors(self.world_size)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.staging = StagingBuffers(self.device)
        self.step_count = 0

    master: torch.Tensor
    state: dict[str, torch.Tensor]
    step_count: int

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": self.master.clone(),
            "state": {k: v.clone() for k, v in self.state.items()},
            "step_count": self.step_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_shape("master", state["master"], self.master)
        with torch.no_grad():
            self.master.copy_(state["master"])
            for k, v in self.state.items():
                check_shape(k, state["state"][k], v)
                v.copy_(state["state"][k])
        self.step_count = int(state["step_count"])
        self._after_load()

    def _after_load(self) -> None:
        raise NotImplementedError


class FlatStage(StageBase):
    """Base of stages 0-2, whose parameters stay whole on every rank: one :class:`FlatLayout` of all
    parameters, its gradient buckets and the overlap hooks; subclasses reduce and step. (Stage 3
    partitions the parameters themselves and derives from :class:`StageBase` directly.)

    Subclasses implement ``_reduce_bucket``, ``local_gradients``, ``step``, ``zero_grad``,
    ``full_parameters``, ``full_gradients``, ``state_bytes``, ``state_dict``, ``load_state_dict``.
    """

    stage: ClassVar[int]
    partitioned: ClassVar[bool]

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        numels = [p.numel() for p in self.params]
        self.layout = FlatLayout(numels, self.world_size)
        self.buckets = make_buckets(numels, ctx.reduction.bucket_size)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._armed = False
        self._pending: list[int] = []
        self._reduced: set[int] = set()
        self._hooks: list[Any] = []
        if ctx.reduction.overlap and self.parallel:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
                for i, p in enumerate(self.params)
            ]

    # -- reduction driver ---------------------------------------------------------------------------
    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if not self._armed:
                return
            b = self._bucket_of[index]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._reduce_and_mark(b)

        return on_grad_ready

    def prepare_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()``; at the accumulation boundary with overlap_comm, arms the hooks
        that reduce a bucket as soon as all its gradients are accumulated."""
        self._reduced = set()
        self._armed = boundary and bool(self._hooks)
        self._pending = [len(b) for b in self.buckets]

    def reduce_gradients(self) -> None:
        """Called after ``loss.backward()`` at the boundary: reduce every bucket the hooks have not."""
        self._armed = False
        for b in range(len(self.buckets)):
            if b not in self._reduced:
                self._reduce_and_mark(b)

    def _reduce_and_mark(self, b: int) -> None:
        with torch.no_grad():
            for i in self.buckets[b]:
                p = self.params[i]
                if p.grad is None:  # unused on this step: reduced as zeros so every rank issues the same calls
                    p.grad = torch.zeros_like(p)
            self._reduce_bucket(self.buckets[b])
        self._reduced.add(b)

    def _reduce_bucket(self, bucket: list[int]) -> None:
        raise NotImplementedError

    def _comm_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.reduction.comm_dtype or grad_dtype

    def _pack(self, bucket: list[int], grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Copy a bucket's gradients into the flat staging buffer (flat order), pre-scaled."""
        lo = self.layout.offsets[bucket[0]]
        flat = self.staging.get("bucket", self.layout.offsets[bucket[-1] + 1] - lo, dtype)
        for i, g in zip(bucket, grads, strict=True):
            o = self.layout.offsets[i] - lo
            flat[o : o + g.numel()].view_as(g).copy_(g)
        if self.pre is not None:
            flat.mul_(self.pre)
        return flat

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the rest of the interface ----------------------------------------------------------------
    def local_gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        raise NotImplementedError

    def step(self, multiplier: float | None) -> None:
        raise NotImplementedError

    def skip_step(self) -> None:
        """An overflow step: nothing is updated."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def full_parameters(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def full_gradients(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        raise NotImplementedError

    def comm_buffer_bytes(self) -> int:
        return self.staging.nbytes()


def check_shape(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """A checkpoint tensor must have the shape this engine's stage needs (a clear error otherwise)."""
    if got.shape != want.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(got.shape)}, this engine needs {tuple(want.shape)} "
            "(same model, stage and data-parallel size required)"
        )
