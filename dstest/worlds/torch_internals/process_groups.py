"""What dstest's Python process groups need from torch: stores, work handles, futures, reduce ops, backends.

This papers over the torch behaviour a c10d backend written in Python meets whatever world hosts it (threads
of one process, gloo processes): a future that fails in C++ too, the flight recorder's hook, the excepthook
``init_process_group`` stacks, reduce ops whose names and factors moved between versions.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "WorkBase",
    "backend_registered",
    "declare_self_recording",
    "form_default_group",
    "gloo_has_list_all_to_all",
    "hash_store",
    "init_rank_process_group",
    "linked_future",
    "reduce_op_name",
]


def gloo_has_list_all_to_all() -> bool:
    """Whether gloo runs the list ``all_to_all``: torch 2.11's has none ("Backend gloo does not support
    alltoall"; ``all_to_all_single`` works), 2.12 added it."""
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0]) >= Version("2.12")


def hash_store() -> Any:
    """An in-memory c10d store for one world's rendezvous (threads of this process)."""
    return torch._C._distributed_c10d.HashStore()


def declare_self_recording(name: str) -> None:
    """Tell torch (2.15+) that backend ``name`` records its own collectives, so that group creation does not
    attach torch's flight-recorder hook to its groups.

    torch 2.15 attaches a ``FlightRecorderHook`` to every new group whose backend is not in
    ``distributed_c10d._FR_SELF_RECORDING_BACKENDS``, and only skips groups that report no device; the hook
    reads the group's name from a registered C++ backend, which a Python process group has none of
    ("ProcessGroup name not set"). dstest's groups record every call themselves (traces, ``ctx.comm``).
    """
    backends = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(backends, set):
        backends.add(name)


def backend_registered(name: str) -> bool:
    """Whether a c10d backend plugin of this name is registered (torch keeps them in ``Backend._plugins``)."""
    return name.upper() in dist.Backend._plugins


def _value_or_raise(source: torch.futures.Future[Any]) -> Any:
    return source.value()  # raises the error set on ``source``, which fails the chained future in C++


def linked_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """``(source, handed_out)``: a future to give to torch for a work handle, and the one that resolves it.

    ``torch.futures.Future.set_exception`` does not fail a future in C++: it completes it *successfully*
    with the exception object as its value, and only Python's ``wait``/``value`` raise it (an unwrap
    function). A C++ consumer reads that value as the work's result: DDP's reducer, in
    ``finalize_backward``, takes the tensors out of it, finds none and reads past the end of an empty
    vector, a segfault in the rank's ``backward`` whenever a bucket's all_reduce failed (a desync: a peer
    finished early; torch 2.11-2.15). A future chained with ``then`` whose callback raises is failed in C++
    itself, so what a Work hands out is the chained future: its ``wait``/``value`` raise on both sides
    (in Python as ``RuntimeError`` carrying the original error's type and text). Resolve ``source`` with
    ``set_result`` or ``set_exception``.
    """
    source: torch.futures.Future[Any] = torch.futures.Future()
    return source, source.then(_value_or_raise)


#: The base of the work handles a Python process group returns (``torch.distributed._Work``).
WorkBase: Any = dist._Work  # type: ignore[attr-defined]


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


def form_default_group(
    *, backend: str, rank: int, world_size: int, store: Any, timeout: timedelta, rank_table: dict[int, int]
) -> None:
    """What ``dist.init_process_group(backend, rank=, world_size=, store=, timeout=)`` does on one rank thread,
    with the default group's rank table (global rank -> group rank) given: one table made for the world.

    torch's init_process_group builds that table anew for each call, ``{i: i for i in range(world_size)}``:
    W rank threads building W entries each was O(W^2) at a world's start (0.78 ms per rank at W=2048, the
    largest share of a start at thousands of ranks). Every other step is torch's own, in its order: the
    group's name from the rank's group count, torch's group helper (the backend's group, the tables keyed
    by group), the default group and global rank set. Left out: the process-wide ``sys.excepthook`` prefix,
    which one process of rank threads must not stack (so no lock serialises the ranks' starts either), the
    call logger, and the optional store barrier (``TORCH_DIST_INIT_BARRIER``), which synchronises
    processes. ``tests/test_default_group_formation.py`` compares the result with init_process_group's
    under the running torch (torch 2.11-2.15 share this path).
    """
    if c10d.GroupMember.WORLD is not None:
        raise ValueError("trying to initialize the default process group twice!")
    justknobs = getattr(c10d, "set_pytorch_distributed_envs_from_justknobs", None)
    if justknobs is not None:
        justknobs()
    if "torch._dynamo" in sys.modules:  # torch clears these caches here; distributed rules depend on it
        torch._dynamo.trace_rules.clear_lru_cache()
    name = c10d._process_group_name([], use_hashed_name=False)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        c10d.PrefixStore("default_pg", store),
        name,
        timeout=timeout,
        group_desc="default_pg",
    )
    c10d._update_default_pg(pg)
    c10d._world.pg_group_ranks[pg] = rank_table
    c10d._backend = c10d._world.pg_map[pg][0]  # module globals init_process_group sets (same on every rank)
    c10d._default_pg_init_method = None


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


#: RedOpType member -> name, filled on first use: options carry a ReduceOp whose ``op`` is one of these, and
#: a dict lookup on it costs less than comparing it against every member (one per collective).
_BY_TYPE: dict[Any, str] = {}


def reduce_op_name(op: Any) -> str:
    """'sum', 'avg', ... for a ReduceOp or RedOpType (options carry one or the other across versions);
    ``premul_sum`` comes with its factor (:class:`dstest.worlds.collectives.PremulSum`), read from the
    op's pickled state ``(RedOpType.PREMUL_SUM, factor)`` (torch keeps it in a C++ supplement)."""
    if op == dist.ReduceOp.SUM:  # the common case: one comparison in C++
        return "sum"
    if not _BY_TYPE:
        for name, short in _REDUCE_OP_NAMES.items():
            member = getattr(dist.ReduceOp, name, None)
            if member is not None and short != "premul_sum":
                _BY_TYPE[member] = short
    try:
        known = _BY_TYPE.get(getattr(op, "op", op))
    except TypeError:  # not hashable: an op of some other kind, answered below
        known = None
    if known is not None:
        return known
    premul = getattr(dist.ReduceOp, "PREMUL_SUM", None)
    if premul is not None and getattr(op, "op", None) == premul:
        from dstest.worlds.collectives import PremulSum

        state = op.__getstate__()
        return PremulSum(state[1] if isinstance(state, tuple) and len(state) > 1 else 1.0)
    for name, short in _REDUCE_OP_NAMES.items():
        member = getattr(dist.ReduceOp, name, None)
        if member is not None and op == member:
            return short
    inner = getattr(op, "op", None)
    if inner is not None and inner is not op:
        return reduce_op_name(inner)
    raise ValueError(f"unsupported reduce op {op!r}")


class OptionsReader:
    """How both worlds' group classes read torch's c10d options objects: the reduce op's name and the root."""

    @staticmethod
    def op(opts: Any) -> str:
        return reduce_op_name(opts.reduceOp)

    @staticmethod
    def root(opts: Any) -> int:
        return int(opts.rootRank)
