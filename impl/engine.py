"""``impl.initialize`` and the training :class:`Engine`: DeepSpeed's engine shape over ZeRO stage components.

One training step, on every rank of the data-parallel group::

    out = engine(batch)                 # the model's forward
    engine.backward(loss)               # loss / gradient_accumulation_steps (x loss scale for fp16); at the
                                        #   accumulation boundary the stage reduces gradients (mean or sum)
    engine.step()                       # at the boundary: overflow check (every dtype, C4), global norm
                                        #   (unless compute_grad_norm is false, C3), clipping, update

All state hangs off the engine and its stage object; impl has no module-level mutable state, so ranks may
be threads of one process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from impl.comm.collectives import Comm, CommStats
from impl.comm.pg_utils import effective_rank, effective_size, is_parallel
from impl.config import Config, ConfigError, parse_config
from impl.loss_scaler import LossScaler, build_loss_scaler
from impl.optim import build_optimizer
from impl.zero import ReductionSettings, StageContext, build_stage

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "Engine", "initialize"]

CHECKPOINT_VERSION = 1
_DTYPES = MappingProxyType({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})


class CheckpointError(ConfigError):
    """A checkpoint that this engine cannot load (C7, or a different stage, model or world size)."""


def initialize(
    *,
    model: torch.nn.Module,
    config: Mapping[str, Any] | Config | str | os.PathLike[str],
    dp_group: Any = None,
    mp_group: Any = None,
) -> Engine:
    """Build an :class:`Engine` for ``model`` (moved to fp16/bf16 in place when the config says so).

    ``config``: DeepSpeed-style keys (see :mod:`impl.config`); validated before anything else, so an
    invalid config raises :class:`~impl.config.ConfigError` before any collective.

    ``dp_group``: the data-parallel group. Data parallelism is not an optional dimension: ``None`` means
    the default (world) group when torch.distributed is initialised, and a single process otherwise.

    ``mp_group``: the model-parallel (tensor-parallel) group, an optional dimension: ``None`` means no
    model parallelism (contract A1). A single-rank group and a group the caller is not a member of also mean
    "not parallel" (A3, A4). Parameters with ``tensor_model_parallel = True`` are shards; the others are
    replicated across the group and counted once in the global norm.

    Collective: at W > 1 the parameters are broadcast from data-parallel rank 0.
    """
    cfg = parse_config(config)
    return Engine(model, cfg, dp_group=dp_group, mp_group=mp_group)


class Engine:
    """A model under data-parallel training; see :func:`initialize`."""

    def __init__(self, model: torch.nn.Module, config: Config, *, dp_group: Any = None, mp_group: Any = None) -> None:
        import torch.distributed as dist

        if config.optimizer is None:
            raise ConfigError("optimizer=None: impl needs an optimizer in the config; allowed types: ['AdamW', 'SGD']")
        if dp_group is None and dist.is_available() and dist.is_initialized():
            dp_group = dist.group.WORLD
        self.config = config
        self.dp_group = dp_group
        self.mp_group = mp_group
        self.dp_world_size = effective_size(dp_group)
        self.dp_rank = effective_rank(dp_group)
        self.mp_rank = effective_rank(mp_group)
        if config.train_batch_size is not None:
            micro = config.train_micro_batch_size_per_gpu
            expected = None if micro is None else micro * config.gradient_accumulation_steps * self.dp_world_size
            if expected is not None and expected != config.train_batch_size:
                raise ConfigError(
                    f"train_batch_size={config.train_batch_size!r} must equal train_micro_batch_size_per_gpu "
                    f"({micro}) x gradient_accumulation_steps ({config.gradient_accumulation_steps}) x "
                    f"data-parallel size ({self.dp_world_size}) = {expected}"
                )
        if config.fp16.enabled:
            self.compute_dtype = torch.float16
        elif config.bf16.enabled:
            self.compute_dtype = torch.bfloat16
        else:
            self.compute_dtype = torch.float32
        self.module = model.to(self.compute_dtype) if self.compute_dtype != torch.float32 else model
        self.comm_stats = CommStats()
        self.comm = Comm(self.comm_stats)
        self._observer = Comm(None)
        self._broadcast_model()

        zero = config.zero_optimization
        comm_dtype = _DTYPES[config.communication_data_type] if config.communication_data_type else None
        reduction = ReductionSettings(
            op=config.reduce_op,
            predivide=config.gradient_predivide_factor,
            prescale=config.prescale_gradients,
            comm_dtype=comm_dtype,
            bucket_size=zero.reduce_bucket_size,
            overlap=zero.overlap_comm,
            contiguous=zero.contiguous_gradients,
            reduce_scatter=zero.reduce_scatter,
            sparse=config.sparse_gradients,
        )
        self.stage = build_stage(
            zero.stage,
            StageContext(
                module=self.module,
                named_params=[(n, p) for n, p in self.module.named_parameters() if p.requires_grad],
                dp_group=dp_group,
                mp_group=mp_group,
                config=config,
                reduction=reduction,
                optimizer=build_optimizer(config.optimizer),
                compute_dtype=self.compute_dtype,
                comm=self.comm,
                observer_comm=self._observer,
            ),
        )
        self.loss_scaler: LossScaler | None = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._last_multiplier: float | None = None
        self._window_open = False

    def _broadcast_model(self) -> None:
        if not is_parallel(self.dp_group):
            return
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                self.comm.broadcast(t.data, 0, self.dp_group)

    # -- DeepSpeed's engine surface ------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        """The clipping threshold from this engine's configuration (a checkpoint never changes it, C7)."""
        return self.config.gradient_clipping

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the loss scale under fp16); at the
        accumulation boundary, reduce the gradients over the data-parallel group."""
        if not self._window_open:
            self.comm_stats.begin_window()
            self._window_open = True
        boundary = self.is_gradient_accumulation_boundary()
        gas = self.config.gradient_accumulation_steps
        if gas > 1:
            loss = loss / gas
        if self.loss_scaler is not None:
            loss = loss.float() * self.loss_scaler.scale
        self.stage.prepare_backward(boundary)
        torch.autograd.backward(loss, retain_graph=retain_graph)
        if boundary:
            self.stage.reduce_gradients()

    def step(self) -> None:
        """At the accumulation boundary: check for overflow, compute the norm, clip, update; else count."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        scale = self.loss_scale()
        overflow, sq = self._inspect_gradients()
        compute_norm = self.config.zero_optimization.compute_grad_norm
        if overflow:
            norm = math.inf if compute_norm else None
            self.stage.skip_step()
            self.skipped_steps += 1
            self._last_multiplier = None
        else:
            norm = math.sqrt(sq) / scale if compute_norm else None
            combined = scale
            clip = self.config.gradient_clipping
            if clip > 0:
                assert norm is not None  # config rejects clipping without the norm (C2)
                ratio = (norm + 1e-6) / clip
                if ratio > 1:
                    combined = ratio * scale
            # C5: at an effective scale of exactly 1 the gradients are not touched at all.
            self._last_multiplier = None if combined == 1.0 else 1.0 / combined
            self.stage.step(self._last_multiplier)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._global_grad_norm = norm
        self.stage.zero_grad()
        self.micro_steps += 1
        self.global_steps += 1
        self.comm_stats.end_window()
        self._window_open = False

    def _counts_in_norm(self, param: torch.nn.Parameter) -> bool:
        """Shards count on every model-parallel rank; replicated parameters only on model-parallel rank 0."""
        return bool(getattr(param, "tensor_model_parallel", False)) or self.mp_rank == 0

    def _inspect_gradients(self) -> tuple[bool, float]:
        """(overflow anywhere, sum of squares of the reduced gradient); the norm part only if compute_grad_norm.

        Overflow: one flag all-reduce over the data-parallel group (when gradients are partitioned) and
        over the model-parallel group, for every dtype. Norm: one more all-reduce of the sum of squares on
        each of those groups; compute_grad_norm=false removes exactly that (C6).
        """
        pieces = self.stage.local_gradients()
        device = pieces[0][1].device if pieces else torch.device("cpu")
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for _, g in pieces:
            if g.numel() and not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
                break
        if self.stage.partitioned:
            self.comm.all_reduce(flag, self.dp_group, "max")
        self.comm.all_reduce(flag, self.mp_group, "max")
        overflow = bool(flag.item() > 0)
        if not self.config.zero_optimization.compute_grad_norm:
            return overflow, 0.0
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for p, g in pieces:
            if self._counts_in_norm(p):
                sq += g.float().pow(2).sum()
        if self.stage.partitioned:
            self.comm.all_reduce(sq, self.dp_group)
        self.comm.all_reduce(sq, self.mp_group)
        return overflow, float(sq.item())

    def zero_grad(self) -> None:
        self.stage.zero_grad()

    def get_global_grad_norm(self) -> float | None:
        """The global norm of the last step's reduced, unscaled gradient; inf if that step overflowed;
        None when ``compute_grad_norm`` is false (C3) or before the first step."""
        return self._global_grad_norm

    # -- observation (specs, benchmarks) -------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter, full and in fp32 (the master copy). Collective at W > 1 at stages 1+:
        call on every rank. Not counted in :attr:`comm_stats`."""
        return self.stage.full_parameters()  # type: ignore[no-any-return]

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradient the optimizer receives (before clipping), full, fp32, divided by the loss
        scale; valid between ``backward`` at the boundary and ``step``. Collective like full_parameters."""
        grads: dict[str, torch.Tensor] = self.stage.full_gradients()
        scale = self.loss_scale()
        if scale != 1.0:
            grads = {k: v / scale for k, v in grads.items()}
        return grads

    def collective_counts(self) -> dict[str, int]:
        """Collectives the last training step issued, by op name (from its first backward to its step)."""
        return dict(self.comm_stats.last_window)

    def comm_buffer_bytes(self) -> int:
        """Bytes of communication staging buffers this engine holds (0 when nothing is ever exchanged)."""
        return int(self.stage.comm_buffer_bytes())

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for master parameters, optimizer state, gradients and comm buffers (B9)."""
        return dict(self.stage.state_bytes())

    def last_grad_multiplier(self) -> float | None:
        """What the last step multiplied the gradients by (1/effective scale), or None if untouched (C5)."""
        return self._last_multiplier

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint: the model, its share of master parameters and optimizer state."""
        return {
            "impl_checkpoint": CHECKPOINT_VERSION,
            "stage": self.config.stage,
            "dp_world_size": self.dp_world_size,
            "dp_rank": self.dp_rank,
            "module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
            "zero": self.stage.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "config": {
                "gradient_clipping": self.config.gradient_clipping,
                "compute_grad_norm": self.config.zero_optimization.compute_grad_norm,
                "gradient_allreduce_op": self.config.reduce_op,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`. The configuration wins: clipping, the reduce op and the norm
        setting stay what this engine was configured with (C7). Collective at stages 1+ (W > 1)."""
        if state.get("impl_checkpoint") != CHECKPOINT_VERSION:
            raise CheckpointError(
                f"impl_checkpoint={state.get('impl_checkpoint')!r}: not an impl checkpoint of version "
                f"{CHECKPOINT_VERSION}; allowed: a dict saved by Engine.state_dict()"
            )
        saved_clip = float(state["config"]["gradient_clipping"])
        if saved_clip > 0 and not self.config.zero_optimization.compute_grad_norm:
            raise CheckpointError(
                f"checkpoint saved with gradient_clipping={saved_clip!r} cannot be loaded into an engine with "
                "zero_optimization.compute_grad_norm=False (the clipping it was trained with needs the norm); "
                "allowed: a checkpoint saved with gradient_clipping=0, or an engine with compute_grad_norm=True"
            )
        for key, mine in (("stage", self.config.stage), ("dp_world_size", self.dp_world_size)):
            if state[key] != mine:
                raise CheckpointError(f"checkpoint {key}={state[key]!r}; this engine needs {key}={mine!r}")
        self.module.load_state_dict(state["module"])
        self.stage.load_state_dict(state["zero"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def _rank_file(self, directory: str) -> str:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return os.path.join(directory, f"rank{rank}.pt")

    def _world_barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._observer.barrier(dist.group.WORLD)

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None) -> None:
        """Write this rank's :meth:`state_dict` under ``save_dir/tag`` (DeepSpeed's layout of a tag directory
        and a ``latest`` file). Call on every rank."""
        tag = tag or f"global_step{self.global_steps}"
        directory = os.path.join(os.fspath(save_dir), tag)
        os.makedirs(directory, exist_ok=True)
        torch.save(self.state_dict(), self._rank_file(directory))
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            with open(os.path.join(os.fspath(save_dir), "latest"), "w") as f:
                f.write(tag)
        self._world_barrier()

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> None:
        """Load what :meth:`save_checkpoint` wrote (``tag`` None: the ``latest`` one). Call on every rank."""
        if tag is None:
            with open(os.path.join(os.fspath(load_dir), "latest")) as f:
                tag = f.read().strip()
        state = torch.load(self._rank_file(os.path.join(os.fspath(load_dir), tag)), weights_only=True)
        self.load_state_dict(state)
