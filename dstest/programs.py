"""Collective programs: a sequence of collectives on subgroups, runnable in any world and by a reference.

A program is data, so hypothesis can draw it (``dstest.strategies.programs``), every world can execute it
(:func:`execute` inside a rank), and a pure-torch :func:`reference` can say what each rank must end with.
Inputs are drawn from (seed, step, rank), so two worlds see identical inputs. Values are small integers
held in the op's dtype, so sums and products are exact and worlds can be compared bit for bit.

Ranks outside an op's group do not call it (torch turns such a call into a warning and a no-op) and
record ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument
from dstest.worlds.core.c10d import COLLECTIVES

__all__ = ["GLOO_KINDS", "KINDS", "Op", "Program", "execute", "op_inputs", "reference"]

#: Every kind of op a program can hold (contract E1): each collective of the c10d table, and three a program
#: makes of the table's methods: an all_gather of pieces of different sizes, a send with its recv, and a
#: batch of isend/irecv.
KINDS = (*COLLECTIVES, "all_gather_uneven", "send_recv", "batch_isend_irecv")
#: Kinds gloo implements (torch 2.13), so it can serve as the oracle; the rest use the reference.
GLOO_KINDS = frozenset(KINDS) - {"all_gather_uneven", "reduce_scatter"}
REDUCE_OPS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor")
_TORCH_OPS = {
    "sum": "SUM",
    "product": "PRODUCT",
    "min": "MIN",
    "max": "MAX",
    "avg": "AVG",
    "band": "BAND",
    "bor": "BOR",
    "bxor": "BXOR",
}


@dataclass(frozen=True, kw_only=True)
class Op:
    """One collective: on ``ranks`` (global, sorted; None = the world), ``numel`` elements per piece."""

    kind: str
    ranks: tuple[int, ...] | None = None
    numel: int = 4
    dtype: str = "float32"
    reduce_op: str = "sum"
    root: int = 0  # group rank of the root / source (send_recv: sender), peer for send_recv is ``peer``
    peer: int = 1  # group rank of the receiver in send_recv
    splits: tuple[tuple[int, ...], ...] = ()  # all_to_all_single: splits[i][j] rows from group rank i to j
    async_op: bool = False

    def group_ranks(self, world_size: int) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else tuple(range(world_size))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class Program:
    world_size: int
    ops: tuple[Op, ...]
    seed: int = 0
    groups: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.groups:
            seen: list[tuple[int, ...]] = []
            for op in self.ops:
                if op.ranks is not None and op.ranks not in seen:
                    seen.append(op.ranks)
            object.__setattr__(self, "groups", tuple(seen))
        for op in self.ops:
            if op.kind not in KINDS:
                raise InvalidArgument(f"Op.kind={op.kind!r}; allowed: {list(KINDS)}")


def _values(seed: int, step: int, rank: int, shape: Sequence[int], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) * 31 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    return torch.randint(1, 4, tuple(shape), generator=g).to(dtype)


def op_inputs(program: Program, step: int, rank_in_group: int, global_rank: int) -> list[torch.Tensor]:
    """The input tensors one rank brings to op ``step`` (deterministic, the same in every world)."""
    op = program.ops[step]
    n = len(op.group_ranks(program.world_size))
    dt, s = op.torch_dtype, program.seed

    def v(shape: Sequence[int], salt: int = 0) -> torch.Tensor:
        return _values(s, step, global_rank, shape, dt, salt)

    k = op.kind
    if k in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "barrier"):
        return [v((op.numel,))]
    if k == "all_gather_uneven":
        return [v((op.numel + rank_in_group,))]
    if k in ("reduce_scatter", "all_to_all", "scatter"):
        return [v((op.numel,), salt=j) for j in range(n)]
    if k == "reduce_scatter_tensor":
        return [v((n * op.numel,))]
    if k == "all_to_all_single":
        return [v((sum(op.splits[rank_in_group]), 2))]
    if k in ("send_recv", "batch_isend_irecv"):
        return [v((op.numel,))]
    raise AssertionError(k)


def _red(op: Op) -> Any:
    return getattr(dist.ReduceOp, _TORCH_OPS[op.reduce_op])


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


def execute(ctx: Any, program: Program) -> list[list[torch.Tensor] | None]:
    """Run ``program`` on this rank (inside any world); per op, what this rank ends up with."""
    rank, ws = ctx.rank, ctx.world_size
    groups = {ranks: dist.new_group(list(ranks)) for ranks in program.groups}
    results: list[list[torch.Tensor] | None] = []
    for step, op in enumerate(program.ops):
        ranks = op.group_ranks(ws)
        if rank not in ranks:
            results.append(None)
            continue
        group = groups[op.ranks] if op.ranks is not None else None
        me = ranks.index(rank)
        ins = [t.to(ctx.device) for t in op_inputs(program, step, me, rank)]
        if op.kind in _EXCHANGES:
            out = _run_exchange(ctx, op, ins, group, ranks, me)
        elif op.kind in _POINT_TO_POINT:
            out = _run_point_to_point(ctx, op, ins, group, ranks, me)
        else:
            out = _run_collective(ctx, op, ins, group, ranks, me)
        results.append([t.cpu().clone() for t in out])
    return results


#: The kinds :func:`_run_exchange` and :func:`_run_point_to_point` run; :func:`_run_collective` runs the rest.
_EXCHANGES = frozenset({"all_to_all", "all_to_all_single", "gather", "scatter"})
_POINT_TO_POINT = frozenset({"send_recv", "batch_isend_irecv"})


def _run_collective(
    ctx: Any, op: Op, ins: list[torch.Tensor], group: Any, ranks: tuple[int, ...], me: int
) -> list[torch.Tensor]:
    """One reduction, broadcast, gather to all, reduce-scatter or barrier on this rank (index ``me`` of
    ``ranks``, the op's group); what this rank ends up with."""
    n, a, k = len(ranks), op.async_op, op.kind
    out: list[torch.Tensor]
    if k == "all_reduce":
        _wait(dist.all_reduce(ins[0], op=_red(op), group=group, async_op=a))
        out = ins
    elif k == "broadcast":
        _wait(dist.broadcast(ins[0], src=ranks[op.root], group=group, async_op=a))
        out = ins
    elif k == "reduce":
        _wait(dist.reduce(ins[0], dst=ranks[op.root], op=_red(op), group=group, async_op=a))
        out = ins if me == op.root else []
    elif k in ("all_gather", "all_gather_uneven"):
        sizes = [op.numel + (j if k == "all_gather_uneven" else 0) for j in range(n)]
        out = [torch.empty(sz, dtype=op.torch_dtype, device=ctx.device) for sz in sizes]
        _wait(dist.all_gather(out, ins[0], group=group, async_op=a))
    elif k == "all_gather_into_tensor":
        out = [torch.empty(n * op.numel, dtype=op.torch_dtype, device=ctx.device)]
        _wait(dist.all_gather_into_tensor(out[0], ins[0], group=group, async_op=a))
    elif k == "reduce_scatter":
        out = [torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device)]
        _wait(dist.reduce_scatter(out[0], ins, op=_red(op), group=group, async_op=a))
    elif k == "reduce_scatter_tensor":
        out = [torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device)]
        _wait(dist.reduce_scatter_tensor(out[0], ins[0], op=_red(op), group=group, async_op=a))
    elif k == "barrier":
        _wait(dist.barrier(group=group, async_op=a))
        out = []
    else:  # pragma: no cover - Program validates kinds
        raise AssertionError(k)
    return out


