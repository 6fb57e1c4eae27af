"""How a rank thread of the threaded world forms its default group: torch's c10d state as
``init_process_group`` leaves it, with the world's rank table built once for all ranks (issue 44 item 1)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import dstest
from dstest.worlds import torch_internals
from dstest.worlds.threaded.group import BACKEND_NAME, binding, rank_process_group, register_backend
from dstest.worlds.threaded.ranks import c10d_per_thread
from dstest.worlds.threaded.thread_shared import ThreadedRendezvous

pytestmark = pytest.mark.cpu


def _state_fields() -> dict[str, Any]:
    """The calling rank's c10d state, by group name where a table is keyed by group (objects differ)."""
    state = c10d._world
    name = state.pg_names
    return {
        "pg_map": {name[pg]: (str(backend), type(store).__name__) for pg, (backend, store) in state.pg_map.items()},
        "pg_names": sorted(name.values()),
        "pg_group_ranks": {name[pg]: dict(ranks) for pg, ranks in state.pg_group_ranks.items()},
        "pg_backend_config": {name[pg]: cfg for pg, cfg in state.pg_backend_config.items()},
        "tags_to_pg": {tag: [name[pg] for pg in pgs] for tag, pgs in state.tags_to_pg.items()},
        "pg_to_tag": {name[pg]: tag for pg, tag in state.pg_to_tag.items()},
        "group_count": state.group_count,
        "default": (dist.get_rank(), dist.get_world_size(), str(dist.get_backend()), name[state.default_pg]),
        "desc": c10d._get_default_group().group_desc,
    }


def test_a_rank_forms_its_default_group_as_init_process_group_does() -> None:
    """dstest forms each rank's default group without torch's init_process_group: every table torch keeps
    for it must come out as init_process_group leaves it under the running torch."""
    register_backend()
    rendezvous = ThreadedRendezvous(6)
    seen: dict[str, dict[str, Any]] = {}
    with c10d_per_thread() as world:
        with rank_process_group(world, rendezvous, 3, torch.device("cpu"), timedelta(seconds=60)):
            seen["dstest"] = _state_fields()
        world.bind()
        binding.session, binding.rank, binding.device = rendezvous, 3, torch.device("cpu")
        try:
            torch_internals.init_rank_process_group(
                backend=BACKEND_NAME, rank=3, world_size=6, store=rendezvous.store, timeout=timedelta(seconds=60)
            )
            seen["torch"] = _state_fields()
            dist.destroy_process_group()
        finally:
            binding.__dict__.clear()
            world.unbind()
    assert seen["dstest"] == seen["torch"]


def _rank_table(ctx: dstest.RankContext) -> tuple[int, dict[int, int]]:
    table = c10d._world.pg_group_ranks[c10d.GroupMember.WORLD]
    return id(table), dict(table)


@pytest.mark.parametrize("world_size", [3, 64])
def test_the_world_rank_table_is_built_once_for_all_ranks(world_size: int) -> None:
    """Each rank's default group maps global to group ranks with one table made for the world, not one per
    rank (W ranks building W entries each was O(W^2) at start: 0.78 ms per rank at W=2048)."""
    results = dstest.run(_rank_table, world_size)
    assert {ident for ident, _ in results} == {results[0][0]}
    assert all(table == {r: r for r in range(world_size)} for _, table in results)
    assert [dist_ranks for dist_ranks in dstest.run(_world_ranks, world_size)] == [list(range(world_size))] * world_size


def _world_ranks(ctx: dstest.RankContext) -> list[int]:
    return dist.get_process_group_ranks(c10d.GroupMember.WORLD)
