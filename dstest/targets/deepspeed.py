"""The adapter for DeepSpeed (a third-party target; written against DeepSpeed 0.19.8).

Everything goes through DeepSpeed's public surface: ``deepspeed.initialize(model=, optimizer=, config=,
mpu=)`` with a client torch optimizer (so none of DeepSpeed's native optimizer ops is JIT-built), the
engine's own methods, ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_grad`` for full
values, ``deepspeed.comm.pg_utils.is_parallel`` for the optional-group guard, the AutoTP layers
(``deepspeed.module_inject.layers.LinearLayer`` / ``LinearAllreduce``), ``deepspeed.sequence.cross_entropy
.vocab_parallel_cross_entropy`` and ``deepspeed.runtime.utils.get_global_norm_of_tensors`` for the call
sites of contract A6, and ``DeepSpeedConfig`` for configuration checks. Beyond that the adapter observes: it
counts the collectives DeepSpeed issues through ``deepspeed.comm`` and sums the bytes of the partitioned
tensors the ZeRO optimizer owns.

Three translations keep one DeepSpeed finding each from masking every other spec (each is a finding in the
README; ``DSTEST_DEEPSPEED_STRICT=1`` turns all three off): a missing ``gradient_clipping`` means 0 (the
specs' "off"; DeepSpeed's default is 1.0), the removed ``sparse_gradients`` key is dropped, and
non-contiguous parameters are made contiguous before ``deepspeed.initialize`` (which cannot broadcast them).
Crashes inside DeepSpeed's optional-group helpers are reported as :class:`DeepSpeedDeviation`.

DeepSpeed keeps process groups and its communication backend in module globals, so it runs in the process
world (one process per rank), not in threads. The process world destroys the groups a run created after
the run, so each new adapter (one per run and rank) first releases DeepSpeed's references to them.

DeepSpeed is imported lazily: dstest works without it, and asking for this target without it installed
raises :class:`DeepSpeedUnavailable` naming ``pip install dstest[deepspeed]``.
The adapter is split by what each part serves: this module is the ``Target`` (its operations and the
optional-group call sites), :mod:`dstest.targets._deepspeed_engine` the engine and what is observed of it,
:mod:`dstest.targets._deepspeed_setup` what goes into ``deepspeed.initialize`` (the translations above),
:mod:`dstest.targets._deepspeed_errors` the errors and the crash-to-deviation rule. The files are named
``_deepspeed_*.py``, not put in a ``deepspeed/`` package: a frame in a ``deepspeed/`` directory is taken for
DeepSpeed's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dstest.targets._deepspeed_engine import DeepSpeedEngineAdapter
from dstest.targets._deepspeed_errors import (
    DeepSpeedAdapterError,
    DeepSpeedDeviation,
    DeepSpeedUnavailable,
    crash_is_deviation,
    import_deepspeed,
)
from dstest.targets._deepspeed_setup import (
    STRICT_ENV,
    Mpu,
    client_optimizer,
    ensure_comm,
    make_parameters_contiguous,
    prebuild,
    release_cached_groups,
    translate,
)
from dstest.targets.base import FEATURES, TrainingEngine

__all__ = ["STRICT_ENV", "DeepSpeedAdapterError", "DeepSpeedDeviation", "DeepSpeedTarget", "DeepSpeedUnavailable"]


#: What this adapter can observe or drive. Not listed: "comm_buffer_bytes" (DeepSpeed's staging buffers
#: are spread over private attributes that change between releases; no public accessor) and
#: "grad_multiplier" (DeepSpeed applies 1/scale inside its optimizer step without recording it); specs
#: needing them skip. "fp16" depends on the accelerator (see :meth:`DeepSpeedTarget.supports`).
_FEATURES = frozenset(FEATURES - {"comm_buffer_bytes", "grad_multiplier", "fp16", "impl_components"})


class DeepSpeedTarget:
    """DeepSpeed as a system under test (see the module docstring)."""

    name = "deepspeed"
    third_party = True
    default_world = "process"  # module-global process groups: one rank per process

    @staticmethod
    def environment(device: str) -> dict[str, str]:
        """Set on each rank's process before a spec body runs (worlds know nothing of targets): DeepSpeed
        picks its accelerator from ``DS_ACCELERATOR`` when first imported, so ranks on CPU get ``cpu``."""
        return {"DS_ACCELERATOR": "cpu"} if device == "cpu" else {}

    @staticmethod
    def prepare(device: str) -> None:
        """Before the first spec (:meth:`dstest.binding.TargetBinding.prepare`): build DeepSpeed's shm_comm
        op, which its communication backend would JIT-build inside the first spec's timeout on CPU."""
        prebuild(device, DeepSpeedTarget.environment(device))

    def __init__(self) -> None:
        ds = import_deepspeed()
        if threading.current_thread() is not threading.main_thread():
            raise DeepSpeedAdapterError(
                "target 'deepspeed' cannot run in the threaded world: DeepSpeed keeps process groups in module "
                "globals shared by all threads; run it in the process world (`--world process`, or "
                "`--dstest-worlds=process` under pytest)"
            )
        from deepspeed.runtime.config import DeepSpeedConfigError

        self.version = str(ds.__version__)
        self.config_errors: tuple[type[BaseException], ...] = (ValueError, AssertionError, DeepSpeedConfigError)
        release_cached_groups()
        import torch.distributed as dist

        if dist.is_initialized():
            ensure_comm()

    def supports(self, feature: str) -> bool:
        if feature == "fp16":
            from deepspeed.accelerator import get_accelerator

            return bool(get_accelerator().is_fp16_supported())
        if feature == "bf16":
            from deepspeed.accelerator import get_accelerator

            return bool(get_accelerator().is_bf16_supported())
        return feature in _FEATURES

    def check_config(self, config: Mapping[str, Any]) -> None:
        """DeepSpeed's own validation of a configuration (``DeepSpeedConfig``; translated as for
        :meth:`initialize`): no engine, no collective."""
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(translate(config))

    def initialize(
        self, model: torch.nn.Module, config: Mapping[str, Any], dp_group: Any = None, mp_group: Any = None
    ) -> TrainingEngine:
        ds = import_deepspeed()
        ensure_comm()
        cfg = translate(config)
        optimizer = client_optimizer(cfg.pop("optimizer", None), model.parameters())
        cfg["zero_allow_untested_optimizer"] = True
        cfg.setdefault("steps_per_print", 1 << 30)
        make_parameters_contiguous(model)
        mpu = None if dp_group is None and mp_group is None else Mpu(dp_group, mp_group)
        with crash_is_deviation("engine", "an engine for a configuration DeepSpeedConfig accepts"):
            engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu, dist_init_required=False)
        return DeepSpeedEngineAdapter(engine)

    # -- optional-group call sites (contracts A) ---------------------------------------------------------------
    def is_parallel(self, group: Any) -> bool:
        from deepspeed.comm import pg_utils

        if group is not None:
            ensure_comm()
        with crash_is_deviation("A1-A4", "False for absent, single-rank and non-member groups, True otherwise"):
            return bool(pg_utils.is_parallel(group))

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        """The guard DeepSpeed's call sites use: ``if pg_utils.is_parallel(group): dist.all_reduce(...)``."""
        from deepspeed import comm as ds_comm
        from deepspeed.comm import pg_utils

        ops = {"sum": ds_comm.ReduceOp.SUM, "max": ds_comm.ReduceOp.MAX, "min": ds_comm.ReduceOp.MIN}
        if op not in ops:
            raise DeepSpeedAdapterError(f"op={op!r}; allowed: {sorted(ops)}")
        if group is not None:
            ensure_comm()
        with crash_is_deviation("A5", "a guarded all-reduce that works on any optional group"):
            if pg_utils.is_parallel(group):
                ds_comm.all_reduce(tensor, op=ops[op], group=group)
        return tensor

    @staticmethod
    def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
        """A ``torch.nn.Linear`` holding copies of ``weight`` and ``bias`` in their own layout (a weight
        passed as ``stored.t()`` stays transposed, as in the model it came from)."""
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight = torch.nn.Parameter(weight.detach().clone())  # clone keeps the strides of a dense tensor
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone())
        return layer

    def column_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """AutoTP's column-parallel layer (``LinearLayer``) in training mode."""
        from deepspeed.module_inject.layers import LinearLayer, set_autotp_mode

        ensure_comm()
        set_autotp_mode(training=True)
        with crash_is_deviation("A6", "a column-parallel layer for any optional group"):
            layer: torch.nn.Module = LinearLayer(self._linear(weight, bias), mp_group=group)
        return layer

    def row_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """AutoTP's row-parallel layer (``LinearAllreduce``) in training mode."""
        from deepspeed.module_inject.layers import LinearAllreduce, set_autotp_mode

        ensure_comm()
        set_autotp_mode(training=True)
        with crash_is_deviation("A6", "a row-parallel layer for any optional group"):
            layer: torch.nn.Module = LinearAllreduce(self._linear(weight, bias), mp_group=group)
        return layer

    def vocab_parallel_cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int
    ) -> torch.Tensor:
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

        if group is not None:
            ensure_comm()
        with crash_is_deviation("A6", "the cross-entropy of the full logits for any optional group"):
            loss: torch.Tensor = vocab_parallel_cross_entropy(
                logits, target, tp_group=group, vocab_start_index=vocab_start,
                vocab_end_index=vocab_start + logits.shape[-1], reduction="mean",
            )  # fmt: skip
        return loss

    def global_norm(self, tensors: Iterable[torch.Tensor], mp_group: Any) -> torch.Tensor:
        """``get_global_norm_of_tensors``; DeepSpeed takes the model-parallel group through an mpu, and an
        absent dimension is ``mpu=None``."""
        from deepspeed.runtime.utils import get_global_norm_of_tensors

        ensure_comm()
        mpu = None if mp_group is None else Mpu(None, mp_group)
        with crash_is_deviation("A6", "the global norm for any optional model-parallel group"):
            norm: torch.Tensor = get_global_norm_of_tensors(list(tensors), norm_type=2, mpu=mpu)
        return norm