def _run_exchange(
    ctx: Any, op: Op, ins: list[torch.Tensor], group: Any, ranks: tuple[int, ...], me: int
) -> list[torch.Tensor]:
    """One all-to-all, gather or scatter on this rank (index ``me`` of ``ranks``); what it ends up with."""
    n, a, k = len(ranks), op.async_op, op.kind
    out: list[torch.Tensor]
    if k == "all_to_all":
        out = [torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device) for _ in range(n)]
        _wait(dist.all_to_all(out, ins, group=group, async_op=a))
    elif k == "all_to_all_single":
        recv = [op.splits[i][me] for i in range(n)]
        out = [torch.empty(sum(recv), 2, dtype=op.torch_dtype, device=ctx.device)]
        _wait(
            dist.all_to_all_single(
                out[0], ins[0], output_split_sizes=recv, input_split_sizes=list(op.splits[me]),
                group=group, async_op=a,
            )
        )
    elif k == "gather":
        out = [torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device) for _ in range(n)] if me == op.root else []
        _wait(dist.gather(ins[0], gather_list=out if me == op.root else None, dst=ranks[op.root], group=group, async_op=a))
    elif k == "scatter":
        out = [torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device)]
        _wait(dist.scatter(out[0], scatter_list=ins if me == op.root else None, src=ranks[op.root], group=group, async_op=a))
    else:  # pragma: no cover - execute dispatches only these kinds here
        raise AssertionError(k)
    return out


