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

What ranks must agree on is what gloo and NCCL need (SPEC E2): the op, the reduce op, the root, the dtype,
the device and the element count of each buffer (and the split sizes of ``all_to_all_single``); not the
shape. Both backends move flat buffers: a ``[2, 1, 1]`` tensor broadcast into ``[2]`` on its peers, or a 0-d
tensor all-reduced with a ``[1]``, is a correct program on both (DeepSpeed's pipeline engine does the
first). The shapes still show in every call's description and trace. ``strict_shapes`` (a run option,
``--dstest-strict-shapes``) also refuses calls whose shapes differ.

The module is longer than most (about 600 lines) on purpose: it is one table, a small class per c10d
collective with the same four steps, which both the threaded world's session and the process world's
referee read; splitting it would scatter one contract over several files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from dstest.errors import CollectiveMismatch, InvalidArgument

__all__ = [
    "CALLS",
    "Call",
    "PremulSum",
    "check_reduce",
    "copy_flat",
    "copy_tensors",
    "describe_tensor",
    "reduce_into",
    "reduce_tensors",
]


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair; many small tensors in one call of torch's foreach copy."""
    srcs = [s if s.shape == d.shape else s.reshape(d.shape) for d, s in zip(dsts, srcs)]  # flat buffers
    if len(dsts) > 8:
        try:
            torch._foreach_copy_(list(dsts), srcs)
            return
        except (RuntimeError, TypeError):
            pass  # mixed devices or dtypes it does not take: one copy at a time (raises what copy_ raises)
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device.type}"


