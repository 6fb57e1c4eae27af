"""Installing and removing every switch rank threads need, reference-counted across worlds.

:func:`thread_local_c10d_world` is the one entry: the first world to enter it swaps torch's process-wide
state and functions for the per-rank ones of the sibling modules, the last to leave puts torch's back.
:func:`thread_local_c10d_world_ensure` repairs, at each world start, what code run since then undid.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dstest.worlds.torch_internals import rank_hooks, wrappers
from dstest.worlds.torch_internals.c10d_world import ThreadLocalWorld
from dstest.worlds.torch_internals.installed import HOOKS, INSTALL
from dstest.worlds.torch_internals.threads import inheriting_start, pin_fake_cuda_guard

__all__ = ["thread_local_c10d_world", "thread_local_c10d_world_ensure"]


def _set_isolation(on: bool) -> None:
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolation is not None:
        isolation(on)


def _install_switches() -> None:
    """Under the install lock, for the first world: swap torch's process-wide state and functions for the
    per-rank ones, keeping each original in ``INSTALL.saved``."""
    INSTALL.saved["world"] = c10d._world
    INSTALL.world = ThreadLocalWorld(c10d._world)
    c10d._world = INSTALL.world  # type: ignore[assignment]
    _set_isolation(True)
    pin_fake_cuda_guard()
    INSTALL.saved["start"] = threading.Thread.start
    threading.Thread.start = inheriting_start  # type: ignore[method-assign]
    for name, per_rank in wrappers.RNG_FUNCTIONS.items():
        INSTALL.saved[name] = getattr(torch.random, name)
        setattr(torch, name, per_rank)
        setattr(torch.random, name, per_rank)
    INSTALL.saved["monitored_barrier"] = c10d.monitored_barrier
    c10d.monitored_barrier = dist.monitored_barrier = wrappers.monitored_barrier_on_rank_threads
    rank_hooks.hold_module_hooks()
    rank_hooks.hold_op_handlers()
    INSTALL.saved["group_helper"] = c10d._new_process_group_helper
    c10d._new_process_group_helper = wrappers.group_helper_on_rank_threads  # type: ignore[assignment]
    mesh = wrappers.device_mesh_class()
    if mesh is not None:
        INSTALL.saved["mesh_class"], INSTALL.saved["mesh_init"] = mesh, mesh.__init__
        mesh.__init__ = wrappers.mesh_init_per_rank


def _remove_switches() -> None:
    """Under the install lock, when the last world ends: put back every original :func:`_install_switches`
    saved, and forget the hosting world's hooks."""
    _set_isolation(False)
    c10d._world = INSTALL.saved["world"]
    threading.Thread.start = INSTALL.saved["start"]  # type: ignore[method-assign]
    for name in wrappers.RNG_FUNCTIONS:
        setattr(torch, name, INSTALL.saved[name])
        setattr(torch.random, name, INSTALL.saved[name])
    c10d.monitored_barrier = dist.monitored_barrier = INSTALL.saved["monitored_barrier"]
    c10d._new_process_group_helper = INSTALL.saved["group_helper"]
    rank_hooks.release_module_hooks()
    rank_hooks.release_op_handlers()
    if "mesh_init" in INSTALL.saved:
        INSTALL.saved["mesh_class"].__init__ = INSTALL.saved["mesh_init"]
    HOOKS.__init__()  # type: ignore[misc]
    INSTALL.world = None
    INSTALL.saved.clear()


def _set_hooks(
    capture: Callable[[], Callable[[], Any] | None] | None,
    translate: Callable[[Any], Any] | None,
    own_backend: str | None,
) -> None:
    """Under the install lock: take each hook a world gives (a world giving none keeps the earlier one's)."""
    if capture is not None:
        HOOKS.capture = capture
    if translate is not None:
        HOOKS.translate = translate
    if own_backend is not None:
        HOOKS.own_backend = own_backend


@contextlib.contextmanager
def thread_local_c10d_world(
    capture: Callable[[], Callable[[], Any] | None] | None = None,
    translate: Callable[[Any], Any] | None = None,
    own_backend: str | None = None,
) -> Iterator[ThreadLocalWorld]:
    """Install a thread-local c10d world for the duration of the block (re-entrant across worlds).

    - ``distributed_c10d._world`` is process-global; replaced by a proxy that gives each rank thread
      its own state (torch 2.13; :mod:`.c10d_world`).
    - torch 2.13 registers process groups by name in a process-global C++ registry; a second thread
      registering "0" fails with "A process group is already registered under the name0" unless
      ``_set_thread_isolation_mode(True)``.
    - Each rank thread calls ``bind()``, which also keeps that thread's backward on the thread.
    - ``threading.Thread.start`` is wrapped so that a thread started by a rank thread acts as that rank
      (``capture``; :func:`.threads.inheriting_start`); ``translate`` maps a foreign rank's group to the
      caller's own.
    - torch's global-RNG functions (``torch.manual_seed``, ``get_rng_state``...) act on the calling rank's
      own generator (``wrappers.RNG_FUNCTIONS``, :mod:`.rank_rng`), which the hosting world gives each rank
      thread with :func:`.rank_rng.rank_generator`.
    - ``dist.monitored_barrier`` is wrapped so that a non-gloo Python group explains torch's gloo-only limit.
    - ``DeviceMesh.__init__`` is wrapped so that a rank's meshes are its own (``mesh_init_per_rank``).
    - torch's process-wide module-hook and optimizer-hook tables are per rank for hooks a rank registers
      (``_RankModuleHooks``); DTensor's custom op handlers are held per rank (``_CountedHandlers``; both in
      :mod:`.rank_hooks`).
    - ``_new_process_group_helper`` is wrapped so that a group a rank thread asks of gloo or NCCL is one of
      the world's own (backend ``own_backend``; ``group_helper_on_rank_threads``).
    - On a CUDA build without a GPU, the main thread installs torch's fake CUDA guard (``pin_fake_cuda_guard``).
    """
    with INSTALL.lock:
        if INSTALL.users == 0:
            _install_switches()
        _set_hooks(capture, translate, own_backend)
        INSTALL.users += 1
        world = INSTALL.world
    assert world is not None
    try:
        yield world
    finally:
        with INSTALL.lock:
            INSTALL.users -= 1
            if INSTALL.users == 0:
                _remove_switches()


def thread_local_c10d_world_ensure() -> None:
    """At each world start: put back what code run since the install switched off.

    torch's own threaded helpers (``MultiThreadedTestCase``, ``spawn_threads_and_init_comms``) switch
    thread isolation off when they finish and swap ``distributed_c10d._world``; warm rank threads would
    then fail with "A process group is already registered under the name0".
    """
    with INSTALL.lock:
        if INSTALL.users == 0 or INSTALL.world is None:
            return
        _set_isolation(True)
        rank_hooks.hold_op_handlers()  # DTensor imported since the install (a body's own import)
        if c10d._world is not INSTALL.world:  # type: ignore[comparison-overlap]
            c10d._world = INSTALL.world  # type: ignore[assignment]
