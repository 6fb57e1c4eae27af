"""Stages 1 and 2: fp32 master parameters and optimizer state partitioned over the data-parallel group;
stage 2 also partitions gradients (each rank keeps only its partition of the reduced gradient).

All parameters are laid end to end in one flat index space (:class:`~impl.zero.base.FlatLayout`); rank r
owns elements [r·P, (r+1)·P). After backward, each bucket's gradients are reduced and the caller's share
lands in ``grad_partition`` (fp32, P elements), by one of three paths chosen by configuration:

``reduce_scatter`` (default; ``zero_optimization.reduce_scatter``)
    one reduce-scatter per bucket. A bucket covers a flat range [a, b) that cuts each rank's partition
    unevenly, so each rank's piece is copied into a row of a [W, m] staging buffer (m the largest piece,
    zero-padded) and reduce-scattered with the uniform count m.
``all_reduce`` (``reduce_scatter: false``)
    one all-reduce per bucket of the flat staging buffer; each rank copies out its share.
``non_contiguous`` (``contiguous_gradients: false``)
    no staging buffer: each gradient is all-reduced in place (A7) and each rank copies out its share.

Stage 2 frees a parameter's full gradient as soon as its bucket is reduced; stage 1 keeps it until
``zero_grad``. The step updates the caller's master partition, then one all-gather rebuilds the full
parameters in the compute dtype. At W = 1 nothing is exchanged and no staging buffer exists (A8).
"""

from __future__ import annotations

from typing import Any

import torch

from impl.zero.base import FlatStage, StageContext, tensor_bytes

__all__ = ["Stage12"]