def _sum_step(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.logical_or_(t) if out.dtype == torch.bool else out.add_(t)


def _product_step(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.logical_and_(t) if out.dtype == torch.bool else out.mul_(t)


# One in-place step per reduce op; "avg" is "sum" then a division. Reductions fold in rank order into
# one tensor: no stacked copy of every rank's input.
_STEPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": _sum_step,
    "product": _product_step,
    "min": lambda out, t: torch.minimum(out, t, out=out),
    "max": lambda out, t: torch.maximum(out, t, out=out),
    "band": lambda out, t: out.bitwise_and_(t),
    "bor": lambda out, t: out.bitwise_or_(t),
    "bxor": lambda out, t: out.bitwise_xor_(t),
}
_INTEGRAL_ONLY = frozenset({"band", "bor", "bxor"})
_REDUCE_OPS = frozenset({*_STEPS, "avg", "premul_sum"})


class PremulSum(str):
    """The reduce op ``"premul_sum"`` with the calling rank's factor: every rank's input times its own factor,
    summed (NCCL's ``ncclRedOpCreatePreMulSum``; FSDP2 uses it after ``set_gradient_divide_factor``). Equal
    to ``"premul_sum"`` whatever the factor, so ranks match on the op as NCCL matches them."""

    factor: Any

    def __new__(cls, factor: Any) -> PremulSum:
        self = super().__new__(cls, "premul_sum")
        self.factor = factor
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (PremulSum, (self.factor,))


def _premul(op: str | None, t: torch.Tensor) -> torch.Tensor:
    """A rank's operand of a reduction: its input, times its factor under ``premul_sum``."""
    if isinstance(op, PremulSum):
        factor = op.factor.to(t.device) if isinstance(op.factor, torch.Tensor) else op.factor
        return (t.detach() * factor).to(t.dtype)
    return t


def check_reduce(op: str, dtype: torch.dtype) -> None:
    """Raise InvalidArgument when reduce op ``op`` cannot reduce tensors of ``dtype``."""
    if op not in _REDUCE_OPS:
        raise InvalidArgument(
            f"reduce op {op!r} is not supported by the threaded world; allowed: {sorted(_REDUCE_OPS)}"
        )
    if op in _INTEGRAL_ONLY and (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(f"reduce op {op!r} on dtype={dtype}: only integer and bool tensors allowed")
    if op == "premul_sum" and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(f"reduce op 'premul_sum' on dtype={dtype}: only floating-point tensors allowed (as NCCL)")


def reduce_into(op: str, out: torch.Tensor, others: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """Fold ``others`` into ``out`` (which holds the first operand) in rank order; ``count`` operands in
    all. Returns the tensor holding the result: ``out``, or a new one where the result's dtype differs
    (integer "avg"). The op must have passed :func:`check_reduce`."""
    step = _STEPS["sum" if op in ("avg", "premul_sum") else op]
    for t in others:
        t = t.detach()
        step(out, t if t.shape == out.shape else t.reshape(out.shape))
    if op != "avg":
        return out
    if out.dtype.is_floating_point or out.dtype.is_complex:
        return out.div_(count)
    return torch.div(out, count, rounding_mode="trunc")


def reduce_tensors(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reduce same-shaped tensors, in rank order, with a c10d reduce op name ('sum', 'avg', 'min', ...)."""
    check_reduce(op, tensors[0].dtype)
    return reduce_into(op, tensors[0].detach().clone(), tensors[1:], len(tensors))


#: Messages from this size up are read in place (no staging copy) where no output aliases an input;
#: below it the staging copy costs less than the aliasing checks.
IN_PLACE_BYTES = 1 << 16


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def _outputs_apart(outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]) -> bool:
    """Whether the outputs share storage with no other output and no input (then writing one output
    cannot change anything another rank's result is read from)."""
    mine = [_storage(o) for o in outs]
    if None in mine or len(set(mine)) != len(mine):
        return False
    theirs = {_storage(i) for i in inps}
    return None not in theirs and not theirs.intersection(mine)


def _large(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() >= IN_PLACE_BYTES


class Call:
    """One rank's side of one collective."""

    op: ClassVar[str] = "?"
    reduce_op: str | None = None
    root: int | None = None
    #: Whether ranks' shapes must be equal too, not only their element counts (set by the world per run).
    strict_shapes: bool = False

    def __init__(self, group_rank: int, group_size: int) -> None:
        self.group_rank = group_rank
        self.group_size = group_size

    # -- description -------------------------------------------------------------------------------
    def details(self) -> str:
        return ""

    def describe(self) -> str:
        extra = [self.details()]
        if self.reduce_op is not None:
            extra.append(f"op={self.reduce_op}")
        if self.root is not None:
            extra.append(f"root={self.root}")
        return f"{self.op}({', '.join(e for e in extra if e)})"

    # -- validation --------------------------------------------------------------------------------
    def check_local(self) -> None:
        """Raise InvalidArgument for sizes that are wrong on this rank alone."""

    def key(self) -> tuple[Any, ...]:
        """What every rank must agree on (compared against the first arrival)."""
        return (self.op, self.reduce_op, self.root)

    def sig(self, t: torch.Tensor) -> tuple[Any, ...]:
        """What a buffer of this call must share with its peers' (see :func:`_sig`)."""
        return _sig(t, self.strict_shapes)

    def check_peer(self, first: Call) -> str | None:
        """Return why this call cannot match ``first``, or None."""
        if type(self) is not type(first):
            return "different collectives"
        if self.key() != first.key():
            return "different arguments"
        return None

    def check_all(self, calls: Sequence[Call]) -> str | None:
        """Checks that need every rank's call (pairings of all_to_all, per-rank gather sizes)."""
        return None

    # -- data ----------------------------------------------------------------------------------------
    def combine(self, calls: Sequence[Call]) -> list[Any]:
        return [None] * len(calls)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        """Steps 3 and 4 for every rank (by the last to arrive, grad mode off). Returns the group ranks
        whose own output could not be written, with the error (each is raised on that rank only)."""
        failed: dict[int, BaseException] = {}
        for call, source in zip(calls, self.combine(calls)):
            try:
                call.finish(source)
            except Exception as exc:  # a copy that fails (device, dtype) fails that rank's wait
                failed[call.group_rank] = exc
        return failed

    def finish(self, source: Any) -> None:
        """Copy this rank's result from ``source`` into its output tensors."""

    def outputs(self) -> list[torch.Tensor]:
        return []


def _shapes(ts: Sequence[torch.Tensor]) -> str:
    return "[" + ", ".join(describe_tensor(t) for t in ts) + "]"


def _sig(t: torch.Tensor, strict: bool = True) -> tuple[Any, ...]:
    """What two ranks' buffers must share: dtype, device type and the shape (``strict``) or only the
    element count (what gloo and NCCL compare)."""
    return (t.dtype, tuple(t.shape) if strict else t.numel(), t.device.type)


def copy_flat(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors with the same number of elements, whatever their shapes (a flat buffer,
    as gloo and NCCL move it)."""
    dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgument(f"{what}: expected exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


class AllReduce(Call):
    op = "all_reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str) -> None:
        super().__init__(group_rank, group_size)
        self.tensor = tensor
        self.reduce_op = reduce_op

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        if self.reduce_op not in _REDUCE_OPS:
            raise InvalidArgument(f"all_reduce op={self.reduce_op!r}; allowed: {sorted(_REDUCE_OPS)}")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.tensor))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        result = reduce_tensors(self.reduce_op, [_premul(c.reduce_op, c.tensor) for c in calls])  # type: ignore[attr-defined]
        return [result] * len(calls)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        ts: list[torch.Tensor] = [c.tensor for c in calls]  # type: ignore[attr-defined]
        first = ts[0]
        if self.reduce_op == "premul_sum" or not (first.is_contiguous() and _outputs_apart(ts, ())):
            return super().deliver(calls)
        # In place at every size (the aliasing check costs less than the staging copy; a group of one
        # rank then moves nothing): fold into rank 0's tensor, whose own input is the first operand, then
        # copy it out. Tensors that share storage across ranks take the staged path.
        assert self.reduce_op is not None
        check_reduce(self.reduce_op, first.dtype)
        result = reduce_into(self.reduce_op, first, ts[1:], len(ts))
        if result is not first:
            first.copy_(result)
        for t in ts[1:]:
            copy_flat(t, first)
        return {}

    def finish(self, source: Any) -> None:
        copy_flat(self.tensor, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class Reduce(AllReduce):
    op = "reduce"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, reduce_op: str, root: int) -> None:
        super().__init__(group_rank, group_size, tensor, reduce_op)
        self.root = root

    def check_local(self) -> None:
        super().check_local()
        _check_root(self)

    # Only the root's tensor may change, and the fold starts from rank 0's input: staged.
    deliver = Call.deliver

    def finish(self, source: Any) -> None:
        if self.group_rank == self.root:
            copy_flat(self.tensor, source)


def _check_root(call: Call) -> None:
    assert call.root is not None
    if not 0 <= call.root < call.group_size:
        raise InvalidArgument(
            f"{call.op}: root={call.root} is not a rank of the group (group ranks 0..{call.group_size - 1})"
        )


class Broadcast(Call):
    op = "broadcast"

    def __init__(self, group_rank: int, group_size: int, tensor: torch.Tensor, root: int) -> None:
        super().__init__(group_rank, group_size)
        self.tensor = tensor
        self.root = root

    def details(self) -> str:
        return describe_tensor(self.tensor)

    def check_local(self) -> None:
        _check_root(self)

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.tensor))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        src = calls[self.root].tensor.detach().clone()  # type: ignore[attr-defined]
        return [src] * len(calls)

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        assert self.root is not None
        src: torch.Tensor = calls[self.root].tensor  # type: ignore[attr-defined]
        others = [c for c in calls if c.group_rank != self.root]
        if not _outputs_apart([c.tensor for c in others], [src]):  # type: ignore[attr-defined]
            return super().deliver(calls)
        failed: dict[int, BaseException] = {}
        for c in others:  # straight from the root's tensor: no staging copy
            try:
                copy_flat(c.tensor, src)  # type: ignore[attr-defined]
            except Exception as exc:
                failed[c.group_rank] = exc
        return failed

    def finish(self, source: Any) -> None:
        if self.group_rank != self.root:
            copy_flat(self.tensor, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class _IntoList(Call):
    """Every rank's input, copied into this rank's output list (all_gather; gather on the root)."""

    inp: torch.Tensor
    outs: list[torch.Tensor]

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        srcs = [c.inp.detach().clone() for c in calls]  # type: ignore[attr-defined]
        return [srcs] * len(calls)

    def finish(self, source: Any) -> None:
        copy_tensors(self.outs, source)

    def outputs(self) -> list[torch.Tensor]:
        return self.outs


class AllGather(_IntoList):
    """all_gather into a list; ranks may contribute different shapes (NCCL and this world accept it)."""

    op = "all_gather"

    def __init__(self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inp = inp

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}, out={_shapes(self.outs)}"

    def check_local(self) -> None:
        if len(self.outs) != self.group_size:
            raise InvalidArgument(
                f"all_gather: output list has {len(self.outs)} tensors, the group has {self.group_size} ranks"
            )
        mine = self.outs[self.group_rank]
        if mine.shape != self.inp.shape or mine.dtype != self.inp.dtype:
            raise InvalidArgument(
                f"all_gather: output[{self.group_rank}] is {describe_tensor(mine)} but this rank's input "
                f"is {describe_tensor(self.inp)}"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inp.dtype, tuple(self.sig(o)[1] for o in self.outs))

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, c in enumerate(calls):
            want, sent = self.outs[i], c.inp  # type: ignore[attr-defined]
            if self.sig(sent)[1] != self.sig(want)[1]:
                what = f"shape {list(want.shape)}" if self.strict_shapes else f"{want.numel()} elements"
                return f"rank {i} sends {describe_tensor(sent)} but output[{i}] expects {what}"
        return None



class _SingleTensorCall(Call):
    """A collective over one input and one output tensor, one of them group-size times the other."""

    def __init__(self, group_rank: int, group_size: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inp = inp

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}, out={describe_tensor(self.out)}"

    def _check_scaled(self, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor) -> None:
        if big.numel() != small.numel() * self.group_size:
            raise InvalidArgument(
                f"{self.op}: {big_name} has {big.numel()} elements, expected group size {self.group_size} "
                f"x {small_name} {small.numel()} = {small.numel() * self.group_size}"
            )
        if self.out.dtype != self.inp.dtype:
            raise InvalidArgument(f"{self.op}: output dtype {self.out.dtype} != input dtype {self.inp.dtype}")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.inp), self.sig(self.out))

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class AllGatherIntoTensor(_SingleTensorCall):
    op = "all_gather_into_tensor"

    def check_local(self) -> None:
        self._check_scaled("output", self.out, "input", self.inp)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        flat = torch.cat([c.inp.detach().reshape(-1) for c in calls])  # type: ignore[attr-defined]
        return [flat] * len(calls)

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        outs: list[torch.Tensor] = [c.out for c in calls]  # type: ignore[attr-defined]
        inps: list[torch.Tensor] = [c.inp.detach() for c in calls]  # type: ignore[attr-defined]
        inside = self._inputs_in_own_output(outs, inps) if _large(self.inp) else None
        if inside is None:
            return super().deliver(calls)
        n = self.inp.numel()
        for k, out in enumerate(outs):  # every input read in place, every output written once
            flat = out.view(-1)
            if k not in inside:
                torch.cat([i.reshape(-1) for i in inps], out=flat)
                continue
            for i, inp in enumerate(inps):
                if i != k:
                    flat[i * n : (i + 1) * n].copy_(inp.reshape(-1))
        return {}

    @staticmethod
    def _inputs_in_own_output(outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]) -> set[int] | None:
        """The ranks whose input is their own output's chunk (FSDP's in-place all-gather), or None when
        reading inputs in place is unsafe (an input inside another rank's output, or outputs that share
        storage or are not contiguous)."""
        stores = [_storage(o) for o in outs]
        if None in stores or len(set(stores)) != len(stores) or not all(o.is_contiguous() for o in outs):
            return None
        inside: set[int] = set()
        for i, inp in enumerate(inps):
            s = _storage(inp)
            if s is None:
                return None
            if s in stores:
                chunk = outs[i].data_ptr() + i * inp.numel() * inp.element_size()
                if s != stores[i] or not inp.is_contiguous() or inp.data_ptr() != chunk:
                    return None
                inside.add(i)
        return inside


class ReduceScatter(Call):
    op = "reduce_scatter"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inps: Sequence[torch.Tensor], reduce_op: str
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inps = list(inps)
        self.reduce_op = reduce_op

    def details(self) -> str:
        return f"in={_shapes(self.inps)}, out={describe_tensor(self.out)}"

    def check_local(self) -> None:
        if len(self.inps) != self.group_size:
            raise InvalidArgument(
                f"reduce_scatter: input list has {len(self.inps)} tensors, the group has {self.group_size} ranks"
            )
        mine = self.inps[self.group_rank]
        if _sig(mine) != _sig(self.out):
            raise InvalidArgument(
                f"reduce_scatter: output is {describe_tensor(self.out)} but input[{self.group_rank}] is "
                f"{describe_tensor(mine)}"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), tuple(self.sig(t) for t in self.inps))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        return [
            reduce_tensors(self.reduce_op, [_premul(c.reduce_op, c.inps[j]) for c in calls])  # type: ignore[attr-defined]
            for j in range(len(calls))
        ]

    def finish(self, source: Any) -> None:
        copy_flat(self.out, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class ReduceScatterTensor(_SingleTensorCall):
    op = "reduce_scatter_tensor"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inp: torch.Tensor, reduce_op: str
    ) -> None:
        super().__init__(group_rank, group_size, out, inp)
        self.reduce_op = reduce_op

    def check_local(self) -> None:
        self._check_scaled("input", self.inp, "output", self.out)

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.reduce_op is not None
        n = self.out.numel()
        flat = reduce_tensors(self.reduce_op, [_premul(c.reduce_op, c.inp.reshape(-1)) for c in calls])  # type: ignore[attr-defined]
        return [flat[j * n : (j + 1) * n] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))

    def deliver(self, calls: Sequence[Call]) -> dict[int, BaseException]:
        outs: list[torch.Tensor] = [c.out for c in calls]  # type: ignore[attr-defined]
        inps: list[torch.Tensor] = [c.inp for c in calls]  # type: ignore[attr-defined]
        if self.reduce_op == "premul_sum" or not (
            _large(self.out) and all(o.is_contiguous() for o in outs) and _outputs_apart(outs, inps)
        ):
            return super().deliver(calls)
        assert self.reduce_op is not None
        check_reduce(self.reduce_op, self.inp.dtype)
        n = self.out.numel()
        flats = [i.detach().reshape(-1) for i in inps]
        for j, out in enumerate(outs):  # rank j's chunk of every input, folded in rank order into its output
            o = out.view(-1)
            o.copy_(flats[0][j * n : (j + 1) * n])
            result = reduce_into(self.reduce_op, o, [f[j * n : (j + 1) * n] for f in flats[1:]], len(flats))
            if result is not o:
                o.copy_(result)
        return {}


class AllToAll(Call):
    op = "all_to_all"

    def __init__(
        self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]
    ) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inps = list(inps)

    def details(self) -> str:
        return f"in={_shapes(self.inps)}, out={_shapes(self.outs)}"

    def check_local(self) -> None:
        if len(self.outs) != self.group_size or len(self.inps) != self.group_size:
            raise InvalidArgument(
                f"all_to_all: {len(self.inps)} inputs and {len(self.outs)} outputs, the group has "
                f"{self.group_size} ranks (one of each per rank)"
            )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inps[0].dtype if self.inps else None)

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, src in enumerate(calls):
            for j, dst in enumerate(calls):
                sent, slot = src.inps[j], dst.outs[i]  # type: ignore[attr-defined]
                if self.sig(sent) != self.sig(slot):
                    return f"rank {i} sends {describe_tensor(sent)} to rank {j}, whose output[{i}] is {describe_tensor(slot)}"
        return None

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        copies = [[t.detach().clone() for t in c.inps] for c in calls]  # type: ignore[attr-defined]
        return [[copies[i][j] for i in range(len(calls))] for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        copy_tensors(self.outs, source)

    def outputs(self) -> list[torch.Tensor]:
        return self.outs


class AllToAllSingle(Call):
    op = "all_to_all_single"

    def __init__(
        self,
        group_rank: int,
        group_size: int,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inp = inp
        self.out_splits = self._splits(list(out_splits), out, "output")
        self.in_splits = self._splits(list(in_splits), inp, "input")

    def _splits(self, splits: list[int], t: torch.Tensor, what: str) -> list[int]:
        if not splits:
            rows = t.shape[0] if t.dim() else 0
            if rows % self.group_size:
                raise InvalidArgument(
                    f"all_to_all_single: {what} dim 0 is {rows}, not divisible by the group size "
                    f"{self.group_size}; pass {what}_split_sizes"
                )
            return [rows // self.group_size] * self.group_size
        if len(splits) != self.group_size:
            raise InvalidArgument(
                f"all_to_all_single: {what}_split_sizes has {len(splits)} entries, the group has {self.group_size} ranks"
            )
        if sum(splits) != (t.shape[0] if t.dim() else 0):
            raise InvalidArgument(
                f"all_to_all_single: {what}_split_sizes={splits} sum to {sum(splits)}, but the {what} "
                f"has {t.shape[0] if t.dim() else 0} rows"
            )
        return splits

    def details(self) -> str:
        return (
            f"in={describe_tensor(self.inp)} splits={self.in_splits}, "
            f"out={describe_tensor(self.out)} splits={self.out_splits}"
        )

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.inp.dtype, tuple(self.inp.shape[1:]))

    def check_all(self, calls: Sequence[Call]) -> str | None:
        for i, src in enumerate(calls):
            for j, dst in enumerate(calls):
                if src.in_splits[j] != dst.out_splits[i]:  # type: ignore[attr-defined]
                    return (
                        f"rank {i} sends {src.in_splits[j]} rows to rank {j}, "  # type: ignore[attr-defined]
                        f"which expects {dst.out_splits[i]}"  # type: ignore[attr-defined]
                    )
        return None

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        pieces = [list(torch.split(c.inp.detach().clone(), c.in_splits)) for c in calls]  # type: ignore[attr-defined]
        return [torch.cat([pieces[i][j] for i in range(len(calls))]) for j in range(len(calls))]

    def finish(self, source: Any) -> None:
        self.out.copy_(source.view(self.out.shape))

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class Gather(_IntoList):
    op = "gather"

    def __init__(
        self, group_rank: int, group_size: int, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int
    ) -> None:
        super().__init__(group_rank, group_size)
        self.outs = list(outs)
        self.inp = inp
        self.root = root

    def details(self) -> str:
        return f"in={describe_tensor(self.inp)}" + (f", out={_shapes(self.outs)}" if self.outs else "")

    def check_local(self) -> None:
        _check_root(self)
        if self.group_rank == self.root and len(self.outs) != self.group_size:
            raise InvalidArgument(
                f"gather: gather_list on the root has {len(self.outs)} tensors, the group has {self.group_size} ranks"
            )
        if self.group_rank != self.root and self.outs:
            raise InvalidArgument("gather: gather_list must be None on ranks other than the root")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.inp))



class Scatter(Call):
    op = "scatter"

    def __init__(
        self, group_rank: int, group_size: int, out: torch.Tensor, inps: Sequence[torch.Tensor], root: int
    ) -> None:
        super().__init__(group_rank, group_size)
        self.out = out
        self.inps = list(inps)
        self.root = root

    def details(self) -> str:
        return f"out={describe_tensor(self.out)}" + (f", in={_shapes(self.inps)}" if self.inps else "")

    def check_local(self) -> None:
        _check_root(self)
        if self.group_rank == self.root:
            if len(self.inps) != self.group_size:
                raise InvalidArgument(
                    f"scatter: scatter_list on the root has {len(self.inps)} tensors, the group has "
                    f"{self.group_size} ranks"
                )
            bad = [i for i, t in enumerate(self.inps) if _sig(t) != _sig(self.out)]
            if bad:
                raise InvalidArgument(
                    f"scatter: scatter_list[{bad[0]}] is {describe_tensor(self.inps[bad[0]])}, the output is "
                    f"{describe_tensor(self.out)}"
                )
        elif self.inps:
            raise InvalidArgument("scatter: scatter_list must be None on ranks other than the root")

    def key(self) -> tuple[Any, ...]:
        return (*super().key(), self.sig(self.out))

    def combine(self, calls: Sequence[Call]) -> list[Any]:
        assert self.root is not None
        return [t.detach().clone() for t in calls[self.root].inps]  # type: ignore[attr-defined]

    def finish(self, source: Any) -> None:
        copy_flat(self.out, source)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]


class Barrier(Call):
    op = "barrier"


CALLS: dict[str, type[Call]] = {
    cls.op: cls
    for cls in (
        AllReduce,
        Reduce,
        Broadcast,
        AllGather,
        AllGatherIntoTensor,
        ReduceScatter,
        ReduceScatterTensor,
        AllToAll,
        AllToAllSingle,
        Gather,
        Scatter,
        Barrier,
    )
}


def mismatch(op_desc: str, a_rank: int, a: Call, b_rank: int, b: Call, why: str) -> CollectiveMismatch:
    return CollectiveMismatch(
        f"{op_desc}: rank {a_rank} called {a.describe()} but rank {b_rank} called {b.describe()} ({why})"
    )
