"""torch functions replaced while rank threads are installed, each acting as a rank's own process would.

Installed by :func:`dstest.worlds.torch_internals.install.thread_local_c10d_world` in place of
``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state``,
``torch.set_rng_state`` (and their ``torch.random`` names), ``dist.monitored_barrier``, ``DeviceMesh.__init__`` and
``distributed_c10d._new_process_group_helper``; each calls the original it saved in
:data:`~dstest.worlds.torch_internals.installed.INSTALL` and changes only what a rank thread needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

from dstest.worlds.torch_internals.installed import HOOKS, INSTALL
from dstest.worlds.torch_internals.rank_hooks import hold_late_imports
from dstest.worlds.torch_internals.rank_rng import current_generator

__all__ = [
    "RNG_FUNCTIONS",
    "device_mesh_class",
    "group_helper_on_rank_threads",
    "mesh_init_per_rank",
    "monitored_barrier_on_rank_threads",
]


# torch's global-RNG functions, each acting on the calling rank's own generator on a rank thread
# (:mod:`.rank_rng`) and as torch's own elsewhere. torch's versions act on ``torch.default_generator``
# (and ``manual_seed``/``seed`` on every device's too); a rank thread of the threaded world has the CPU only.
def _manual_seed(seed: Any) -> Any:
    gen = current_generator()
    return INSTALL.saved["manual_seed"](seed) if gen is None else gen.manual_seed(int(seed))


def _seed() -> int:
    gen = current_generator()
    return INSTALL.saved["seed"]() if gen is None else gen.seed()


def _initial_seed() -> int:
    gen = current_generator()
    return INSTALL.saved["initial_seed"]() if gen is None else gen.initial_seed()


def _get_rng_state() -> torch.Tensor:
    gen = current_generator()
    return INSTALL.saved["get_rng_state"]() if gen is None else gen.get_state()


def _set_rng_state(new_state: torch.Tensor) -> None:
    gen = current_generator()
    if gen is None:
        INSTALL.saved["set_rng_state"](new_state)
    else:
        gen.set_state(new_state)


#: The functions replaced in ``torch`` and ``torch.random`` while rank threads are installed, by name.
RNG_FUNCTIONS: dict[str, Any] = {
    "manual_seed": _manual_seed,
    "seed": _seed,
    "initial_seed": _initial_seed,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
}


def monitored_barrier_on_rank_threads(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    """``dist.monitored_barrier`` while rank threads are installed.

    torch implements monitored_barrier for gloo only and checks that in Python, raising a bare
    ``ValueError`` before the group sees the call. On a rank thread whose group is a Python process group
    from outside torch (dstest's), the group is asked instead, so its error can say why and what to do.
    """
    world = INSTALL.world
    if world is not None and world.current() is not None and c10d.is_initialized():
        pg = c10d._get_default_group() if group is None or group is c10d.GroupMember.WORLD else group
        refuse = getattr(pg, "monitoredBarrier", None)
        if refuse is not None and not type(pg).__module__.startswith("torch"):
            refuse(timeout, wait_all_ranks)
    return INSTALL.saved["monitored_barrier"](group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def mesh_init_per_rank(self: Any, *args: Any, **kwargs: Any) -> None:
    """``DeviceMesh.__init__`` while rank threads are installed: a mesh made on a rank thread is that rank's.

    torch ties a mesh's identity (``__eq__``, ``__hash__``) to ``_thread_id``, set only when the default
    group's backend is named "threaded" (torch's own threaded group): otherwise every rank's mesh of the same
    shape compares and hashes equal, and DTensor's process-wide caches keyed through ``DTensorSpec`` ->
    ``DeviceMesh`` (the sharding propagator's, the redistribute plans) hand one rank's local shapes and plans
    to another: wrong values from uneven shards. Here the mesh takes the calling rank's global rank as its
    thread id (helper threads a rank starts act as it), so meshes of different ranks differ, as they do in
    different processes, and the same rank's meshes stay equal.
    """
    world = INSTALL.world
    device_type = args[0] if args else kwargs.get("device_type")
    if (
        world is not None
        and world.current() is not None
        and isinstance(device_type, str)
        and device_type.startswith("cuda")
        and not torch.cuda.is_available()
    ):
        # torch takes "cuda" without GPUs in a process without LOCAL_RANK (its cross-compilation mode) and
        # fails later (fully_shard); on a world of launched processes set_device fails here. So here.
        from dstest.errors import InvalidArgument

        raise InvalidArgument(
            f"DeviceMesh(device_type={device_type!r}) on a rank of a world without CUDA "
            f"(torch {torch.__version__}, cuda available: False): use the rank's device, "
            "init_device_mesh(ctx.device.type, ...), or run the spec on a GPU world"
        )
    INSTALL.saved["mesh_init"](self, *args, **kwargs)
    hold_late_imports()  # DTensor code a body imports comes before its meshes
    if world is None or world.current() is None or getattr(self, "_thread_id", 0) is not None:
        return
    if c10d.is_initialized():
        self._thread_id = c10d.get_rank()
        self._hash = None


#: Backends a group may ask for that rank threads of one process cannot give it: real gloo among threads of
#: one process runs unchecked and unrecorded (an op mismatch passes), NCCL needs a process per GPU.
_REDIRECTED_BACKENDS = frozenset({"gloo", "nccl", "cpu:gloo", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"})


def group_helper_on_rank_threads(
    group_size: int, group_rank: Any, global_ranks: list[int], backend: Any, *args: Any, **kwargs: Any
) -> Any:
    """``distributed_c10d._new_process_group_helper`` while rank threads are installed.

    ``dist.new_group(ranks, backend="gloo")`` (Megatron makes such groups by default) would build a real
    gloo group among the rank threads: its calls unchecked, unrecorded and able to hang threads in gloo. On a
    rank thread such a group is one of the hosting world's own groups instead, and keeps the backend name it
    asked for (``dist.get_backend(group)`` says "gloo", as on a world of processes).
    """
    original = INSTALL.saved["group_helper"]
    own = HOOKS.own_backend
    world = INSTALL.world
    asked = str(backend).lower() if backend is not None else ""
    if own is None or world is None or world.current() is None or asked not in _REDIRECTED_BACKENDS:
        return original(group_size, group_rank, global_ranks, backend, *args, **kwargs)
    pg, store = original(group_size, group_rank, global_ranks, own, *args, **kwargs)
    state = c10d._world
    if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER and pg in state.pg_map:
        state.pg_map[pg] = (str(backend), state.pg_map[pg][1])
    return pg, store


def device_mesh_class() -> Any:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed
        return None
    return DeviceMesh
