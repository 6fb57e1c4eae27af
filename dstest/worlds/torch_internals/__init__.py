"""Everything of dstest that depends on torch's private API, in one package (the tox matrix exercises it per version).

This package is the fence of issue 41: no other module of dstest touches a private name of torch (one
starting with "_" reached through ``torch``, ``torch.distributed`` or ``distributed_c10d``, or anything from
a private module such as ``torch.testing._internal``); they call the names exported below, and
``tests/test_torch_fence.py`` lists any use outside. Each function names the torch behaviour it relies on or
papers over, and the torch versions it was seen on (2.11-2.15). Nothing here runs at import time. Replacing a
torch function goes through one install/remove that keeps the original: :mod:`.install` (saved in
``installed.INSTALL``) for rank threads, :mod:`.worker_patches` (``WORKER_SAVED``) in a process worker.
What lives where:

- :mod:`.c10d_world`: each rank thread's own c10d state, a subclass of torch's ``distributed_c10d._World``
  made at run time with no field shared (:func:`new_rank_state`), the proxy that stands in for
  ``distributed_c10d._world`` (:class:`ThreadLocalWorld`), what a warm world resets between runs
  (:func:`drop_subgroups`, :class:`FreshRunState`), and reads of c10d's state (:func:`c10d_state`,
  :func:`default_group`, :func:`abort_process_group`).
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
- :mod:`.dispatched`: the base of dstest's process groups in both worlds (:class:`DispatchedGroup`), whose
  collectives reach torch's dispatcher as the ``c10d`` ops a C++ backend's do (contract E16).
- :mod:`.c10d_classes`: torch's C++ c10d classes dstest builds (stores, each collective's options, gloo's
  own group, gloo's backend type), from ``torch._C._distributed_c10d``.
- :mod:`.raw_writes`: writing a collective's results as a backend's C++ does: below autograd
  (:func:`below_autograd`), version counters set by hand, torch's foreach copy.
- :mod:`.worker_patches`: a process worker's replacements of torch functions with their saved originals:
  every gloo group a checked one (:func:`install_checked_gloo`), DeepSpeed's replaced ``F.linear`` put back.
- :mod:`.hidden_world`: a worker's c10d world out of sight while a test forms its own
  (:func:`hidden_c10d_world`, for the compat plugins).
- :mod:`.process_switches`: torch's process-wide settings with their getters and setters, private ones
  included (:func:`torch_switches`, for the process world's state watch).
- :mod:`.testing_bases`: what the compat plugin reads of torch's test bases (``torch.testing._internal``:
  timeouts, skip messages) and what their tests leave (dynamo's caches, DeviceMesh's stack).

The names below are the package's API to the rest of dstest; the modules' other names are shared between
the modules of this package only. A test that replaces a name must replace it in the module that looks it
up (``c10d_world.global_backed_fields``), not here.
"""

from __future__ import annotations

from dstest.worlds.torch_internals.c10d_classes import (
    c10d_options,
    file_store,
    gloo_backend_type,
    gloo_group,
    prefix_store,
    tcp_client_store,
)
from dstest.worlds.torch_internals.c10d_world import (
    FreshRunState,
    RankState,
    abort_process_group,
    adopt_rank_state,
    c10d_state,
    current_rank_state,
    default_group,
    drop_subgroups,
    global_backed_fields,
    new_rank_state,
    unisolated_world_fields,
)
from dstest.worlds.torch_internals.hidden_world import hidden_c10d_world
from dstest.worlds.torch_internals.install import thread_local_c10d_world, thread_local_c10d_world_ensure
from dstest.worlds.torch_internals.process_groups import (
    OptionsReader,
    WorkBase,
    backend_registered,
    declare_self_recording,
    form_default_group,
    gloo_has_list_all_to_all,
    hash_store,
    init_rank_process_group,
    linked_future,
    reduce_op_name,
)
from dstest.worlds.torch_internals.process_switches import torch_switches
from dstest.worlds.torch_internals.rank_hooks import hold_late_imports
from dstest.worlds.torch_internals.rank_rng import current_generator, rank_generator
from dstest.worlds.torch_internals.raw_writes import below_autograd, foreach_copy, set_version_counters
from dstest.worlds.torch_internals.testing_bases import (
    bases_default_timeout,
    bases_skip_message,
    bases_timeout,
    reset_bases_leftovers,
)
from dstest.worlds.torch_internals.threads import (
    clear_thread_locals,
    create_thread_caches,
    release_thread_caches,
    thread_state,
)
from dstest.worlds.torch_internals.worker_patches import install_checked_gloo, put_back_functional_linear

__all__ = [
    "FreshRunState",
    "OptionsReader",
    "RankState",
    "WorkBase",
    "abort_process_group",
    "adopt_rank_state",
    "backend_registered",
    "bases_default_timeout",
    "bases_skip_message",
    "bases_timeout",
    "below_autograd",
    "c10d_options",
    "c10d_state",
    "clear_thread_locals",
    "create_thread_caches",
    "current_generator",
    "current_rank_state",
    "declare_self_recording",
    "default_group",
    "drop_subgroups",
    "file_store",
    "foreach_copy",
    "form_default_group",
    "global_backed_fields",
    "gloo_backend_type",
    "gloo_group",
    "gloo_has_list_all_to_all",
    "hash_store",
    "hidden_c10d_world",
    "hold_late_imports",
    "init_rank_process_group",
    "install_checked_gloo",
    "linked_future",
    "new_rank_state",
    "prefix_store",
    "put_back_functional_linear",
    "rank_generator",
    "reduce_op_name",
    "release_thread_caches",
    "reset_bases_leftovers",
    "set_version_counters",
    "tcp_client_store",
    "thread_local_c10d_world",
    "thread_local_c10d_world_ensure",
    "thread_state",
    "torch_switches",
    "unisolated_world_fields",
]
