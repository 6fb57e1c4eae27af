"""One small class per collective: what one rank brought, how ranks must agree, how the result is formed.

A ``Call`` is one rank's side of one collective. The world that hosts the ranks matches calls across ranks
by (group, sequence number) and then:

1. ``check_local()`` on each call as it arrives (sizes that one rank alone can get wrong);
2. ``check_peer(first)`` against the first call that arrived (op, dtype, shapes, root, counts);
3. ``combine(calls)`` once, by the last rank to arrive, which reads every rank's inputs and returns
   per-rank sources that no rank can mutate afterwards;
4. ``finish(source)`` for each rank, which copies its source into that rank's output tensors.

Steps 3 and 4 run together in ``deliver(calls)``, by the last rank to arrive, for every rank. Large
messages of the collectives that dominate training (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast) skip the staging of step 3 where no output can alias another rank's
input: they read every input in place and write every output once (measured in
``benchmarks/bench_threaded.py`` against a memcpy of the same bytes).

Messages name the op, the group, the sequence number and each rank's shapes, as gloo and NCCL do not.

What ranks must agree on is what gloo and NCCL need (contract E2): the op, the reduce op, the root, the dtype,
the device and the element count of each buffer (and the split sizes of ``all_to_all_single``); not the
shape. Both backends move flat buffers: a ``[2, 1, 1]`` tensor broadcast into ``[2]`` on its peers, or a 0-d
tensor all-reduced with a ``[1]``, is a correct program on both (DeepSpeed's pipeline engine does the
first). The shapes still show in every call's description and trace. ``strict_shapes`` (a run option,
``--dstest-strict-shapes``) also refuses calls whose shapes differ.

One small class per c10d collective, with the same four steps, which both the threaded world's rendezvous
and the process world's referee read: :mod:`.base` (the ``Call`` base class, copies and reductions),
:mod:`.reducing` (all_reduce, reduce, broadcast, reduce_scatter) and :mod:`.gathering` (all_gather,
gather, scatter, all_to_all, barrier). This package re-exports them all, with :data:`CALLS` (op name ->
class) for each collective of the c10d table of :mod:`dstest.worlds.core.c10d` (its ``COLLECTIVES``, the
one list of collective names; the table names a collective by its op); matching calls across ranks is the
checking core's (:mod:`dstest.worlds.core.matching`).
"""

from __future__ import annotations

from dstest.errors import CollectiveMismatch
from dstest.worlds.collectives.base import (
    IN_PLACE_BYTES,
    Call,
    PremulSum,
    bump_versions,
    check_reduce,
    copy_flat,
    copy_tensors,
    describe_tensor,
    raw_writes,
    reduce_into,
    reduce_tensors,
)
from dstest.worlds.collectives.base import check_root as check_root
from dstest.worlds.collectives.base import is_large as is_large
from dstest.worlds.collectives.base import outputs_apart as outputs_apart
from dstest.worlds.collectives.base import shapes_text as shapes_text
from dstest.worlds.collectives.base import storage_of as storage_of
from dstest.worlds.collectives.gathering import (
    AllGather,
    AllGatherIntoTensor,
    AllToAll,
    AllToAllSingle,
    Barrier,
    Gather,
    Scatter,
)
from dstest.worlds.collectives.reducing import AllReduce, Broadcast, Reduce, ReduceScatter, ReduceScatterTensor
from dstest.worlds.core.c10d import COLLECTIVES
from dstest.worlds.core.matching import mismatch_text

__all__ = [
    "CALLS",
    "IN_PLACE_BYTES",
    "AllGather",
    "AllGatherIntoTensor",
    "AllReduce",
    "AllToAll",
    "AllToAllSingle",
    "Barrier",
    "Broadcast",
    "Call",
    "Gather",
    "PremulSum",
    "Reduce",
    "ReduceScatter",
    "ReduceScatterTensor",
    "Scatter",
    "bump_versions",
    "check_reduce",
    "copy_flat",
    "copy_tensors",
    "describe_tensor",
    "mismatch",
    "raw_writes",
    "reduce_into",
    "reduce_tensors",
]


def _by_op(cls: type[Call]) -> dict[str, type[Call]]:
    """Every class below ``cls`` that names an op of its own, by that op (bases of others name none)."""
    found: dict[str, type[Call]] = {}
    for sub in cls.__subclasses__():
        if "op" in vars(sub):
            found[sub.op] = sub
        found.update(_by_op(sub))
    return found


_CLASSES = _by_op(Call)
_UNWRITTEN = [op for op in COLLECTIVES if op not in _CLASSES]
if _UNWRITTEN:  # every collective the c10d table issues must have its class
    raise ImportError(f"dstest.worlds.collectives: no Call class for the c10d table's ops {_UNWRITTEN}")
#: The ``Call`` class of each collective of the c10d table (:data:`dstest.worlds.core.c10d.COLLECTIVES`).
CALLS: dict[str, type[Call]] = {op: _CLASSES[op] for op in COLLECTIVES}


def mismatch(op_desc: str, a_rank: int, a: Call, b_rank: int, b: Call, why: str) -> CollectiveMismatch:
    """Two ranks' calls of one collective that cannot match (the text is the checking core's)."""
    return CollectiveMismatch(mismatch_text(op_desc, a_rank, a, b_rank, b, why))
