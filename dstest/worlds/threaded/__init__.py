"""The threaded world: N ranks as threads of this process, real data movement, dstest's own c10d backend.

Every collective call is matched across ranks by (group, sequence number) in a rendezvous
(:mod:`~dstest.worlds.threaded.rendezvous`); the groups are dstest's c10d backend
(:mod:`~dstest.worlds.threaded.group`); the rank threads, warm crews that keep them between runs and the run
loop are :mod:`~dstest.worlds.threaded.ranks`, :mod:`~dstest.worlds.threaded.crews` and
:mod:`~dstest.worlds.threaded.world`, which lists the package's modules.
"""

from __future__ import annotations

from dstest.worlds.stopping import stuck_threads
from dstest.worlds.threaded.crews import kept_warm_threads, shutdown_all, warm_thread_cap
from dstest.worlds.threaded.group import BACKEND_NAME
from dstest.worlds.threaded.ranks import thread_shared_in_last_run
from dstest.worlds.threaded.world import ThreadedWorld, c10d_state

__all__ = [
    "BACKEND_NAME",
    "ThreadedWorld",
    "c10d_state",
    "kept_warm_threads",
    "shutdown_all",
    "stuck_threads",
    "thread_shared_in_last_run",
    "warm_thread_cap",
]
