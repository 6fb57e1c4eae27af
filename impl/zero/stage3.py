"""Stage 3: parameters, gradients and optimizer state partitioned over the data-parallel group.

Registration (the constructor), on every rank:

1. each trainable parameter of N elements is cut into W shards of P = ceil(N / W) elements, the tail of
   the last shards zero padding, none at W = 1 (D1, :mod:`impl.zero.partition`); this rank keeps its
   shard of every parameter in one flat tensor of the compute dtype, and an fp32 master copy (the same
   tensor when the compute dtype is fp32), a flat fp32 gradient shard and the optimizer state, all ΣP;
2. one all-gather of every rank's real shard sizes checks them against P for all parameters at once
   (D2, :func:`~impl.zero.partition.check_registration`);
3. each parameter's ``.data`` becomes an empty tensor: between uses no rank holds a full parameter (D8);
   ``param.ds_shape`` and ``param.ds_numel`` (DeepSpeed's names) keep its full size.

Forward: a pre-hook on every module that owns parameters gathers them (:mod:`impl.zero.gather`): one
parameter by one all-gather of uniform count P into a pooled padded buffer, the parameter being
``buffer[:N].view(shape)`` (D3); several in one grouped launch (D6). The post-hook releases them: the
buffers go back to the pool, which re-gathers without allocating (D4).

Backward: while a module runs forward, saved-tensor hooks record each tensor autograd saves that is a
view of a gathered parameter as (parameter, geometry) instead of the tensor. Unpacking during backward
gathers the parameter again (it was released after forward) and rebuilds the view. This is what lets a
released buffer be reused at once: a saved view can never see another parameter's data (``nn.Linear``
saves ``weight.t()``, a view into the buffer). A parameter is released again once its gradient is
accumulated (its post-accumulate-grad hook): every backward node that reads it has run by then.

Gradients: the same hook hands the full gradient to a bucket; a full bucket (``reduce_bucket_size``
elements), or the end of backward, is reduced into the owning shards and the full gradients are freed.
Paths: one reduce-scatter of the bucket (default), one all-reduce (``reduce_scatter: false``), or an
all-reduce of each gradient in place (``contiguous_gradients: false``). ``overlap_comm: false`` holds
every bucket until the end of backward. Mean and sum follow :class:`~impl.zero.base.ReductionSettings`
(B2, B3). Gradients are reduced every micro-step and accumulated into the fp32 shard. At W = 1 nothing
is exchanged and no staging buffer exists (A8).

Limits: every rank must use the same parameters in the same order (the collectives are issued from
autograd hooks); a parameter used outside the forward of the module that owns it (or whose
ParameterList / ParameterDict child holds it) is not gathered, and using it fails on its empty data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from impl.zero.base import StageBase, StageContext, tensor_bytes
from impl.zero.gather import BufferPool, ParamGatherer
from impl.zero.partition import (
    ParamShard,
    RegistrationError,
    check_registration,
    padded_layout,
    partition_parameters,
)

__all__ = ["RegistrationError", "Stage3"]


_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)


@dataclass(frozen=True)
class _SavedView:
    """What autograd keeps instead of a view of a gathered parameter (see the module docstring)."""

    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Stage3(StageBase):
    stage = 3
    partitioned = True

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.compute_dtype = ctx.compute_dtype
        r = ctx.reduction
        self.path = "non_contiguous" if not r.contiguous else ("reduce_scatter" if r.reduce_scatter else "all_reduce")

        # 1-2. partition and check (before any parameter is released, so a failed check leaves the model whole)
        layouts = [padded_layout(p.shape, self.world_size) for p in self.params]
        self.layouts = layouts
        self.flat, self.shards = partition_parameters(
            [(n, p.detach()) for n, p in ctx.named_params],
            self.world_size,
            self.rank,
            layouts=layouts,
            dtype=self.compute_dtype,
        )
        check_registration(self.shards, self.dp_group, comm=ctx.comm)
        self.offsets = [0]
        for lay in layouts:
            self.offsets.append(self.offsets[-1] + lay.shard_size)
        if self.compute_dtype == torch.float32:
            self.master = self.flat
        else:
            self.master = self.flat.float()
        self.grad = torch.zeros_like(self.master)
        self.state = {name: torch.zeros_like(self.master) for name in ctx.optimizer.state_names}

        # 3. release
        self.pool = BufferPool()
        self.gatherer = ParamGatherer(self.shards, self.dp_group, comm=ctx.comm, pool=self.pool)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._empty = [torch.empty(0, dtype=p.dtype, device=p.device) for p in self.params]
        # While autograd accumulates into a released parameter it needs the parameter's shape (not its
        # data): a one-element tensor expanded to that shape stands in for that moment only.
        self._shape_only = [torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape) for p in self.params]
        for i, (p, lay) in enumerate(zip(self.params, layouts, strict=True)):
            # DeepSpeed's names for the full size of a released parameter, for code that needs it
            p.ds_shape = torch.Size(lay.shape)  # type: ignore[attr-defined]
            p.ds_numel = lay.numel  # type: ignore[attr-defined]
            self._set_released(i)

        self._users = [0] * len(self.params)
        self._saved_hooks: list[Any] = []
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._pending_numel = 0
        self._final_queued = False
        self._handles: list[Any] = []
        self._register_hooks()

    # -- hooks ----------------------------------------------------------------------------------------
    def _owned(self, module: torch.nn.Module) -> list[int]:
        """The parameters a module's forward gathers: its own, and those of its ParameterList and
        ParameterDict children (containers that are never called; their parent uses them)."""
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                params.extend(p for q in self._owned_modules(child) for p in q.parameters(recurse=False))
        return list(dict.fromkeys(self._index[id(p)] for p in params if id(p) in self._index))

    @staticmethod
    def _owned_modules(container: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in container.modules() if m is container or isinstance(m, _CONTAINERS)]

    def _register_hooks(self) -> None:
        for module in self.ctx.module.modules():
            if isinstance(module, _CONTAINERS):
                continue
            own = self._owned(module)
            if not own:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(own)))
            self._handles.append(module.register_forward_hook(self._post_forward(own), always_call=True))
        for i, p in enumerate(self.params):
            self._handles.append(p.register_hook(self._grad_arriving(i)))  # type: ignore[no-untyped-call]
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready(i)))  # type: ignore[no-untyped-call]

    def _pre_forward(self, own: list[int]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for i in own:
                self._users[i] += 1
            self.fetch(own)
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            saved.__enter__()
            self._saved_hooks.append(saved)

        return hook

    def _post_forward(self, own: list[int]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._saved_hooks:
                self._saved_hooks.pop().__exit__(None, None, None)
            for i in own:
                self._users[i] -= 1
                if self._users[i] == 0:
                    self._release(i)

        return hook

    def _pack(self, t: torch.Tensor) -> Any:
        where = self.gatherer.locate(t)
        if where is None:
            return t
        i, offset = where
        return _SavedView(i, tuple(t.size()), tuple(t.stride()), offset)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved  # type: ignore[no-any-return]
        full = self.fetch([saved.index])[0]
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    def _grad_arriving(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.gatherer.is_gathered(i):
                self.params[i].data = self._shape_only[i]

        return hook

    def _grad_ready(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if self._users[i] == 0:
                self._release(i)
            if grad is None:
                return
            if not self._final_queued:
                self._final_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._pending.append((i, grad))
            self._pending_numel += grad.numel()
            if self.reduction.overlap and self._pending_numel >= self.reduction.bucket_size:
                self._flush()

        return hook

    def _end_of_backward(self) -> None:
        self._final_queued = False
        self._flush()
        self._release_unused()

    # -- gather and release ---------------------------------------------------------------------------
    def fetch(self, indices: list[int]) -> list[torch.Tensor]:
        """Gather parameters ``indices`` (those not gathered yet in one grouped launch) and point their
        ``.data`` at the gathered views; returns the views."""
        views = self.gatherer.gather_many(indices)
        for i, v in zip(indices, views, strict=True):
            self.params[i].data = v
        return views

    def _set_released(self, i: int) -> None:
        self.params[i].data = self._empty[i]

    def _release(self, i: int) -> None:
        if self.gatherer.is_gathered(i):
            self.gatherer.release(i)
        self._set_released(i)

    def _release_unused(self) -> None:
        for i in self.gatherer.gathered():
            if self._users[i] == 0:
                self._release(i)

    # -- reduction ------------------------------------------------------------------------------------
    def prepare_backward(self, boundary: bool) -> None:
        """Nothing to arm: gradients are reduced from their hooks every micro-step. Forgets a final
        callback that a failed backward never ran."""
        self._final_queued = False

    def reduce_gradients(self) -> None:
        """At the boundary, after backward: anything still pending is reduced (normally nothing: the end
        of backward flushes), and parameters gathered during backward are released."""
        self._flush()
        self._release_unused()

    def _flush(self) -> None:
        """Reduce every pending gradient, in buckets of at most ``reduce_bucket_size`` elements (a larger
        gradient alone), in the order the gradients became ready."""
        pending, self._pending, self._pending_numel = self._pending, [], 0
        bucket: list[tuple[int, torch.Tensor]] = []
        filled = 0
        for item in pending:
            if bucket and filled + item[1].numel() > self.reduction.bucket_size:
                self._reduce_bucket(bucket)
                bucket, filled = [], 0
            bucket.append(item)
            filled += item[1].numel()
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: list[tuple[int, torch.Tensor]]) -> None:
        with torch.no_grad():
            if not self.parallel:  # A8: nothing to exchange, nothing to scale
                for i, g in bucket:
                    self._grad_view(i)[: g.numel()].add_(g.reshape(-1))
            elif self.path == "reduce_scatter":
                self._reduce_scatter(bucket)
            else:
                self._all_reduce(bucket)

    def _grad_view(self, i: int) -> torch.Tensor:
        return self.grad[self.offsets[i] : self.offsets[i + 1]]

    def _comm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.reduction.comm_dtype or dtype

    def _reduce_scatter(self, bucket: list[tuple[int, torch.Tensor]]) -> None:
        """One reduce-scatter: rank q's row of the send buffer holds every gradient's q-th padded shard."""
        dtype = self._comm_dtype(bucket[0][1].dtype)
        sizes = [self.layouts[i].shard_size for i, _ in bucket]
        row = sum(sizes)
        if row == 0:
            return
        send = self.staging.get("scatter_in", self.world_size * row, dtype).view(self.world_size, row)
        col = 0
        for (_, g), p in zip(bucket, sizes, strict=True):
            _pad_into_rows(send[:, col : col + p], g.reshape(-1), p)
            col += p
        if self.pre is not None:
            send.mul_(self.pre)
        recv = self.staging.get("scatter_out", row, dtype)
        self.ctx.comm.reduce_scatter(recv, send.view(-1), self.dp_group)
        if self.post is not None:
            recv.mul_(self.post)
        col = 0
        for (i, _), p in zip(bucket, sizes, strict=True):
            self._grad_view(i).add_(recv[col : col + p])
            col += p

    def _all_reduce(self, bucket: list[tuple[int, torch.Tensor]]) -> None:
        """``reduce_scatter: false``: one all-reduce of the bucket; ``contiguous_gradients: false``: one
        in-place all-reduce per gradient. Each rank then keeps its shard."""
        dtype = self._comm_dtype(bucket[0][1].dtype)
        if self.path == "all_reduce":
            total = sum(g.numel() for _, g in bucket)
            flat = self.staging.get("bucket", total, dtype)
            at = 0
            for _, g in bucket:
                flat[at : at + g.numel()].copy_(g.reshape(-1))
                at += g.numel()
            if self.pre is not None:
                flat.mul_(self.pre)
            self.ctx.comm.all_reduce(flat, self.dp_group)
            reduced, at = [], 0
            for _, g in bucket:
                reduced.append(flat[at : at + g.numel()])
                at += g.numel()
        else:
            reduced = []
            for _, g in bucket:
                work = g if g.dtype == dtype else g.to(dtype)
                if self.pre is not None:
                    work.mul_(self.pre)
                self.ctx.comm.all_reduce(work, self.dp_group)  # written back if not contiguous (A7)
                reduced.append(work.reshape(-1))
        for (i, _), full in zip(bucket, reduced, strict=True):
            lay = self.layouts[i]
            lo, c = lay.offset(self.rank), lay.counts[self.rank]
            mine = full[lo : lo + c]
            if self.post is not None:
                mine = mine * self.post
            self._grad_view(i)[:c].add_(mine)

    def local_gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """This rank's real part of each parameter's reduced gradient (padding excluded)."""
        return [(p, self._grad_view(i)[: self.layouts[i].counts[self.rank]]) for i, p in enumerate(self.params)]

    # -- update ---------------------------------------------------------------------------------------
    def step(self, multiplier: float | None) -> None:
        with torch.no_grad():
            self._release_unused()
            if multiplier is not None:
                self.grad.mul_(multiplier)
            self.step_count += 1
            self.ctx.optimizer.update(self.master, self.grad, self.state, self.step_count)
            self._refresh_shards()

    def _refresh_shards(self) -> None:
        """Copy the fp32 master shard into the compute-dtype shard (a no-op when they are one tensor)."""
        if self.master is not self.flat:
            self.flat.copy_(self.master)

    def skip_step(self) -> None:
        """An overflow step: nothing is updated."""
        self._release_unused()

    def zero_grad(self) -> None:
        self._pending, self._pending_numel = [], 0
        self.grad.zero_()
        for p in self.params:
            p.grad = None

    def detach_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- accessors (collective at W > 1: call on every rank) ------------------------------------------
    def _full(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter in full from every rank's flat shard tensor (``flat``: ΣP elements, fp32)."""
        with torch.no_grad():
            rows = flat.view(1, -1)
            if self.parallel:
                gathered = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
                self.ctx.observer_comm.all_gather_into(gathered, flat, self.dp_group)
                rows = gathered.view(self.world_size, -1)
            out = {}
            for i, (name, lay) in enumerate(zip(self.names, self.layouts, strict=True)):
                block = rows[:, self.offsets[i] : self.offsets[i + 1]]
                out[name] = block.reshape(-1)[: lay.numel].view(lay.shape).clone()
            return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._full(self.master)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._full(self.grad)

    def gathered_parameters(self) -> list[str]:
        """Names of the parameters whose full data exists now (empty between steps: D8)."""
        return [self.names[i] for i in self.gatherer.gathered()]

    def comm_buffer_bytes(self) -> int:
        return self.staging.nbytes() + self.pool.nbytes()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds. ``param_shards``: the compute-dtype shards when they are not the fp32
        master itself; ``gathered_params``: full parameters alive now (0 between steps)."""
        shards = 0 if self.flat is self.master else tensor_bytes([self.flat])
        gathered = sum(
            self.gatherer.view(i).numel() * self.gatherer.view(i).element_size() for i in self.gatherer.gathered()
        )
        return {
            "master_params": tensor_bytes([self.master]),
            "optimizer_state": tensor_bytes(self.state.values()),
            "gradients": tensor_bytes([self.grad, *(p.grad for p in self.params)]),
            "comm_buffers": self.comm_buffer_bytes(),
            "param_shards": shards,
            "gathered_params": gathered,
        }

    def _after_load(self) -> None:
        with torch.no_grad():
            self._refresh_shards()
        self.gatherer.release_all()
        for i in range(len(self.params)):
            self._set_released(i)


def _pad_into_rows(block: torch.Tensor, flat: torch.Tensor, p: int) -> None:
    """Write ``flat`` (N elements) zero-padded to W·P into ``block`` ([W, P], rows possibly strided)."""
    n = flat.numel()
    full, rem = divmod(n, p) if p else (0, 0)
    if full:
        block[:full].copy_(flat[: full * p].view(full, p))
    if rem:
        block[full, :rem].copy_(flat[full * p :])
        block[full, rem:].zero_()
        full += 1
    block[full:].zero_()


def shards_of(stage: Stage3) -> list[ParamShard]:
    """The shards a :class:`Stage3` registered (one per trainable parameter, in ``named_params`` order)."""
    return stage.shards
