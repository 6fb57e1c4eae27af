"""A warm worker's gloo world out of sight while a test forms a world of its own (every compat plugin).

A test of another suite's harness often initialises ``torch.distributed`` itself (DeepSpeed's
``init_distributed = False``; every one of torch's ``MultiProcessTestCase`` bases). In a warm worker, whose
default group is the process world's, that call would fail ("trying to initialize the default process group
twice"). :func:`world_hidden` swaps torch's world state for an uninitialised one for the block, so the
test's ``init_process_group`` forms its own world, and afterwards destroys what the test formed and puts
the worker's world back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["DIST_ENV", "world_hidden"]

#: What a launched rank's environment names about its world.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def world_hidden(*, drop_dist_env: bool, replace_after: str | None, checked: bool = True) -> Iterator[None]:
    """This worker's gloo world out of sight for the block.

    torch-internal: ``distributed_c10d._world`` is swapped for a world state of its own (uninitialised,
    group names counted from 0; torch's ``_World`` keeps its tables in module globals, so a second
    ``_World()`` would share them) and the worker's default group is taken out of torch's by-name registry,
    so the test's ``init_process_group`` registers its own. Afterwards the worker's world, its registration
    and its global rank are put back, and what the test formed and did not destroy itself (a test that
    skipped or failed after forming its world) is set aside, out of torch's registry, and destroyed when
    the next run begins in this worker: only then have all the ranks of the test left it. The test's own
    ``destroy_process_group()`` of its whole world does the same in the block (a later
    ``init_process_group`` forms a new one). Destroying at once would close this rank's connections while a
    peer may still be connecting to them (gloo's ``connectFullMesh`` then fails on the peer: a skip, or a
    test without collectives, read as a peer's failure).

    ``drop_dist_env``: the block also sees none of :data:`DIST_ENV` (put back by dstest's reset of the
    environment before the next run). ``replace_after``: when given, the reason this worker is replaced
    after the run (what the test formed may outlive its groups, e.g. a TCPStore holding its port).
    ``checked``: whether the gloo groups the test forms are dstest's checked groups (every collective matched
    across ranks by the run's referee), as every gloo group of a worker is; with False they are torch's own
    ``ProcessGroupGloo``, exactly what a fresh process gets (a checked group is a Python ``ProcessGroup``,
    whose collectives do not pass through the dispatcher's ``c10d`` ops that ``CommDebugMode`` counts).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from dstest.worlds.torch_internals import new_rank_state

    registry: Any = torch._C._distributed_c10d
    _SET_ASIDE.clear()  # every rank of the run that formed them has left it
    saved = c10d._world
    tables = _module_tables(c10d)
    default = c10d._get_default_group()
    name = default.group_name
    registry._unregister_process_group(name)
    c10d._world = new_rank_state()
    c10d._update_default_pg(None)
    if drop_dist_env:
        for key in DIST_ENV:
            os.environ.pop(key, None)
    helper = c10d._new_process_group_helper
    if not checked and hasattr(helper, "unchecked"):
        c10d._new_process_group_helper = helper.unchecked
    destroy = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if dist.is_initialized() and (group is None or group is c10d._world.default_pg):
            _set_aside(c10d, registry, new_rank_state)
        else:
            destroy(group)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        c10d._new_process_group_helper = helper
        c10d.destroy_process_group = destroy
        dist.destroy_process_group = destroy
        if replace_after is not None:
            from dstest.worlds.process.byref import replace_after_this_run

            replace_after_this_run(replace_after)
        try:
            if dist.is_initialized():
                _set_aside(c10d, registry, new_rank_state)
        finally:
            c10d._world = saved
            _put_back(c10d, tables)
            c10d._update_default_pg(default)
            registry._register_process_group(name, default)


#: The world states tests formed and left, kept alive until the next run begins in this worker.
_SET_ASIDE: list[Any] = []

def _set_aside(c10d: Any, registry: Any, new_rank_state: Any) -> None:
    """The test's world out of torch's registry and out of sight, alive until the next run begins."""
    formed = c10d._world
    for group_name in list(formed.pg_names.values()):
        registry._unregister_process_group(group_name)
    _SET_ASIDE.append(formed)
    c10d._world = new_rank_state()
    c10d._update_default_pg(None)


#: Module globals of ``distributed_c10d`` that ``init_process_group`` writes besides the world state (by
#: torch version; a name this torch lacks is skipped).
_C10D_GLOBALS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_default_pg_init_method", "_group_count")


def _module_tables(c10d: Any) -> dict[str, tuple[Any, Any]]:
    """Each of :data:`_C10D_GLOBALS`: its object, and a shallow copy when it is a dict."""
    found = {}
    for name in _C10D_GLOBALS:
        if hasattr(c10d, name):
            value = getattr(c10d, name)
            found[name] = (value, dict(value) if type(value) is dict else None)
    return found


def _put_back(c10d: Any, tables: dict[str, tuple[Any, Any]]) -> None:
    for name, (value, copy) in tables.items():
        setattr(c10d, name, value)
        if copy is not None:
            value.clear()
            value.update(copy)