def _run_point_to_point(
    ctx: Any, op: Op, ins: list[torch.Tensor], group: Any, ranks: tuple[int, ...], me: int
) -> list[torch.Tensor]:
    """One send/recv pair or one ring of batched isend/irecv on this rank (index ``me`` of ``ranks``);
    what it ends up with (a receiver its buffer, a sender nothing)."""
    n, a = len(ranks), op.async_op
    if op.kind == "send_recv":
        out: list[torch.Tensor] = []
        if me == op.root:
            _wait(dist.isend(ins[0], dst=ranks[op.peer], group=group) if a else dist.send(ins[0], dst=ranks[op.peer], group=group))
        elif me == op.peer:
            buf = torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device)
            if a:
                _wait(dist.irecv(buf, src=ranks[op.root], group=group))
            else:
                dist.recv(buf, src=ranks[op.root], group=group)  # returns the sender's rank
            out = [buf]
        return out
    # batch_isend_irecv: a ring, every rank sends to the next and receives from the previous, all posted at once.
    buf = torch.empty(op.numel, dtype=op.torch_dtype, device=ctx.device)
    p2p = [
        dist.P2POp(dist.isend, ins[0], ranks[(me + 1) % n], group),
        dist.P2POp(dist.irecv, buf, ranks[(me - 1) % n], group),
    ]
    for work in dist.batch_isend_irecv(p2p) if n > 1 else []:
        work.wait()
    return [buf] if n > 1 else []


def _reduce(op: str, ts: list[torch.Tensor]) -> torch.Tensor:
    from dstest.worlds.collectives import reduce_tensors

    return reduce_tensors(op, ts)


def reference(program: Program) -> list[list[list[torch.Tensor] | None]]:
    """What every rank must hold after each op: ``reference(p)[rank][step]``, computed with plain torch."""
    ws = program.world_size
    out: list[list[list[torch.Tensor] | None]] = [[] for _ in range(ws)]
    for step, op in enumerate(program.ops):
        ranks = op.group_ranks(ws)
        n = len(ranks)
        ins = {r: op_inputs(program, step, i, r) for i, r in enumerate(ranks)}
        k = op.kind
        for r in range(ws):
            if r not in ranks:
                out[r].append(None)
                continue
            me = ranks.index(r)
            res: list[torch.Tensor]
            if k == "all_reduce":
                res = [_reduce(op.reduce_op, [ins[q][0] for q in ranks])]
            elif k == "broadcast":
                res = [ins[ranks[op.root]][0]]
            elif k == "reduce":
                res = [_reduce(op.reduce_op, [ins[q][0] for q in ranks])] if me == op.root else []
            elif k in ("all_gather", "all_gather_uneven"):
                res = [ins[q][0] for q in ranks]
            elif k == "all_gather_into_tensor":
                res = [torch.cat([ins[q][0] for q in ranks])]
            elif k == "reduce_scatter":
                res = [_reduce(op.reduce_op, [ins[q][me] for q in ranks])]
            elif k == "reduce_scatter_tensor":
                full = _reduce(op.reduce_op, [ins[q][0] for q in ranks])
                res = [full[me * op.numel : (me + 1) * op.numel]]
            elif k == "all_to_all":
                res = [ins[q][me] for q in ranks]
            elif k == "all_to_all_single":
                pieces = []
                for i, q in enumerate(ranks):
                    start = sum(op.splits[i][:me])
                    pieces.append(ins[q][0][start : start + op.splits[i][me]])
                res = [torch.cat(pieces)]
            elif k == "gather":
                res = [ins[q][0] for q in ranks] if me == op.root else []
            elif k == "scatter":
                res = [ins[ranks[op.root]][me]]
            elif k == "send_recv":
                res = [ins[ranks[op.root]][0]] if me == op.peer else []
            elif k == "batch_isend_irecv":
                res = [ins[ranks[(me - 1) % n]][0]] if n > 1 else []
            elif k == "barrier":
                res = []
            else:  # pragma: no cover
                raise AssertionError(k)
            out[r].append([t.clone() for t in res])
    return out
