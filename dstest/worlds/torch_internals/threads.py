"""Threads on a world of rank threads: the ones a rank starts, and what torch keeps per thread in C++.

A thread a rank starts (a data loader's, a checkpoint writer's) acts as that rank, as it would inside the
rank's own process (:func:`inheriting_start`). Two of torch's per-thread C++ objects outlive or deadlock
threads that come and go as rank threads do: the fake CUDA device guard (:func:`pin_fake_cuda_guard`) and
DTensor's sharding cache (:func:`create_thread_caches`, :func:`release_thread_caches`). A thread that serves
one rank after another (the threaded world's parked threads) is given back a fresh thread's state
(:func:`clear_thread_locals`, :func:`thread_state`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import torch

from dstest.worlds.torch_internals.installed import HOOKS, INSTALL

__all__ = [
    "clear_thread_locals",
    "create_thread_caches",
    "inheriting_start",
    "pin_fake_cuda_guard",
    "release_thread_caches",
    "thread_state",
]


def pin_fake_cuda_guard() -> None:
    """On a CUDA build without a GPU, let the main thread install torch's fake CUDA device guard.

    ``FakeTensorMode.__enter__`` (DTensor's sharding propagation, FSDP2's init) calls
    ``torch._C._ensureCUDADeviceGuardSet()``. In torch 2.11 that stores a guard owned by a ``thread_local``
    of the calling thread in the process-wide registry; once that thread exits the registry points at freed
    memory and the next ``FakeTensorMode`` on any thread crashes the process (a segfault in an FSDP2 or
    DTensor spec, depending on which rank thread entered first and when it ended). Installed from the main
    thread, which outlives every rank thread, the guard stays valid, and rank threads see it and keep theirs
    out of the registry.
    """
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if (
        ensure is not None
        and torch.version.cuda is not None
        and threading.current_thread() is threading.main_thread()
        and not torch.cuda.is_available()
    ):
        ensure()


#: Where torch keeps, in a thread's state dict, the capsule that frees DTensor's per-thread C++ sharding cache.
_DTENSOR_CACHE_KEY = "__DTensor_fastpath_thread_cache_cleanup"
_THREAD_END_LOCK = threading.Lock()


@functools.cache
def _thread_state_dict_api() -> tuple[Any, Any]:
    """Private ctypes prototypes of ``PyThreadState_GetDict`` and ``Py_IncRef`` (the shared ones in
    ``ctypes.pythonapi`` keep their defaults for other code)."""
    get = ctypes.PYFUNCTYPE(ctypes.py_object)(("PyThreadState_GetDict", ctypes.pythonapi))
    incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
    return get, incref


def _thread_state_dict() -> dict[str, Any]:
    """The calling thread's state dict (where C extensions keep per-thread objects)."""
    get, incref = _thread_state_dict_api()
    state = get()
    incref(state)  # a borrowed reference, which ctypes takes as owned
    return state  # type: ignore[no-any-return]


def create_thread_caches() -> None:
    """At the start of a rank thread (or a thread it started): create torch's per-thread DTensor cache now,
    under the lock that :func:`release_thread_caches` frees such caches under.

    torch frees that cache when Python clears an ending thread's state, under a process-wide C++ mutex,
    and drops cached Python objects inside it, which lets go of the GIL; a thread's first DTensor op
    creates its cache under the same mutex while holding the GIL. So a rank thread ending while another
    ends, or while another makes its first DTensor op (ranks leave their bodies at different times),
    deadlocks: one holds the mutex and waits for the GIL, the other holds the GIL and waits for the mutex
    (seen hanging torch 2.11's suite, and reproduced there with DTensor bodies on cold threaded worlds).
    Both done here, under a Python lock that threads wait for without the GIL, they never overlap.
    """
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is not None:
        with _THREAD_END_LOCK:
            stats()  # creates this thread's cache (it has none yet)


def release_thread_caches() -> None:
    """At the end of a rank thread (or a thread it started): free torch's per-thread DTensor cache now,
    one thread at a time (see :func:`create_thread_caches`)."""
    state = _thread_state_dict()
    if _DTENSOR_CACHE_KEY in state:
        with _THREAD_END_LOCK:
            state.pop(_DTENSOR_CACHE_KEY, None)


def clear_thread_locals() -> None:
    """On a thread that served a rank and will serve another: drop everything kept per thread in its state dict.

    Every ``threading.local`` keeps its value for a thread under a key of that thread's state dict, and C
    extensions keep their per-thread objects there (DTensor's cache, freed under its lock first). A thread's
    end clears that dict; clearing it here gives the thread what a new one would have: no ``threading.local``
    attribute a body set (its own or a library's), no cache of the rank it served.
    """
    release_thread_caches()
    _thread_state_dict().clear()


def thread_state() -> tuple[Any, ...]:
    """What torch keeps per thread in C++ that a body can leave changed: grad and inference mode, the
    thread's own dispatch keys (included, excluded), the torch-function and dispatch mode stacks, autocast,
    autograd's multithreading switch. Equal on a thread before and after it served a rank when nothing
    was left behind; a thread whose state differs is not given to another rank (it ends instead)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        repr(torch._C._dispatch_tls_local_include_set()),
        repr(torch._C._dispatch_tls_local_exclude_set()),
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        torch._C._is_torch_function_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.autograd.is_multithreading_enabled(),
    )


def inheriting_start(self: threading.Thread) -> None:
    """``threading.Thread.start`` while rank threads are installed: a thread started by a rank acts as it."""
    capture = HOOKS.capture
    as_rank = capture() if capture is not None else None
    if as_rank is not None:
        run = self.run

        def run_as_rank() -> None:
            create_thread_caches()
            try:
                with as_rank():
                    run()
            finally:
                release_thread_caches()

        self.run = run_as_rank  # type: ignore[method-assign]
    INSTALL.saved["start"](self)