class Stage12(FlatStage):
    partitioned = True

    def __init__(self, ctx: StageContext, stage: int) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}: Stage12 implements stages [1, 2]")
        self.stage = stage  # type: ignore[misc]
        super().__init__(ctx)
        r = ctx.reduction
        self.path = "non_contiguous" if not r.contiguous else ("reduce_scatter" if r.reduce_scatter else "all_reduce")
        P = self.layout.partition_numel
        self.partition_lo = self.rank * P
        self.fragments = self.layout.fragments(self.rank)
        with torch.no_grad():
            self.master = torch.zeros(P, dtype=torch.float32, device=self.device)
            for i, plo, n, o in self.fragments:
                self.master[o : o + n].copy_(self.params[i].detach().reshape(-1)[plo : plo + n])
        self.grad_partition = torch.zeros(P, dtype=torch.float32, device=self.device)
        self.state = {
            name: torch.zeros(P, dtype=torch.float32, device=self.device) for name in ctx.optimizer.state_names
        }

    # -- reduction ----------------------------------------------------------------------------------
    def _own(self, i: int) -> tuple[int, int, int] | None:
        """(start in param, length, start in partition) of param i's piece this rank owns, if any."""
        lo, hi = self.layout.intersect(self.layout.offsets[i], self.layout.offsets[i + 1], self.rank)
        if lo == hi:
            return None
        return lo - self.layout.offsets[i], hi - lo, lo - self.partition_lo

    def _take_share(self, i: int, flat_grad: torch.Tensor) -> None:
        """Copy param i's owned piece of its (reduced) flat gradient into grad_partition, post-scaled."""
        own = self._own(i)
        if own is None:
            return
        plo, n, o = own
        dst = self.grad_partition[o : o + n]
        dst.copy_(flat_grad[plo : plo + n])
        if self.post is not None:
            dst.mul_(self.post)

    def _reduce_bucket(self, bucket: list[int]) -> None:
        grads = []
        for i in bucket:
            g = self.params[i].grad
            assert g is not None
            grads.append(g.to_dense() if g.is_sparse else g)
        if not self.parallel:  # A8: the rank owns everything; no exchange, no scaling, no staging buffer
            for i, g in zip(bucket, grads, strict=True):
                self._take_share(i, g.reshape(-1))
        elif self.path == "non_contiguous":
            for i, g in zip(bucket, grads, strict=True):
                work = g.to(self._comm_dtype(g.dtype))
                if self.pre is not None:
                    work.mul_(self.pre)
                self.ctx.comm.all_reduce(work, self.dp_group)  # writes back into a non-contiguous tensor (A7)
                self._take_share(i, work.reshape(-1))
        elif self.path == "all_reduce":
            flat = self._pack(bucket, grads, self._comm_dtype(grads[0].dtype))
            self.ctx.comm.all_reduce(flat, self.dp_group)
            a = self.layout.offsets[bucket[0]]
            for i in bucket:
                o = self.layout.offsets[i] - a
                self._take_share(i, flat[o : o + self.params[i].numel()])
        else:
            self._reduce_scatter_bucket(bucket, grads)
        if self.stage == 2:
            for i in bucket:
                self.params[i].grad = None

    def _reduce_scatter_bucket(self, bucket: list[int], grads: list[torch.Tensor]) -> None:
        dtype = self._comm_dtype(grads[0].dtype)
        flat = self._pack(bucket, grads, dtype)
        a = self.layout.offsets[bucket[0]]
        b = self.layout.offsets[bucket[-1] + 1]
        pieces = [self.layout.intersect(a, b, q) for q in range(self.world_size)]
        m = max(hi - lo for lo, hi in pieces)
        if m == 0:  # a bucket of empty parameters
            return
        send = self.staging.get("scatter_in", self.world_size * m, dtype)
        send.zero_()
        for q, (lo, hi) in enumerate(pieces):
            send[q * m : q * m + (hi - lo)].copy_(flat[lo - a : hi - a])
        recv = self.staging.get("scatter_out", m, dtype)
        self.ctx.comm.reduce_scatter(recv, send, self.dp_group)
        lo, hi = pieces[self.rank]
        if hi > lo:
            dst = self.grad_partition[lo - self.partition_lo : hi - self.partition_lo]
            dst.copy_(recv[: hi - lo])
            if self.post is not None:
                dst.mul_(self.post)

    def local_gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(self.params[i], self.grad_partition[o : o + n]) for i, _, n, o in self.fragments]

    # -- update -------------------------------------------------------------------------------------
    def step(self, multiplier: float | None) -> None:
        with torch.no_grad():
            if multiplier is not None:
                self.grad_partition.mul_(multiplier)
            self.step_count += 1
            self.ctx.optimizer.update(self.master, self.grad_partition, self.state, self.step_count)
            self._write_back(self.ctx.comm)

    def _gather(self, partition: torch.Tensor, dtype: torch.dtype, comm: Any, role: str) -> torch.Tensor:
        """The full flat tensor (padded to W·P) from every rank's partition."""
        if not self.parallel:
            return partition if partition.dtype == dtype else partition.to(dtype)
        full = self.staging.get(role, self.layout.padded_numel, dtype)
        comm.all_gather_into(full, partition.to(dtype), self.dp_group)
        return full

    def _write_back(self, comm: Any) -> None:
        with torch.no_grad():
            full = self._gather(self.master, self.ctx.compute_dtype, comm, "gather")
            for i, p in enumerate(self.params):
                o = self.layout.offsets[i]
                p.copy_(full[o : o + p.numel()].view(p.shape))

    # -- accessors (collective at W > 1: call on every rank) ----------------------------------------
    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for i, (n, p) in enumerate(zip(self.names, self.params, strict=True)):
            o = self.layout.offsets[i]
            out[n] = flat[o : o + p.numel()].view(p.shape).clone()
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            flat = self.master if not self.parallel else torch.empty(self.layout.padded_numel, device=self.device)
            if self.parallel:
                self.ctx.observer_comm.all_gather_into(flat, self.master, self.dp_group)
            return self._unflatten(flat)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            flat = self.grad_partition
            if self.parallel:
                flat = torch.empty(self.layout.padded_numel, device=self.device)
                self.ctx.observer_comm.all_gather_into(flat, self.grad_partition, self.dp_group)
            return self._unflatten(flat)

    def state_bytes(self) -> dict[str, int]:
        return {
            "master_params": tensor_bytes([self.master]),
            "optimizer_state": tensor_bytes(self.state.values()),
            "gradients": tensor_bytes([self.grad_partition, *(p.grad for p in self.params)]),
            "comm_buffers": self.staging.nbytes(),
        }

    def _after_load(self) -> None:
        self._write_back(self.ctx.observer_comm)
