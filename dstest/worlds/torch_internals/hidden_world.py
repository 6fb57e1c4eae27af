"""A worker's c10d world out of sight while a test forms a world of its own (every compat plugin).

In a warm worker, whose default group is the process world's, a test that calls ``init_process_group`` itself
would fail ("trying to initialize the default process group twice"). :func:`hidden_c10d_world` swaps torch's
world state for an uninitialised one for the block, and afterwards sets aside what the test formed and puts
the worker's world back. Replacements go through :mod:`.worker_patches`, which keeps the originals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_c
from torch.distributed import distributed_c10d as c10d

from dstest.worlds.torch_internals.c10d_world import new_rank_state
from dstest.worlds.torch_internals.worker_patches import put_back, replace

__all__ = ["hidden_c10d_world"]

#: The world states tests formed and left, kept alive until the next run begins in this worker.
_SET_ASIDE: list[Any] = []

#: Module globals of ``distributed_c10d`` that ``init_process_group`` writes besides the world state (by
#: torch version; a name this torch lacks is skipped).
_C10D_GLOBALS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_default_pg_init_method", "_group_count")


@contextlib.contextmanager
def hidden_c10d_world(*, checked: bool) -> Iterator[None]:
    """This worker's c10d world out of sight for the block.

    ``distributed_c10d._world`` is swapped for a world state of its own (uninitialised, group names counted
    from 0; torch 2.11-2.15's ``_World`` keeps its tables in module globals, so a second ``_World()`` would
    share them: :func:`.c10d_world.new_rank_state` makes one that does not) and the worker's default group is
    taken out of torch's by-name registry (``_unregister_process_group``) and ``_update_default_pg``, so the
    test's ``init_process_group`` registers its own. Afterwards the worker's world, its registration and its
    global rank are put back, and what the test formed and did not destroy itself is set aside, out of
    torch's registry, and destroyed when the next run begins in this worker: only then have all the ranks of
    the test left it. The test's own ``destroy_process_group()`` of its whole world does the same in the
    block (``destroy_process_group`` is replaced there). Destroying at once would close this rank's
    connections while a peer may still be connecting to them (gloo's ``connectFullMesh`` then fails there).

    ``checked``: whether the gloo groups the test forms are the worker's checked groups; with False the
    group helper is the one :func:`.worker_patches.install_checked_gloo` wrapped (torch's own gloo groups).
    """
    _SET_ASIDE.clear()  # every rank of the run that formed them has left it
    tables = _module_tables()
    default = c10d._get_default_group()
    name = default.group_name
    c10d_c._unregister_process_group(name)
    replace(c10d, "_world", new_rank_state())
    c10d._update_default_pg(None)
    helper = c10d._new_process_group_helper
    replace(
        c10d, "_new_process_group_helper", helper.unchecked if not checked and hasattr(helper, "unchecked") else helper
    )
    destroy = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if dist.is_initialized() and (group is None or group is c10d._world.default_pg):
            _set_aside()
        else:
            destroy(group)

    replace(c10d, "destroy_process_group", destroy_process_group)
    replace(dist, "destroy_process_group", destroy_process_group)
    try:
        yield
    finally:
        put_back(c10d, "_new_process_group_helper")
        put_back(dist, "destroy_process_group")
        put_back(c10d, "destroy_process_group")
        try:
            if dist.is_initialized():
                _set_aside()
        finally:
            put_back(c10d, "_world")
            _put_back_tables(tables)
            c10d._update_default_pg(default)
            c10d_c._register_process_group(name, default)


def _set_aside() -> None:
    """The test's world out of torch's registry and out of sight, alive until the next run begins."""
    formed = c10d._world
    for group_name in list(formed.pg_names.values()):
        c10d_c._unregister_process_group(group_name)
    _SET_ASIDE.append(formed)
    c10d._world = new_rank_state()
    c10d._update_default_pg(None)


def _module_tables() -> dict[str, tuple[Any, Any]]:
    """Each of :data:`_C10D_GLOBALS`: its object, and a shallow copy when it is a dict."""
    found = {}
    for name in _C10D_GLOBALS:
        if hasattr(c10d, name):
            value = getattr(c10d, name)
            found[name] = (value, dict(value) if type(value) is dict else None)
    return found


def _put_back_tables(tables: dict[str, tuple[Any, Any]]) -> None:
    for name, (value, copy) in tables.items():
        setattr(c10d, name, value)
        if copy is not None:
            value.clear()
            value.update(copy)
