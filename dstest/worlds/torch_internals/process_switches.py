"""torch's process-wide settings, each with its getter and setter, for the process world's state watch.

A test that changes one of them (the default dtype, a ``torch.backends`` flag, the print options) leaves it
changed for every later test of a warm worker; :mod:`dstest.worlds.process.state_watch` reads each one before
a test and puts back what differs after it. Several have no public getter or setter: they are read here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["torch_switches"]


#: One setting: (what the state watch calls it, its getter, its setter or None).
_Switch = tuple[str, Callable[[], Any], Callable[[Any], Any] | None]


def torch_switches() -> tuple[_Switch, ...]:
    """torch's process-wide settings: (what the state watch calls it, its getter, its setter or None), made
    once; a getter this torch lacks, or that fails here, is left out.

    Besides torch's public getters and setters: the print options (``torch._tensor_str.PRINT_OPTS``),
    autograd's multithreading switch (``torch._C._is_multithreading_enabled``/``_set_...``), the flags of
    ``torch.backends`` by their ``torch._C._get_<name>``/``_set_<name>`` and the fp32 precisions by
    ``torch._C._get_fp32_precision_getter``/``_set_fp32_precision_setter`` (torch 2.11-2.15; a name a
    version lacks is skipped).
    """
    if _SWITCHES:
        return _SWITCHES[0]
    usable = []
    for label, get, put in _settings() + _backend_flags():
        with contextlib.suppress(Exception):
            get()
            usable.append((label, get, put))
    _SWITCHES.append(tuple(usable))
    return _SWITCHES[0]


def _settings() -> list[_Switch]:
    """The settings torch has getters and setters for, the print options and autograd's multithreading switch."""
    c: Any = torch._C
    opts = torch._tensor_str.PRINT_OPTS

    def print_options(value: Any) -> None:
        vars(opts).clear()
        vars(opts).update(value)

    def deterministic(value: tuple[bool, bool]) -> None:
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])

    def autocast_cpu(value: tuple[bool, Any]) -> None:
        torch.set_autocast_enabled("cpu", value[0])
        torch.set_autocast_dtype("cpu", value[1])

    return [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("default device", torch.get_default_device, torch.set_default_device),
        (
            "deterministic algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            deterministic,
        ),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        (
            "anomaly mode",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda value: torch.set_anomaly_enabled(*value),
        ),
        ("num threads", torch.get_num_threads, torch.set_num_threads),
        ("num interop threads", torch.get_num_interop_threads, None),  # settable once, before any parallel work
        ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("print options", lambda: tuple(vars(opts).items()), print_options),
        ("autocast on cpu", lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")), autocast_cpu),
        ("autocast cache", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        ("autograd multithreading", c._is_multithreading_enabled, c._set_multithreading_enabled),
    ]


def _backend_flags() -> list[_Switch]:
    """The flags of ``torch.backends`` and the fp32 precisions, by their getters and setters in ``torch._C``."""
    c: Any = torch._C
    table: list[_Switch] = []
    for name in _C_SWITCHES:
        get, put = getattr(c, f"_get_{name}", None), getattr(c, f"_set_{name}", None)
        if get is not None and put is not None:
            table.append((name, get, _spread(put)))
    get_precision, put_precision = (
        getattr(c, "_get_fp32_precision_getter", None),
        getattr(c, "_set_fp32_precision_setter", None),
    )
    if get_precision is not None and put_precision is not None:
        for backend, op in _FP32_PRECISIONS:
            table.append((f"fp32 precision of {backend} {op}", *_precision(get_precision, put_precision, backend, op)))
    return table


def _precision(get: Any, put: Any, backend: str, op: str) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """The getter and setter of torch's fp32 precision of one backend and op."""
    return (lambda: get(backend, op)), (lambda value: put(backend, op, value))


def _spread(put: Callable[..., Any]) -> Callable[[Any], Any]:
    """A setter called with what its getter returned: a tuple spread over its arguments."""
    return lambda value: put(*value) if type(value) is tuple else put(value)


_SWITCHES: list[tuple[_Switch, ...]] = []

#: Flags of torch.backends kept in torch._C as _get_<name>/_set_<name> (torch 2.11-2.15; a missing one is
#: skipped).
_C_SWITCHES = (
    "cudnn_enabled",
    "cudnn_benchmark",
    "cudnn_deterministic",
    "cudnn_allow_tf32",
    "cublas_allow_tf32",
    "cublas_allow_fp16_reduced_precision_reduction",
    "cublas_allow_bf16_reduced_precision_reduction",
    "cublas_allow_fp16_accumulation",
    "cpu_allow_fp16_reduced_precision_reduction",
    "mkldnn_enabled",
    "mkldnn_deterministic",
    "math_sdp_allow_fp16_bf16_reduction",
    "linalg_preferred_backend",
    "blas_preferred_backend",
    "deterministic_fill_uninitialized_memory",
    "warnAlways",
    "dtensor_allow_implicit_replication",
)
#: The (backend, op) pairs of torch's fp32 precision settings (``torch.backends.*.fp32_precision``).
_FP32_PRECISIONS = (
    ("generic", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
