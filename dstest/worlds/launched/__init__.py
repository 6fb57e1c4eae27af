"""The launched world: this process is one rank of a world that a launcher started (torchrun, torch elastic).

A launcher (``torchrun --nproc-per-node 8 -m pytest -m gpu``, the same under Slurm or Kubernetes across
nodes) starts one pytest per rank and tells each, through the environment, who it is (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and where the rendezvous store is
(``MASTER_ADDR``/``MASTER_PORT``; under torch elastic the agent hosts it, ``TORCHELASTIC_USE_AGENT_STORE``).
dstest starts no process of its own here: every launched pytest collects the same items, runs them in the
same order (:mod:`dstest.pytest.lockstep`) and, for each run of a spec, joins its peers through that store.

One run at world size N of a launch of W ranks:

* N > W: the spec is skipped, with the reason (:meth:`LaunchedWorld.unavailable_reason`).
* N <= W: ranks 0..N-1 form a fresh default process group of N ranks for the run (a subgroup of the
  first N launched ranks when N < W; ranks N..W-1 run nothing and wait for the run's outcome). The group
  is destroyed when the run ends, so no group of one run reaches the next.
* The backend is NCCL when this node has a CUDA device for every local rank (rank r on
  ``cuda:LOCAL_RANK``), gloo on CPU otherwise; ``DSTEST_LAUNCHED_BACKEND=gloo|nccl`` chooses explicitly.
  Items of the launched world carry the ``gpu`` marker on NCCL and ``cpu`` on gloo.
* The body runs on a thread of each rank; the rank's own thread watches the store. A rank whose body
  raises marks the run failed at once, and the ranks still running stop waiting for it (its group is
  torn down, which fails their pending gloo/NCCL calls). A run past its timeout is stopped on every rank
  with each rank's stack; the timeout bounds the body and starts once the run's group has formed (each
  launched rank connects when its own process gets there; forming has its own limit,
  :func:`~.outcomes.form_limit`). Every participant then posts its outcome, and every rank (participant or not)
  raises the same :class:`~dstest.errors.RankFailure` (every failing rank's traceback) or
  :class:`~dstest.errors.WorldTimeout` (every hung rank's stack), or returns every rank's result.
* A rank that posts nothing within the timeout plus :data:`REPORT_GRACE_S` (plus the forming's limit on a
  rank outside the run, which asks from the run's start; its process is stuck with the interpreter lock
  held, or gone) is named in the report as silent.

The store is used only through short calls (set, get, add, check) polled from the rank's own thread, and
the run's process group gets its own connection to it, so a group forming never delays the watching.

torch-internal (through :mod:`dstest.worlds.torch_internals`): the store classes (``TCPStore``,
``PrefixStore``) and, for NCCL, ``abort_process_group`` to unblock a hung NCCL group; otherwise the public
``torch.distributed`` API (``rendezvous``, ``init_process_group``, ``destroy_process_group``).

The package, one module per job: :mod:`~.environment` (who this process is in the launch, the backend),
:mod:`~.connection` (this rank's connection to the launcher's store), :mod:`~.world` (:class:`LaunchedWorld`),
:mod:`~.rank_run` (one run on this rank) and :mod:`~.outcomes` (what the participants post, and the results
or the one error every rank makes of them).
"""

from __future__ import annotations

from dstest.worlds.launched.connection import CONNECT_TIMEOUT_S, Launch, connect, current_launch, shutdown
from dstest.worlds.launched.environment import BACKEND_ENV, LaunchEnvironment, backend_name, launch_environment
from dstest.worlds.launched.outcomes import REPORT_GRACE_S
from dstest.worlds.launched.rank_run import ABORT_GRACE_S
from dstest.worlds.launched.world import LaunchBroken, LaunchedWorld

__all__ = [
    "ABORT_GRACE_S",
    "BACKEND_ENV",
    "CONNECT_TIMEOUT_S",
    "REPORT_GRACE_S",
    "Launch",
    "LaunchBroken",
    "LaunchEnvironment",
    "LaunchedWorld",
    "backend_name",
    "connect",
    "current_launch",
    "launch_environment",
    "shutdown",
]
