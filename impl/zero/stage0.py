"""Stage 0: plain data parallelism. Every rank holds full gradients, fp32 master parameters and state.

Reduction paths (B2): bucketed all-reduce of a contiguous staging buffer (``contiguous_gradients``, the
default), or the non-contiguous fallback that all-reduces each gradient in place (A7 writes the result
back into a non-contiguous gradient). Sparse gradients (B4) are all-gathered as (indices, values) when
``sparse_gradients`` is on, and reduced densely otherwise.
"""

from __future__ import annotations

import torch

from impl.zero.base import FlatStage, StageContext, tensor_bytes

__all__ = ["Stage0"]


class Stage0(FlatStage):
    stage = 0
    partitioned = False

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        with torch.no_grad():
            self.master = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
            for i, p in enumerate(self.params):
                self._master_view(i).copy_(p)
        self.state = {
            name: torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
            for name in ctx.optimizer.state_names
        }

    def _master_view(self, i: int) -> torch.Tensor:
        o = self.layout.offsets[i]
        return self.master[o : o + self.params[i].numel()].view(self.params[i].shape)

    # -- reduction ----------------------------------------------------------------------------------
    def _reduce_bucket(self, bucket: list[int]) -> None:
        if not self.parallel:  # A8: nothing to exchange, nothing to scale
            return
        comm, group = self.ctx.comm, self.dp_group
        dense: list[torch.Tensor] = []
        for i in bucket:
            p = self.params[i]
            assert p.grad is not None
            if p.grad.is_sparse:
                if self.reduction.sparse:
                    p.grad = self._reduce_sparse(p.grad)
                    continue
                p.grad = p.grad.to_dense()
            dense.append(p.grad)
        if not dense:
            return
        if not self.reduction.contiguous:
            for g in dense:  # non-contiguous fallback: one all-reduce per gradient, written back in place
                work = g if self._comm_dtype(g.dtype) == g.dtype else g.to(self._comm_dtype(g.dtype))
                if self.pre is not None:
                    work.mul_(self.pre)
                comm.all_reduce(work, group)
                if work is not g:
                    g.copy_(work)
                if self.post is not None:
                    g.mul_(self.post)
            return
        dtype = self._comm_dtype(dense[0].dtype)
        flat = self.staging.get("bucket", sum(g.numel() for g in dense), dtype)
        o = 0
        for g in dense:
            flat[o : o + g.numel()].view_as(g).copy_(g)
            o += g.numel()
        if self.pre is not None:
            flat.mul_(self.pre)
        comm.all_reduce(flat, group)
        o = 0
        for g in dense:
            g.copy_(flat[o : o + g.numel()].view_as(g))
            if self.post is not None:
                g.mul_(self.post)
            o += g.numel()

    def _reduce_sparse(self, grad: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's (indices, values) and sum them: 3 collectives (sizes, indices, values)."""
        comm, group = self.ctx.comm, self.dp_group
        g = grad.coalesce()
        indices, values = g.indices(), g.values().to(self._comm_dtype(g.dtype))
        if self.pre is not None:
            values = values * self.pre
        count = torch.tensor([values.shape[0]], dtype=torch.int64, device=values.device)
        counts = [int(c.item()) for c in comm.all_gather(count, group)]
        width = max(counts)
        pad_idx = indices.new_zeros((indices.shape[0], width))
        pad_idx[:, : indices.shape[1]] = indices
        pad_val = values.new_zeros((width, *values.shape[1:]))
        pad_val[: values.shape[0]] = values
        all_idx = comm.all_gather(pad_idx, group)
        all_val = comm.all_gather(pad_val, group)
        merged = torch.sparse_coo_tensor(
            torch.cat([t[:, :c] for t, c in zip(all_idx, counts, strict=True)], dim=1),
            torch.cat([t[:c] for t, c in zip(all_val, counts, strict=True)]).to(grad.dtype),
            grad.shape,
            check_invariants=True,
        ).coalesce()
        if self.post is not None:
            merged = torch.sparse_coo_tensor(
                merged.indices(), merged.values() * self.post, grad.shape, check_invariants=True
            ).coalesce()
        return merged

    def local_gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        out = []
        for p in self.params:
            assert p.grad is not None
            out.append((p, p.grad.coalesce().values() if p.grad.is_sparse else p.grad))
        return out

    # -- update -------------------------------------------------------------------------------------
    def step(self, multiplier: float | None) -> None:
        with torch.no_grad():
            grad = torch.empty_like(self.master)
            for i, p in enumerate(self.params):
                assert p.grad is not None
                o = self.layout.offsets[i]
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                grad[o : o + p.numel()].view(p.shape).copy_(g)
            if multiplier is not None:
                grad.mul_(multiplier)
            self.step_count += 1
            self.ctx.optimizer.update(self.master, grad, self.state, self.step_count)
            self._write_back()

    def _write_back(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(self._master_view(i))

    # -- accessors ----------------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: self._master_view(i).clone() for i, n in enumerate(self.names)}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in zip(self.names, self.params, strict=True):
            if p.grad is None:
                raise RuntimeError(f"no gradient for {n!r}: full_gradients() is valid between backward and step")
            out[n] = (p.grad.to_dense() if p.grad.is_sparse else p.grad).float().clone()
        return out

    def state_bytes(self) -> dict[str, int]:
        return {
            "master_params": tensor_bytes([self.master]),
            "optimizer_state": tensor_bytes(self.state.values()),
            "gradients": tensor_bytes(p.grad for p in self.params),
            "comm_buffers": self.staging.nbytes(),
        }

    def _after_load(self) -> None:
        self._write_back()
