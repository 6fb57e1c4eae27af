"""Everything that depends on torch internals, in one place (the tox matrix exercises it per version).

Each function names the torch behaviour it papers over. Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "init_rank_process_group",
    "reduce_op_name",
    "thread_local_c10d_world",
]


class _PerThreadWorld:
    """The state that ``distributed_c10d._World`` keeps, for one rank thread.

    torch 2.13 keeps most of it in module globals (``_pg_map``, ``_pg_names``, ``_group_count``, ...)
    behind properties of the single ``_world`` object, so one process can host one rank only.
    """

    def __init__(self) -> None:
        self.default_pg: Any = None
        self.pg_map: dict[Any, Any] = {}
        self.pg_names: dict[Any, Any] = {}
        self.pg_group_ranks: dict[Any, Any] = {}
        self.pg_backend_config: dict[Any, Any] = {}
        self.group_count = 0
        self.tags_to_pg: dict[Any, Any] = {}
        self.pg_to_tag: dict[Any, Any] = {}
        self.pg_coalesce_state: dict[Any, Any] = {}
        self.comms: list[Any] = []


class _ThreadLocalWorld:
    """Stands in for ``distributed_c10d._world``: rank threads see their own state, others the original."""

    def __init__(self, original: Any) -> None:
        self._original = original
        self._local = threading.local()

    def bind(self) -> _PerThreadWorld:
        """Give the calling (rank) thread its own c10d state and keep its backward on this thread.

        Autograd runs backward of CUDA tensors on its own device threads, where the rank's thread-local
        state is invisible, so gradient hooks that issue collectives would find no process group. The
        switch is per thread (autograd state is thread-local), hence set here, on the rank thread.
        """
        torch.autograd.set_multithreading_enabled(False)
        state = _PerThreadWorld()
        self._local.state = state
        return state

    def unbind(self) -> None:
        self._local.__dict__.pop("state", None)

    def _target(self) -> Any:
        return getattr(self._local, "state", None) or self._original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_original", "_local"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    # ``pg_config_info`` is a computed property on torch's _World; keep the original's behaviour.
    @property
    def pg_config_info(self) -> list[dict[str, Any]]:
        return [
            {"pg_name": self.pg_names[pg], "ranks": list(self.pg_group_ranks[pg])}
            for pg in self.pg_map
        ]


class _Installation:
    """Process-wide switches that rank threads need, reference-counted and undone when the last world ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.world: _ThreadLocalWorld | None = None
        self.saved: dict[str, Any] = {}


_INSTALL = _Installation()


@contextlib.contextmanager
def thread_local_c10d_world() -> Iterator[_ThreadLocalWorld]:
    """Install a thread-local c10d world for the duration of the block (re-entrant across worlds).

    - ``distributed_c10d._world`` is process-global; replaced by a proxy that gives each rank thread
      its own state (torch 2.13).
    - torch 2.13 registers process groups by name in a process-global C++ registry; a second thread
      registering "0" fails with "A process group is already registered under the name0" unless
      ``_set_thread_isolation_mode(True)``.
    - Each rank thread calls ``bind()``, which also keeps that thread's backward on the thread.
    """
    with _INSTALL.lock:
        if _INSTALL.users == 0:
            _INSTALL.saved["world"] = c10d._world
            _INSTALL.world = _ThreadLocalWorld(c10d._world)
            c10d._world = _INSTALL.world  # type: ignore[assignment]
            isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
            if isolation is not None:
                isolation(True)
            _INSTALL.saved["isolation"] = isolation
        _INSTALL.users += 1
        world = _INSTALL.world
    assert world is not None
    try:
        yield world
    finally:
        with _INSTALL.lock:
            _INSTALL.users -= 1
            if _INSTALL.users == 0:
                isolation = _INSTALL.saved["isolation"]
                if isolation is not None:
                    isolation(False)
                c10d._world = _INSTALL.saved["world"]
                _INSTALL.world = None
                _INSTALL.saved.clear()


_INIT_LOCK = threading.Lock()


def init_rank_process_group(**kwargs: Any) -> None:
    """``dist.init_process_group`` for one rank thread, leaving ``sys.excepthook`` as it was.

    torch 2.13's init_process_group wraps the process-wide sys.excepthook to prefix "[rankN]", once per
    call: N rank threads would stack N prefixes, run after run. Inits are serialised (they exchange
    nothing, so no rank waits for another) so that each one's wrap is undone exactly.
    """
    with _INIT_LOCK:
        hook = sys.excepthook
        try:
            dist.init_process_group(**kwargs)
        finally:
            sys.excepthook = hook


_REDUCE_OP_NAMES = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
}


def reduce_op_name(op: Any) -> str:
    """'sum', 'avg', ... for a ReduceOp or RedOpType (options carry one or the other across versions)."""
    for name, short in _REDUCE_OP_NAMES.items():
        member = getattr(dist.ReduceOp, name, None)
        if member is not None and op == member:
            return short
    inner = getattr(op, "op", None)
    if inner is not None and inner is not op:
        return reduce_op_name(inner)
    raise ValueError(f"unsupported reduce op {op!r}")
