"""The per-run reset of DeepSpeed's process-global state, the entry point of the group ``dstest.resets``
(registered as ``dstest.compat.deepspeed:reset_deepspeed``; see :mod:`dstest.resets`).

A warm worker serves one DeepSpeed test after another; what DeepSpeed keeps in module globals (its
communication backend, cached groups, an open ZeRO-3 ``Init`` context, activation checkpointing's
configuration, a replaced accelerator) is put back to what a fresh import gives, so that each test starts
as in the fresh process DeepSpeed's harness would give it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["reset_deepspeed"]

_first_accelerator: list[Any] = []

#: Module globals of DeepSpeed's activation checkpointing and the values a fresh import gives them.
_CHECKPOINTING_DEFAULTS: dict[str, Any] = {
    "deepspeed_checkpointing_enabled": False,
    "mpu": None,
    "mp_rank": 0,
    "mp_size": 1,
    "mp_group": None,
    "num_layers": None,
    "timers": None,
    "PARTITION_ACTIVATIONS": False,
    "CPU_CHECKPOINT": False,
    "CONTIGUOUS_CHECKPOINTING": False,
    "SYNCHRONIZE": False,
    "PROFILE_TIME": False,
    "_cpu_offload_engine": None,
    "_checkpoint_grad_enabled": True,
}
_CHECKPOINTING_LISTS = ("contiguous_data_buffers", "data_offsets", "contiguous_size_buffers", "size_offsets")


def reset_deepspeed() -> None:
    """Put DeepSpeed's process-global state back to what a fresh process has (nothing when DeepSpeed was
    never imported here): the communication backend (``deepspeed.comm``), the process groups cached in
    ``deepspeed.utils.groups``, an open ZeRO-3 ``Init`` context, its buffers and its replacement of
    ``torch.nn.functional.linear``, activation checkpointing's
    configuration and buffers, AutoTP's mode and recorded ``tp_model_init`` arguments, and the accelerator if
    a test replaced it."""
    if "deepspeed" not in sys.modules:
        return
    comm: Any = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        for name in ("cdb", "nccl_backend", "mpi_backend", "ccl_backend", "hccl_backend"):
            if hasattr(comm, name):
                setattr(comm, name, None)
        logger = getattr(comm, "comms_logger", None)
        if logger is not None and hasattr(comm, "CommsLogger"):  # in place: other modules hold the object
            logger.__dict__.clear()
            logger.__dict__.update(comm.CommsLogger().__dict__)
        summary = getattr(comm, "timer_summary", None)
        if isinstance(summary, dict):
            summary.clear()
    groups: Any = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and hasattr(groups, "_release_process_group_references"):
        groups._release_process_group_references(group=None)
    zero: Any = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if zero is not None:
        zero.shutdown_init_context()
        zero.zero_init_context = 0
        zero.top_level_context = None
        zero.empty_buffers.clear()
        zero.temp_contiguous_tensor = None
        # Init's memory-efficient linear replaces torch.nn.functional.linear for the rest of the process
        # ("This will persist unless manually reset") and keeps the original on a class attribute.
        inserter = getattr(zero, "InsertPostInitMethodToModuleSubClasses", None)
        if inserter is not None and "linear_bk" in vars(inserter):
            delattr(inserter, "linear_bk")
        from dstest.worlds.torch_internals import put_back_functional_linear

        put_back_functional_linear()
    checkpointing: Any = sys.modules.get("deepspeed.runtime.activation_checkpointing.checkpointing")
    if checkpointing is not None:
        for name, value in _CHECKPOINTING_DEFAULTS.items():
            if hasattr(checkpointing, name):
                setattr(checkpointing, name, value)
        for name in _CHECKPOINTING_LISTS:
            if hasattr(checkpointing, name):
                setattr(checkpointing, name, [])
    _reset_autotp()
    accelerator: Any = sys.modules.get("deepspeed.accelerator.real_accelerator")
    if accelerator is not None and getattr(accelerator, "ds_accelerator", None) is not None:
        if not _first_accelerator:
            _first_accelerator.append(accelerator.ds_accelerator)
        elif accelerator.ds_accelerator is not _first_accelerator[0]:
            accelerator.ds_accelerator = _first_accelerator[0]
        _reset_memory_peak(accelerator.ds_accelerator)


def _reset_autotp() -> None:
    """``deepspeed.tp_model_init`` records its arguments in a module global and switches AutoTP to training
    mode; a later test in the same worker would see an earlier test's call ("Conflicting tp_model_init
    arguments"). Found by the generic watch of DeepSpeed's module state (:mod:`dstest.worlds.process.state_watch`)."""
    init_utils: Any = sys.modules.get("deepspeed.runtime.tensor_parallel.init_utils")
    if init_utils is not None and hasattr(init_utils, "_TP_MODEL_INIT_ARGS"):
        init_utils._TP_MODEL_INIT_ARGS = None
    layers: Any = sys.modules.get("deepspeed.module_inject.layers")
    if layers is not None and hasattr(layers, "AUTOTP_MODE") and hasattr(layers, "DEEPSPEED_AUTOTP_MODE"):
        layers.DEEPSPEED_AUTOTP_MODE = layers.AUTOTP_MODE.INFERENCE


def _reset_memory_peak(accelerator: Any) -> None:
    """The accelerator's peak-memory figure starts afresh, as in a new process: the CPU accelerator keeps
    the peak resident size since it was created (``max_mem``, what ``max_memory_allocated`` reports), so a
    warm worker would report the peak of an earlier test; a CUDA device's peak is torch's to reset."""
    import torch

    if getattr(accelerator, "_name", None) == "cpu":
        accelerator.reset_peak_memory_stats()
    elif torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.reset_peak_memory_stats()
