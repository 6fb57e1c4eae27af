"""What every collective shares: the ``Call`` base class, buffer copies, reductions, aliasing checks.

Split from the per-collective classes (:mod:`.reducing`, :mod:`.gathering`) so that each file stays one
readable unit; :mod:`dstest.worlds.collectives` re-exports every name (``C.AllReduce``, ``C.reduce_tensors``).
The signature two ranks' buffers must share and the description of a buffer are the checking core's
(:mod:`dstest.worlds.core.matching`), which compares them without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from dstest.errors import InvalidArgument
from dstest.worlds.core.matching import describe_tensor
from dstest.worlds.core.matching import signature as _sig

# the module, not the package: the package imports this one
from dstest.worlds.torch_internals.raw_writes import below_autograd, foreach_copy, set_version_counters

__all__ = [
    "IN_PLACE_BYTES",
    "Call",
    "PremulSum",
    "bump_versions",
    "check_reduce",
    "copy_flat",
    "copy_tensors",
    "describe_tensor",
    "flat_view",
    "raw_writes",
    "reduce_into",
    "reduce_tensors",
    "storages_apart",
]


def raw_writes() -> Any:
    """A context in which tensors are written as a backend's C++ writes them: below autograd and its view
    and version bookkeeping (``torch._C._AutoDispatchBelowADInplaceOrView``).

    gloo and NCCL write results through raw pointers, so autograd never sees the write: a split view of a
    parameter takes an all-gather's result whatever the grad mode of the thread that completes the work,
    and a tensor saved for backward is not marked as changed. Every copy of a collective's data in the
    threaded world runs in this context; where gloo's C++ does copy through torch's dispatcher, the
    version change that copy makes is applied afterwards (:meth:`Call.bump_versions`)."""
    return below_autograd()


def bump_versions(tensors: Sequence[torch.Tensor], times: int, *, apart: bool = False) -> None:
    """Move each tensor's version counter on by ``times``, as that many in-place writes would (autograd then
    refuses a backward through a saved tensor the write changed, as it does after gloo's copies). Tensors
    that are views of one base share its counter, and each write counts: one tensor at a time, unless the
    caller knows them ``apart`` (one output per rank), then in one call. Inference tensors keep no counter."""
    if not times:
        return
    ts = [t for t in tensors if not t.is_inference()]
    if apart:
        set_version_counters(tuple(ts), tuple(t._version + times for t in ts))
        return
    for t in ts:
        set_version_counters((t,), (t._version + times,))


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the bytes the backends move: a bool tensor as uint8. torch's copies and clones of bools write
    0 or 1 whatever the byte held; gloo and NCCL copy the byte, and sum bools as bytes (0x03 for three
    Trues): copied as bytes, a bool result reaches every rank with gloo's bits."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, as bytes (:func:`raw`); many small tensors in one call of torch's
    foreach copy."""
    bool_ = torch.bool  # raw(), inline: no Python call per tensor (a list all_gather copies W^2 of them)
    dsts = [d.view(torch.uint8) if d.dtype == bool_ else d for d in dsts]
    srcs = [s if s.shape == d.shape else s.reshape(d.shape) for d, s in zip(dsts, srcs)]  # flat buffers
    srcs = [s.view(torch.uint8) if s.dtype == bool_ else s for s in srcs]
    if len(dsts) > 8:
        try:
            foreach_copy(list(dsts), srcs)
            return
        except (RuntimeError, TypeError):
            pass  # mixed devices or dtypes it does not take: one copy at a time (raises what copy_ raises)
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _sum_step(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # gloo (and NCCL, as uint8) sums bools as bytes: three Trues give the byte 0x03, still True to torch but
    # other bits, which a bit-for-bit comparison (crosscheck, replicas) sees; 256 of them wrap to 0.
    if out.dtype == torch.bool:
        out.view(torch.uint8).add_(t.view(torch.uint8))
        return out
    return out.add_(t)


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
REDUCE_OPS = frozenset({*_STEPS, "avg", "premul_sum"})


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


def premultiplied(op: str | None, t: torch.Tensor) -> torch.Tensor:
    """A rank's operand of a reduction: its input, times its factor under ``premul_sum``."""
    if isinstance(op, PremulSum):
        factor = op.factor.to(t.device) if isinstance(op.factor, torch.Tensor) else op.factor
        return (t.detach() * factor).to(t.dtype)
    return t


def check_reduce(op: str, dtype: torch.dtype) -> None:
    """Raise InvalidArgument when reduce op ``op`` cannot reduce tensors of ``dtype``."""
    if op not in REDUCE_OPS:
        raise InvalidArgument(
            f"reduce op {op!r} is not supported by the threaded world; allowed: {sorted(REDUCE_OPS)}"
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
        if t.requires_grad:  # only then is a detached alias any different
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
    first = tensors[0]
    first = first.detach() if first.requires_grad else first
    return reduce_into(op, raw(first).clone().view(first.dtype), tensors[1:], len(tensors))


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat buffer (itself when it is one already: one op less per rank in a small collective)."""
    return t if t.dim() == 1 else t.reshape(-1)


#: Messages from this size up are read in place (no staging copy) where no output aliases an input;
#: below it the staging copy costs less than the aliasing checks.
IN_PLACE_BYTES = 1 << 16


def _storage_ptr(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts: tensors share a storage exactly when this is equal (a zero-size storage
    may be 0 for several: they count as shared, the safe answer). Read without building the storage object
    ``untyped_storage()`` makes, which costs more than the rest of a small collective's checks."""
    return int(t.data_ptr() - t.storage_offset() * t.element_size())


def storage_of(t: torch.Tensor) -> int | None:
    try:
        return _storage_ptr(t)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def outputs_apart(outs: Sequence[torch.Tensor], inps: Sequence[torch.Tensor]) -> bool:
    """Whether the outputs share storage with no other output and no input (then writing one output
    cannot change anything another rank's result is read from)."""
    try:  # one storage pointer per tensor (sparse and other storage-less layouts raise: not apart)
        mine = {_storage_ptr(o) for o in outs}
        if len(mine) != len(outs):
            return False
        return not any(_storage_ptr(i) in mine for i in inps)
    except (RuntimeError, NotImplementedError):
        return False


def storages_apart(ts: Sequence[torch.Tensor]) -> bool:
    """Whether no two of ``ts`` share storage (:func:`outputs_apart` with no inputs), the storage pointers
    read inline: one Python call per collective instead of one per rank (all_reduce's in-place check)."""
    seen: set[int] = set()
    try:
        for t in ts:  # a loop, not a set comprehension: no frame of its own
            seen.add(int(t.data_ptr() - t.storage_offset() * t.element_size()))
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts: not apart
        return False
    return len(seen) == len(ts)


def is_large(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() >= IN_PLACE_BYTES


class Call:
    """One rank's side of one collective."""

    op: ClassVar[str] = "?"
    #: How many times gloo's C++ copies into each output tensor through torch's dispatcher, each copy one
    #: version change (measured on torch 2.13's gloo: the gathers, reduce-scatters and the list all_to_all
    #: copy from a staging buffer; all_reduce, broadcast, reduce, scatter, all_to_all_single and
    #: point-to-point write in place and change no version).
    version_bumps: ClassVar[int] = 0
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
        """Steps 3 and 4 for every rank (by the last to arrive, in :func:`raw_writes`). Returns the group ranks
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

    def bump_versions(self, calls: Sequence[Call]) -> None:
        """After the outputs of ``calls`` (this collective's ranks whose outputs were written, in
        :func:`raw_writes`) were written: their versions change as gloo's copies change them."""
        for c in calls:
            bump_versions(c.outputs(), self.version_bumps)


def shapes_text(ts: Sequence[torch.Tensor]) -> str:
    return "[" + ", ".join(describe_tensor(t) for t in ts) + "]"


def copy_flat(dst: torch.Tensor, src: torch.Tensor, *, as_bytes: bool = True) -> None:
    """``dst.copy_(src)`` for tensors with the same number of elements, whatever their shapes (a flat buffer,
    as gloo and NCCL move it); as bytes (:func:`raw`) unless ``as_bytes`` is False (a bool written as 0 or 1,
    where gloo's own copy goes through torch)."""
    src = src if src.shape == dst.shape else src.reshape(dst.shape)
    if as_bytes:
        raw(dst).copy_(raw(src))
    else:
        dst.copy_(src)


def check_root(call: Call) -> None:
    assert call.root is not None
    if not 0 <= call.root < call.group_size:
        raise InvalidArgument(
            f"{call.op}: root={call.root} is not a rank of the group (group ranks 0..{call.group_size - 1})"
        )


class SingleTensorCall(Call):
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

    def bump_versions(self, calls: Sequence[Call]) -> None:
        # One output per rank (the hot all_gather_into_tensor and reduce_scatter_tensor): one call into torch.
        bump_versions([t for c in calls for t in c.outputs()], self._bumps(), apart=True)

    def _bumps(self) -> int:
        return self.version_bumps
