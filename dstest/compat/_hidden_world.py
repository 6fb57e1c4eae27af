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

__all__ = ["DIST_ENV", "world_hidden"]

#: What a launched rank's environment names about its world.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def world_hidden(*, drop_dist_env: bool, replace_after: str | None, checked: bool = True) -> Iterator[None]:
    """This worker's gloo world out of sight for the block.

    torch-internal (:func:`dstest.worlds.torch_internals.hidden_c10d_world`): ``distributed_c10d._world`` is
    swapped for a world state of its own and the worker's default group is taken out of torch's by-name
    registry, so the test's ``init_process_group`` registers its own. Afterwards the worker's world, its registration
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
    ``ProcessGroupGloo``, exactly what a fresh process gets. Both reach torch's dispatcher the same way
    (contract E16: ``CommDebugMode`` counts the same); the compat plugins form checked groups unless the
    user asks for torch's own (``--dstest-unchecked``).
    """
    from dstest.worlds.torch_internals import hidden_c10d_world

    with hidden_c10d_world(checked=checked):
        if drop_dist_env:
            for key in DIST_ENV:
                os.environ.pop(key, None)
        try:
            yield
        finally:
            if replace_after is not None:
                from dstest.worlds.process.byref import replace_after_this_run

                replace_after_this_run(replace_after)
