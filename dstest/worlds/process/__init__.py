"""The process world: ranks are warm OS processes joined by a real backend (gloo on CPU, NCCL on GPUs).

For code with process-global state (DeepSpeed caches its groups in module globals), which threads cannot
host. A *pool* of worker processes per (backend, device, world size) has already imported torch and formed
its process group, so a spec costs milliseconds instead of the seconds of a fresh spawn:

    parent                                      worker r (one per rank, started once per pool)
    run(fn, W) --- pickled (reference to fn, args) ---> resolve fn by module + qualname (+ file path)
                                                        fn(RankContext(rank=r, ...)) under a fresh store prefix
               <-- pickled result | traceback, output -- destroy the groups fn created

Functions travel by reference, so they must be module-level (a ``@dstest.spec`` body, a test module's
function, a benchmark's ``__main__`` function); arguments and results travel by pickle.

Failures never leave a broken pool behind. gloo cannot abort a rank blocked in a collective, so when a
rank fails and the others do not finish within a short grace, when a worker dies, or when the run passes
its timeout (stacks taken with faulthandler first), the pool is killed and a replacement is started at
once; the run raises :class:`RankFailure`, :class:`WorkerDied` or :class:`WorldTimeout` naming the ranks.
Rendezvous goes through a ``FileStore`` in a private temporary directory (no fixed ports: ``pytest -n``
works). No worker outlives the session: :func:`shutdown_all` runs from the plugin's ``pytest_unconfigure``
and at interpreter exit, and an idle worker whose parent is gone exits by itself.

Every collective and transfer of a gloo pool is checked across ranks before gloo runs it (see "Cross-rank
checking" below): a mismatch of op, group, sequence number, shapes, dtypes, root or split sizes raises
:class:`CollectiveMismatch` on every rank involved, naming both ranks and both calls; a rank that waits for
a collective that a finished or failed rank never joined is told so; a deadlock of all running ranks is
reported with each rank's pending call; work a run leaves unmatched or unwaited fails it with
:class:`UnfinishedWork` and never reaches gloo, so it cannot leak into the next run. NCCL pools are not
checked.

Warm workers are capped (:func:`warm_worker_cap`: a world's ``max_warm_workers``, else the
``DSTEST_PROCESS_MAX_WORKERS`` environment variable, else ``DEFAULT_MAX_WARM_WORKERS``), all pools
together; starting a pool closes the least recently used idle ones beyond the cap, and a world larger
than the cap runs cold. A script must start the process world under ``if __name__ == "__main__":``
(workers import it to find its functions); an unguarded call raises :class:`UnguardedMain`.

Workers are forked from multiprocessing's fork server, which imports torch once (see ``mp_context``):
a pool of 8 starts in well under a second once that server runs, and a replaced pool costs little. Where
there is no fork server, workers are spawned. The package imports neither torch nor the target at import
time (its names are imported when first used); a worker sets its environment (``RANK``,
``OMP_NUM_THREADS``, ...) before it touches torch.

The package, one module per concern (each imports only those before it in this list):

- :mod:`~dstest.worlds.process.messages`: what travels between parent and workers (pickled by reference);
- :mod:`~dstest.worlds.process.refs`: function references, loading a module by name or path;
- :mod:`~dstest.worlds.process.checker`, :mod:`~dstest.worlds.process.checked_group` and
  :mod:`~dstest.worlds.process.checked`: the worker side of the cross-rank check (a rank's posted calls;
  the ``CheckedGroup`` torch sees, made from the checking core's c10d table; its registration);
- :mod:`~dstest.worlds.process.state_watch`: what a run leaves behind in a warm worker, put back and named;
- :mod:`~dstest.worlds.process.worker`: the worker process's entry point and run loop;
- :mod:`~dstest.worlds.process.referee`: the parent side of the cross-rank check (it drives the checking
  core, :mod:`dstest.worlds.core.matching`, as the threaded world's rendezvous does);
- :mod:`~dstest.worlds.process.launch`: the fork server or spawn, ports, threads per rank;
- :mod:`~dstest.worlds.process.handle`: the parent's handle on one worker (its process, pipes and log);
- :mod:`~dstest.worlds.process.gather`: one run's traffic with the workers and the referee;
- :mod:`~dstest.worlds.process.reports`: what a run reports (output, traces, state left behind, failures);
- :mod:`~dstest.worlds.process.pool`: one pool of warm workers: its lifecycle and its runs;
- :mod:`~dstest.worlds.process.pool_cache`: the pools of this process, the warm cap, cold runs,
  :func:`shutdown_all`;
- :mod:`~dstest.worlds.process.world`: :class:`ProcessWorld`;
- :mod:`~dstest.worlds.process.byref`: the stable API of the compat plugins (imports what it offers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstest._lazy import lazy_names

if TYPE_CHECKING:
    from dstest.worlds.process.pool_cache import (
        DEFAULT_MAX_WARM_WORKERS,
        MAX_WARM_WORKERS_ENV,
        pool_pids,
        shutdown_all,
        warm_worker_cap,
    )
    from dstest.worlds.process.world import ProcessWorld

__all__ = [
    "DEFAULT_MAX_WARM_WORKERS",
    "MAX_WARM_WORKERS_ENV",
    "ProcessWorld",
    "pool_pids",
    "shutdown_all",
    "warm_worker_cap",
]

# Imported when first asked for, not with the package: a compat plugin starts the fork server through
# :mod:`~dstest.worlds.process.launch` (the standard library only) before this process imports torch, so
# that the server imports torch at the same time, on the other core.
_FROM = {name: "dstest.worlds.process.pool_cache" for name in __all__ if name != "ProcessWorld"}
_FROM["ProcessWorld"] = "dstest.worlds.process.world"


__getattr__ = lazy_names(__name__, _FROM, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
