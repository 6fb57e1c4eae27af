"""The process world's public API for compat plugins: running another suite's code on the warm workers.

A compat plugin (:mod:`dstest.compat.deepspeed`) runs a test the pytest process collected on the ranks of
:class:`~dstest.worlds.process.ProcessWorld`. The world sends its rank function by reference (module and
name), so the plugin's own rank function must live at module level; what that function needs to find the
*test's* code and run it as a fresh process of the other suite's harness would is here:

- :func:`module_ref` names a module the way a worker imports it again (its name, its file, and whether
  pytest rewrote its assertions), and :func:`import_module_ref` imports it on the rank, after
  :func:`put_path_first` has put the pytest process's ``sys.path`` in front of the worker's.
- :func:`free_port` is a port for a rendezvous of the plugin's own (a ``MASTER_PORT`` the harness gives
  its ranks); :func:`pool_pids` says which workers a world size has now, to notice a replaced pool, and
  :func:`pool_token` whether a run ended with its pool killed or replaced.
- :func:`preload_in_fork_server` has every worker start with the suite's heavy imports done once, and
  :func:`start_fork_server` starts that server at once, so its imports overlap the plugin's collection
  (:func:`start_fork_server_fed` starts one that also imports what :func:`feed_fork_server` names as the
  collection imports it, until :func:`end_fork_server_feed`);
  :func:`fork_server_preload` lists what it imports, and :func:`fork_server_from_here` makes the server a
  fork of a process that has imported it all already (a warm session, :mod:`dstest.pytest.warm`);
  :func:`replace_after_this_run`, called on a rank, gives the next run fresh processes.
- :func:`fresh_process`, on a rank, is the scope of one test run as the harness's fresh process would run
  it: what the test leaves (its module's globals, ``sys.path``, its imports, signal handlers, torch's
  settings...) is put back after it and named in the run's ``StateLeftBehind`` warning
  (:mod:`~dstest.worlds.process.state_watch`); :func:`close_held_scope` ends a scope held across tests.
- a run itself is a :class:`~dstest.worlds.request.RunRequest` given to ``ProcessWorld().run``; its
  ``strict_shapes=True`` makes a shape-only difference between ranks a mismatch too.

These names are kept stable for plugins; the modules they come from (``launch``, ``messages``, ``refs``,
``pool_cache``, ``worker``) are the process world's internals and may change.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from dstest.worlds.process.launch import (
    end_fork_server_feed,
    feed_fork_server,
    fork_server_from_here,
    fork_server_preload,
    free_port,
    preload_in_fork_server,
    start_fork_server,
    start_fork_server_fed,
)
from dstest.worlds.process.messages import FnRef
from dstest.worlds.process.state_watch import FreshProcess, close_held_scope, fresh_process, fresh_process_rng

__all__ = [
    "FreshProcess",
    "ModuleRef",
    "any_pool",
    "close_held_scope",
    "end_fork_server_feed",
    "feed_fork_server",
    "fork_server_from_here",
    "fork_server_preload",
    "free_port",
    "fresh_process",
    "fresh_process_rng",
    "import_module_ref",
    "module_ref",
    "pool_pids",
    "pool_token",
    "preload_in_fork_server",
    "put_path_first",
    "replace_after_this_run",
    "start_fork_server",
    "start_fork_server_fed",
]

#: How a worker finds a module (or a function in it): ``(module, qualname, path, rewrite_asserts)``, a
#: picklable named tuple; a reference to a whole module has an empty ``qualname``.
ModuleRef = FnRef


def module_ref(module: ModuleType) -> ModuleRef:
    """A reference a worker imports ``module`` again by: its name, its file (loaded from there when the
    name alone does not find that file, as for a test module pytest imported from its rootdir), and
    whether pytest rewrote its assertions (the worker then does the same)."""
    path = getattr(module, "__file__", None)
    return FnRef(module.__name__, "", os.path.abspath(path) if path else None, "@py_builtins" in vars(module))


def import_module_ref(ref: ModuleRef) -> ModuleType:
    """On a rank: the module ``ref`` names, already imported, importable by name, or loaded from its file
    (with its directory's first non-package parent on ``sys.path``, as under pytest's default import mode)."""
    from dstest.worlds.process.refs import import_ref

    module: ModuleType = import_ref(ref)
    return module


def put_path_first(path: list[str]) -> None:
    """On a rank: ``path`` (the pytest process's ``sys.path``) in front of the worker's own entries, in its
    order, each entry once."""
    known = set(path)
    sys.path[:] = [*path, *(p for p in sys.path if p not in known)]


def any_pool() -> bool:
    """Whether this process has a live warm pool of any world size (workers forked from its fork server)."""
    from dstest.worlds.process.pool_cache import pool_pids as all_pool_pids

    return bool(all_pool_pids())


def pool_pids(world_size: int, backend: str = "gloo") -> tuple[int, ...]:
    """The worker pids of the live warm pool of ``world_size`` ranks on ``backend`` (empty: none yet).

    A different tuple after a run than before it means the pool was replaced (a rank left it unusable)."""
    from dstest.worlds.process.pool_cache import pool_pids as all_pool_pids

    return tuple(all_pool_pids().get((backend, world_size), ()))


def pool_token(world_size: int, backend: str = "gloo") -> int | None:
    """An identity of the live warm pool of ``world_size`` ranks on ``backend`` (None: none now).

    Taken before and after a run: a token that was not None and changed means the run ended with its
    pool killed or replaced (a rank hung, died, failed with peers blocked, or left its worker unusable)."""
    from dstest.worlds.process.pool_cache import pool_token as token

    return token(backend, world_size)


def replace_after_this_run(why: str) -> None:
    """On a rank, during a run: have this worker replaced once the run ends (the run's result is reported
    as usual; the next run gets fresh processes). For what no reset can take back."""
    from dstest.worlds.process.worker import replace_after_this_run as replace

    replace(why)
