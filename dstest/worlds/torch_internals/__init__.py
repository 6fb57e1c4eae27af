"""Everything of dstest that depends on torch internals, in one package (the tox matrix exercises it per version).

Each function names the torch behaviour it papers over, and each workaround names the torch versions it
was seen on. Nothing here runs at import time. What lives where:

- :mod:`.c10d_world`: each rank thread's own c10d state, a subclass of torch's ``distributed_c10d._World``
  made at run time with no field shared (:func:`new_rank_state`), the proxy that stands in for
  ``distributed_c10d._world`` (:class:`ThreadLocalWorld`), and what a warm world resets between runs
  (:func:`drop_subgroups`, :class:`FreshRunState`).
- :mod:`.install`: the one entry that installs every switch rank threads need and removes them when the
  last world ends (:func:`thread_local_c10d_world`), and the repair at each world start
  (:func:`thread_local_c10d_world_ensure`).
- :mod:`.installed`: the record of what is installed (saved originals, the hosting world's hooks) that the
  other modules read.
- :mod:`.rank_rng`: torch's default CPU generator, one per rank: every draw on a rank thread that names no
  generator uses the rank's (a kernel at torch's custom-RNG dispatch key).
- :mod:`.wrappers`: the torch functions replaced on rank threads: ``torch.manual_seed`` and the other
  global-RNG functions (on the rank's generator),
  ``dist.monitored_barrier``, ``DeviceMesh.__init__`` (a mesh's per-rank thread id), gloo and NCCL group
  creation redirected to the world's own backend.
- :mod:`.rank_hooks`: torch's process-wide module, optimizer and DTensor op-handler tables, per rank.
- :mod:`.threads`: threads a rank starts act as it; torch's per-thread C++ objects (the fake CUDA guard,
  DTensor's sharding cache) kept from outliving or deadlocking rank threads.
- :mod:`.process_groups`: what dstest's Python process groups need from torch whatever world hosts them
  (stores, the work handle base, :func:`linked_future`, :func:`reduce_op_name`, backend registration).

The names below are the package's API to the rest of dstest; the modules' other names are shared between
the modules of this package only. A test that replaces a name must replace it in the module that looks it
up (``c10d_world.global_backed_fields``), not here.
"""

from __future__ import annotations

from dstest.worlds.torch_internals.c10d_world import (
    FreshRunState,
    RankState,
    adopt_rank_state,
    c10d_state,
    current_rank_state,
    drop_subgroups,
    global_backed_fields,
    new_rank_state,
    unisolated_world_fields,
)
from dstest.worlds.torch_internals.install import thread_local_c10d_world, thread_local_c10d_world_ensure
from dstest.worlds.torch_internals.process_groups import (
    OptionsReader,
    WorkBase,
    backend_registered,
    declare_self_recording,
    gloo_has_list_all_to_all,
    hash_store,
    init_rank_process_group,
    linked_future,
    reduce_op_name,
)
from dstest.worlds.torch_internals.rank_hooks import hold_late_imports
from dstest.worlds.torch_internals.rank_rng import current_generator, rank_generator
from dstest.worlds.torch_internals.raw_writes import below_autograd, foreach_copy, set_version_counters
from dstest.worlds.torch_internals.threads import create_thread_caches, release_thread_caches

__all__ = [
    "FreshRunState",
    "OptionsReader",
    "RankState",
    "WorkBase",
    "adopt_rank_state",
    "backend_registered",
    "below_autograd",
    "c10d_state",
    "create_thread_caches",
    "current_generator",
    "current_rank_state",
    "declare_self_recording",
    "drop_subgroups",
    "foreach_copy",
    "global_backed_fields",
    "gloo_has_list_all_to_all",
    "hash_store",
    "hold_late_imports",
    "init_rank_process_group",
    "linked_future",
    "new_rank_state",
    "rank_generator",
    "reduce_op_name",
    "release_thread_caches",
    "set_version_counters",
    "thread_local_c10d_world",
    "thread_local_c10d_world_ensure",
    "unisolated_world_fields",
]
