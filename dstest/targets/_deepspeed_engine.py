"""A DeepSpeed engine behind dstest's ``TrainingEngine`` surface (:mod:`dstest.targets.deepspeed`), and
what it observes of the engine: the collectives DeepSpeed issues through ``deepspeed.comm`` (counted by
shadowing the backend's methods) and the bytes of the partitioned tensors the ZeRO optimizer owns.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from dstest.targets._deepspeed_errors import crash_is_deviation
from dstest.worlds.core.c10d import RECORDED_OPS

__all__ = ["CollectiveCounter", "DeepSpeedEngineAdapter"]

#: Methods of DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``) that issue a collective or a
#: point-to-point transfer; every collective of DeepSpeed's runtime goes through one of them: those named as
#: torch.distributed names them (the ops of the c10d table), and DeepSpeed's own.
_COLLECTIVES = (
    *RECORDED_OPS,
    "all_reduce_coalesced", "inference_all_reduce", "broadcast_object_list", "all_gather_coalesced",
    "all_gather_object", "monitored_barrier", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


class CollectiveCounter:
    """Counts the collectives DeepSpeed issues through its communication backend, by op name.

    While counting, the backend object's collective methods are shadowed by counting wrappers (instance
    attributes); a collective that calls another one counts once. Restored when counting stops."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._depth = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from deepspeed.comm import comm as ds_comm

        cdb = ds_comm.cdb
        if cdb is None or "_dstest_counting" in vars(cdb):
            yield
            return
        missing = object()
        saved: dict[str, Any] = {}
        for name in _COLLECTIVES:
            method = getattr(cdb, name, None)
            if callable(method):
                saved[name] = vars(cdb).get(name, missing)
                setattr(cdb, name, self._wrap(name, method))
        cdb._dstest_counting = True
        try:
            yield
        finally:
            for name, before in saved.items():
                if before is missing:
                    delattr(cdb, name)
                else:
                    setattr(cdb, name, before)
            del cdb._dstest_counting

    def _wrap(self, name: str, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and non-tensors ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if n:
                seen[ptr] = max(seen.get(ptr, 0), n)
    return sum(seen.values())


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _flatten(v)
    else:
        yield obj


class DeepSpeedEngineAdapter:
    """A DeepSpeed engine behind the :class:`~dstest.targets.base.TrainingEngine` surface."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module: torch.nn.Module = engine.module
        self._counter = CollectiveCounter()
        self._window_open = False

    # -- training ------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with crash_is_deviation("engine", "the forward of a configuration DeepSpeed accepted"):
            return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if not self._window_open:  # the first backward of a step opens the counting window
            self._counter.counts = {}
            self._window_open = True
        with self._counter.counting(), crash_is_deviation("engine", "a backward DeepSpeed accepted"):
            self.engine.backward(loss)

    def step(self) -> None:
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        with self._counter.counting(), crash_is_deviation("engine", "a step DeepSpeed accepted"):
            self.engine.step()
        if boundary:
            self._window_open = False

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # -- observation -----------------------------------------------------------------------------------------
    def get_global_grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def gradient_clipping(self) -> float:
        """The threshold in effect: the ZeRO optimizer's own ``clip_grad`` where it has one (stages 1-3 and the
        mixed-precision optimizers clip with it, and loading a checkpoint can change it), else the engine's."""
        clip = getattr(self.engine.optimizer, "clip_grad", None)
        if isinstance(clip, int | float):
            return float(clip)
        return float(self.engine.gradient_clipping())

    def loss_scale(self) -> float:
        if not self.engine.fp16_enabled():
            return 1.0
        opt = self.engine.optimizer
        for attr in ("loss_scale", "cur_scale"):
            value = getattr(opt, attr, None)
            if isinstance(value, int | float | torch.Tensor):
                return float(value)
        scaler = getattr(opt, "loss_scaler", None)
        return float(scaler.cur_scale) if scaler is not None else 1.0

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self._named():
            with crash_is_deviation("engine", f"the full fp32 value of parameter {name!r}"):
                full = safe_get_full_fp32_param(p)  # collective at stage 3
            out[name] = (p.detach() if full is None else full).float().clone().cpu()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        scale = self.loss_scale()
        out = {}
        for name, p in self._named():
            with crash_is_deviation("engine", f"the full gradient of parameter {name!r}"):
                g = safe_get_full_grad(p)  # collective at stages 1-3
            if g is None:
                raise AssertionError(f"DeepSpeed holds no gradient for {name!r} (safe_get_full_grad returned None)")
            g = g.float().clone().cpu()
            if g.is_sparse:
                g = g.coalesce().to_dense()
            out[name] = g / scale if scale != 1.0 else g
        return out

    def collective_counts(self) -> dict[str, int]:
        return dict(self._counter.counts)

    def comm_buffer_bytes(self) -> int:
        raise NotImplementedError("the DeepSpeed adapter does not observe communication buffers")

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the fp32 master partitions, the optimizer's state and the gradients this rank's ZeRO
        optimizer holds (stage 0: the model's own parameters and gradients)."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        state = _bytes(_flatten([dict(s) for s in getattr(inner, "state", {}).values()]))
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # stage 3
            master = _bytes(opt.fp32_partitioned_groups_flat)
            grads = _bytes(
                [getattr(opt, "grad_partitions_flat_buffer", None), *[t.grad for t in opt.fp32_partitioned_groups_flat],
                 *_flatten(getattr(opt, "averaged_gradients", {}))]
            )  # fmt: skip
        elif hasattr(opt, "single_partition_of_fp32_groups"):  # stages 1 and 2
            master = _bytes(opt.single_partition_of_fp32_groups)
            grads = _bytes(
                [getattr(opt, "grads_in_partition", None), *[t.grad for t in opt.single_partition_of_fp32_groups],
                 *_flatten(getattr(opt, "averaged_gradients", {})), *[p.grad for p in self.module.parameters()]]
            )  # fmt: skip
        else:
            master = _bytes(p for p in self.module.parameters())
            grads = _bytes(p.grad for p in self.module.parameters())
        return {"master_params": master, "optimizer_state": state, "gradients": grads}

    def last_grad_multiplier(self) -> float | None:
        raise NotImplementedError("the DeepSpeed adapter does not observe the gradient multiplier")

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        with crash_is_deviation("engine", "a saved checkpoint"):
            return self.engine.save_checkpoint(str(save_dir), tag=tag)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        with crash_is_deviation("engine", "a loaded checkpoint"):
            return self.engine.load_checkpoint(str(load_dir), tag=tag)
