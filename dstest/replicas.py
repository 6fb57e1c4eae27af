"""Replica checks (G4): what must be identical on every rank of a group, compared across the group.

The quietest bugs of data-parallel code leave no error and no hang: a parameter left out of DDP's
reduction, a buffer never broadcast, a rank-dependent op in an update, a ZeRO shard applied twice, a
replicated LayerNorm weight of a tensor-parallel block whose gradient was never all-reduced. Each leaves
replicas that should be identical slightly different, and the loss curve hides it for thousands of steps.
:func:`assert_replicas` compares them, bit for bit by default, and names the first tensor that differs,
the ranks grouped by value, and the largest difference.

It is a collective: every rank of ``group`` calls it, with the same structure of tensors. It uses only
ordinary ``torch.distributed`` collectives, so it runs the same on the threaded world, the process world and
NCCL. To stay cheap it exchanges, per tensor, a digest of its bytes (SHA-256, 128 bits of it: no change of bits
can cancel out in it, as it could in a sum) and gathers a tensor's values only when digests differ. Tensors are
matched by name (a dict by key, in any order) and compared as the values they stand for (conjugate and negative
views resolved, any strides). Every rank ends with the same verdict and raises the same
:class:`~dstest.errors.ReplicasDiverge` (or, for names it cannot tell apart, the same
:class:`~dstest.errors.InvalidArgument`), so no rank is left behind in a collective.

What each layout compares:

* a plain tensor (a parameter, buffer, or an entry of a dict/list): the tensor, across ``group``;
* a DTensor: for each mesh dimension whose placement is ``Replicate`` (and whose group lies within
  ``group``), its local tensor across that dimension's group; ``Shard`` and ``Partial`` dimensions hold
  different data by design and are not compared. If the DTensor's mesh is a strict part of ``group``
  (several copies of the mesh, as with FSDP2 inside each replica of a hand-made HSDP), also its full
  tensor (``full_tensor()``, a collective over the mesh) across ``group``;
* so for FSDP2 (``fully_shard``) on a mesh that covers the group: the parameters' full tensors are one
  all-gather and equal by construction; what can drift are buffers (compared as plain tensors) and the
  replicated mesh dimensions (HSDP's replicate dimension, tensor parallel's replicated parameters);
* an ``nn.Module``: every parameter and buffer by name (a ``DistributedDataParallel`` wrapper is
  unwrapped to its ``.module``), each by the rules above.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument, ReplicasDiverge

__all__ = ["assert_replicas", "replicas_checked"]

#: How many other differing tensors the message names after the first.
_ALSO_SHOWN = 5


@dataclass
class _Entry:
    """One comparison: a tensor (or, for a full DTensor, how to make it) over one group of ranks."""

    name: str
    layout: str  # how the tensor was found: "tensor", "dtensor local (mesh dim 1)", "dtensor full"
    group: Any  # the ProcessGroup compared over
    ranks: tuple[int, ...]  # its global ranks
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None = None
    dtensor: Any = None  # a DTensor whose full_tensor() is compared (made after the structure is agreed)


@dataclass
class _Finding:
    """What differs, in a form every rank can agree on (picklable, compared by ``key``)."""

    index: int
    ranks: tuple[int, ...]
    text: str
    others: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return (self.index, self.ranks)


# -- arguments ------------------------------------------------------------------------------------------------
def _check_tolerance(rtol: object, atol: object) -> tuple[float, float]:
    out = []
    for label, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
            raise InvalidArgument(f"{label}={value!r}: must be a finite number >= 0 (0 compares bit for bit)")
        out.append(float(value))
    return out[0], out[1]


def _resolve_group(group: Any) -> tuple[Any, tuple[int, ...]]:
    if not dist.is_initialized():
        raise InvalidArgument("assert_replicas: torch.distributed is not initialized; call it inside a rank body")
    pg = dist.group.WORLD if group is None else group
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidArgument(
            f"group={group!r}: rank {dist.get_rank()} is not a member (dist.new_group gives non-members "
            "GroupMember.NON_GROUP_MEMBER); only the ranks of the group call assert_replicas (a collective over it)"
        )
    if not isinstance(pg, dist.ProcessGroup):
        raise InvalidArgument(
            f"group={group!r}: must be a torch.distributed ProcessGroup (or None for the world), "
            f"got {type(group).__name__}"
        )
    ranks = tuple(dist.get_process_group_ranks(pg))
    if dist.get_rank() not in ranks:
        raise InvalidArgument(
            f"group with ranks {list(ranks)}: rank {dist.get_rank()} is not in it; only the ranks of the group "
            "call assert_replicas (it is a collective over the group)"
        )
    return pg, ranks


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (never importing DTensor: a body that has none has not loaded it)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def _unwrap(module: Any) -> Any:
    """A DistributedDataParallel's ``.module``; any other module itself."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _named_tensors(obj: object) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """(what, [(label, tensor)]) of a module, a tensor, or a dict/list of tensors; else InvalidArgument."""
    import torch.nn as nn

    if isinstance(obj, nn.Module):
        module = _unwrap(obj)
        items = [(f"parameter {n!r}", p) for n, p in module.named_parameters()]
        items += [(f"buffer {n!r}", b) for n, b in module.named_buffers()]
        return type(module).__name__, _dense(items)
    if isinstance(obj, torch.Tensor):
        return "tensor", _dense([("the tensor", obj)])
    if isinstance(obj, Mapping):
        pairs = [(f"tensor {k!r}", v) for k, v in obj.items()]
        what = "tensors"
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        pairs = [(f"tensor [{i}]", v) for i, v in enumerate(obj)]
        what = "tensors"
    else:
        raise InvalidArgument(
            f"assert_replicas got a {type(obj).__name__}: it compares an nn.Module (its parameters and buffers), "
            "a tensor, or a dict or list of tensors"
        )
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(
                f"assert_replicas: {name} is a {type(value).__name__}, not a tensor; a dict or list "
                "passed to assert_replicas holds tensors only"
            )
    return what, _dense(pairs)


def _dense(items: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """``items`` as they are, if every tensor is a dense (strided) one with data; else InvalidArgument."""
    for name, t in items:
        if t.layout != torch.strided or t.device.type == "meta":
            raise InvalidArgument(
                f"assert_replicas: {name} is a {t.layout} tensor on {t.device}; it compares dense (strided) tensors "
                "with data (for a sparse one, pass its .to_dense(); meta tensors hold no values)"
            )
    return items


def _entries(obj: object, pg: Any, ranks: tuple[int, ...]) -> tuple[str, list[_Entry]]:
    what, named = _named_tensors(obj)
    members = set(ranks)
    entries: list[_Entry] = []
    for label, tensor in named:
        t: Any = tensor
        if not _is_dtensor(t):
            entries.append(_Entry(label, "tensor", pg, ranks, tuple(t.shape), t.dtype, tensor=t.detach()))
            continue
        from torch.distributed.tensor import Replicate

        mesh = t.device_mesh
        local = t.to_local().detach()
        mesh_ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        for dim, placement in enumerate(t.placements):
            if not isinstance(placement, Replicate) or mesh.size(dim) < 2:
                continue
            dim_pg = mesh.get_group(dim)
            dim_ranks = tuple(dist.get_process_group_ranks(dim_pg))
            if not set(dim_ranks) <= members:
                continue
            names = mesh.mesh_dim_names
            dim_label = f"mesh dim {dim}" + (f" {names[dim]!r}" if names else "")
            entries.append(
                _Entry(
                    f"{label} (local, Replicate on {dim_label})",
                    "dtensor local",
                    dim_pg,
                    dim_ranks,
                    tuple(local.shape),
                    local.dtype,
                    tensor=local,
                )
            )
        if set(mesh_ranks) < members:
            entries.append(
                _Entry(f"{label} (full tensor)", "dtensor full", pg, ranks, tuple(t.shape), t.dtype, dtensor=t)
            )
    return what, entries


# -- digests and values ------------------------------------------------------------------------------------------
#: Bytes of a tensor's digest: 128 bits (of SHA-256's 256), exchanged as two int64.
_DIGEST_BYTES = 16


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the values ``t`` stands for, flat (uint8), on its device: what "bit for bit" compares.

    A conjugate or negative view keeps its values' sign in a flag, not in memory, and a strided view skips
    memory: both are resolved and made contiguous first, so every layout of the same values gives the same
    bytes (and a view of other values never gives them). The flat tensor has stride 1, which :func:`_digest`
    relies on to read its memory: a one-element view counts as contiguous whatever its stride, and keeps that
    stride through ``contiguous()`` and ``reshape``, so it is copied."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _digest(t: torch.Tensor) -> bytes:
    """SHA-256 of the bytes of ``t``'s values, its first 128 bits: the same on every rank for the same bits, and no
    change of bits, however placed, makes two digests equal except by a chance of 2**-128.

    A hash, not a sum: a sum of words (weighted or not) is linear, so changes that add up to nothing (a sign
    flipped in many elements, two -0.0, values moved by the weights' period) cancel and replicas that differ
    pass. SHA-256 rather than BLAKE2b, both in the standard library: hashlib runs SHA-256 through OpenSSL, on the
    CPU's SHA instructions where it has them (AMD since Zen, Intel since Ice Lake, Arm's crypto extensions),
    measured 2.3 times faster than BLAKE2b on this project's machines (31 against 72 ms for 40 MiB, AMD EPYC);
    an older CPU without them (Intel before Ice Lake) hashes in software, where SHA-256 is the slower of the two
    (not measured here). hashlib releases the GIL over buffers this size, so the threaded world's ranks hash at
    once. The bytes are read in place (through ctypes, which needs no numpy and knows every dtype, bfloat16
    included); a tensor elsewhere (CUDA) is copied to the CPU first."""
    raw = _raw(t)
    if raw.device.type != "cpu":
        raw = raw.cpu()
    h = hashlib.sha256()
    if raw.numel():
        h.update((ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr()))
    return h.digest()[:_DIGEST_BYTES]


def _digests(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The digests of ``tensors`` as an int64 tensor ``[len(tensors), 2]``, to exchange."""
    joined = bytearray(b"".join(_digest(t) for t in tensors))
    return torch.frombuffer(joined, dtype=torch.int64).reshape(len(tensors), _DIGEST_BYTES // 8).clone()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # torch runs without numpy; the torch path then serves
        return None
    return numpy


def _gather_values(entry: _Entry, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (of ``entry.group``), gathered as bytes and viewed back; on the CPU, contiguous,
    views resolved (the values the ranks' tensors stand for)."""
    raw = _raw(t)
    out = [torch.empty_like(raw) for _ in entry.ranks]
    dist.all_gather(out, raw, group=entry.group)
    return [o.cpu().view(t.dtype).reshape(t.shape) for o in out]


def _bits(value: torch.Tensor) -> str:
    """One element's bits in hex, as the machine reads the element (the most significant byte first)."""
    return f"0x{int.from_bytes(bytes(_raw(value).tolist()), sys.byteorder):0{2 * value.element_size()}x}"


def _fmt(value: torch.Tensor) -> str:
    """One element for a message; its bits where the dtype has no Python value (packed and bit dtypes)."""
    try:
        item = value.item()
    except (RuntimeError, TypeError):
        return f"bits {_bits(value)}"
    return f"{item:.9g}" if isinstance(item, float) else repr(item)


def _pair(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str]:
    """Two elements that differ in bits, as a message shows them: with their bits where they print alike (two NaNs
    of different payloads)."""
    fa, fb = _fmt(a), _fmt(b)
    if fa == fb:
        fa, fb = f"{fa} ({_bits(a)})", f"{fb} ({_bits(b)})"
    return fa, fb


def _elements(t: torch.Tensor) -> Any:
    """One integer per element holding its bits (a numpy array where numpy is there, else a tensor), for
    finding the elements that differ; complex and other 16-byte elements as pairs of int64 rows."""
    raw = _raw(t)
    size = t.element_size() if t.dtype != torch.bool else 1
    np = _numpy()
    if np is not None:
        ints = raw.numpy().view({1: np.uint8, 2: np.int16, 4: np.int32}.get(size, np.int64))
        return ints.reshape(t.numel(), -1) if size > 8 else ints
    ints_t = raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64))
    return ints_t.reshape(t.numel(), -1) if size > 8 else ints_t


def _differing(a: Any, b: Any) -> torch.Tensor:
    """Flat indices of the elements whose bits differ between two :func:`_elements`."""
    if isinstance(a, torch.Tensor):
        ne: torch.Tensor = a != b
        return (ne.any(dim=1) if ne.dim() > 1 else ne).nonzero().reshape(-1)
    import numpy as np

    unequal: Any = a != b
    found: torch.Tensor = torch.from_numpy(np.flatnonzero(unequal.any(axis=1) if unequal.ndim > 1 else unequal))
    return found


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _differences(
    got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(|got - want|, within)`` elementwise, float64 and bool, ``within`` meaning ``|got - want| <= atol + rtol *
    |want|``; None for a dtype without arithmetic (bool, packed or bit dtypes: compared bit for bit only).

    Finite values by that formula; an infinity is within only of itself and a NaN only of a NaN (any payload), as
    in ``torch.isclose(equal_nan=True)``: ``|5 - inf| <= rtol * inf`` holds in IEEE arithmetic, yet 5 is no
    replica of inf. Integers exactly, whatever their size (float64 would make 2**60 and 2**60 + 1 equal)."""
    if got.dtype == torch.bool:
        return None
    if not (got.dtype.is_floating_point or got.dtype.is_complex):
        return _integer_differences(got, want, rtol, atol)
    wide = torch.complex128 if got.dtype.is_complex else torch.float64
    try:
        g, w = got.to(wide), want.to(wide)
    except (RuntimeError, TypeError):  # packed float4 and the like: no conversion
        return None
    finite = g.isfinite() & w.isfinite()
    alike = (g == w) | (g.isnan() & w.isnan())
    diff = torch.where(finite, (g - w).abs(), torch.where(alike, 0.0, math.inf))
    within = torch.where(finite, diff <= atol + rtol * w.abs(), alike)
    return diff, within


def _integer_differences(
    got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_differences` of integers: each as a high and a low 32-bit half, whose differences are exact in
    int64, so ``|got - want|`` in float64 is the exact difference rounded once (no overflow for any pair of
    int64 or uint64 values)."""
    try:
        if got.dtype == torch.uint64:
            a, b = got.view(torch.int64), want.view(torch.int64)
        else:
            a, b = got.to(torch.int64), want.to(torch.int64)
    except (RuntimeError, TypeError):
        return None
    high_a, high_b = a >> 32, b >> 32
    if got.dtype == torch.uint64:  # the top bit is a value bit, not a sign
        high_a, high_b = high_a & 0xFFFFFFFF, high_b & 0xFFFFFFFF
    low_a, low_b = a & 0xFFFFFFFF, b & 0xFFFFFFFF
    diff = ((high_a - high_b).double() * 2.0**32 + (low_a - low_b).double()).abs()
    scale = (high_b.double() * 2.0**32 + low_b.double()).abs()
    return diff, diff <= atol + rtol * scale


def _take(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` at the flat indices ``flat``. torch indexes no dtype without arithmetic (bits8,
    packed float4...), so those are taken as bytes and viewed back."""
    try:
        return t.reshape(-1)[flat]
    except RuntimeError:  # NotImplementedError: "index_cpu" not implemented for 'Bits8'
        return _raw(t).reshape(t.numel(), -1)[flat].reshape(-1).view(t.dtype)


def _compare(entry: _Entry, values: list[torch.Tensor], rtol: float, atol: float) -> str | None:
    """The text of a difference among ``values`` (one per rank of the entry's group), or None if the values
    are identical or within tolerance of the lowest rank's. Only the elements whose bits differ are converted
    and compared (the rest are equal), so a failing check costs little more than the gather."""
    ints = [_elements(v) for v in values]
    ref, ref_rank = values[0], entry.ranks[0]
    classes: list[tuple[int, list[int]]] = []  # (position in values of the first member, members)
    for pos, rank in enumerate(entry.ranks):
        for first, members in classes:
            if len(_differing(ints[first], ints[pos])) == 0:
                members.append(rank)
                break
        else:
            classes.append((pos, [rank]))
    if len(classes) == 1:
        return None
    exact = rtol == 0.0 and atol == 0.0
    failing = exact
    worst_diff, worst_pos, worst_flat = -1.0, 0, 0  # the largest numeric difference
    bits_pos, bits_flat = 0, -1  # the first difference of a dtype without arithmetic
    for pos in range(1, len(values)):
        where = _differing(ints[0], ints[pos])
        if len(where) == 0:
            continue
        found = _differences(_take(values[pos], where), _take(ref, where), rtol, atol)
        if found is None:
            failing = True
            if bits_flat < 0:
                bits_pos, bits_flat = pos, int(where[0])
            continue
        diff, within = found
        if not bool(within.all()):
            failing = True
        largest = int(diff.argmax())
        if float(diff[largest]) > worst_diff:
            worst_diff, worst_pos, worst_flat = float(diff[largest]), pos, int(where[largest])
    if not failing:
        return None
    dtype = str(ref.dtype).removeprefix("torch.")
    groups = " vs ".join(f"ranks {members}" for _, members in classes)
    tol = "bit for bit" if exact else f"beyond rtol={rtol:g}, atol={atol:g}"
    text = f"{entry.name} ({dtype}{list(entry.shape)}) differs {tol}: {groups}"
    if worst_diff >= 0:
        head, pos, flat = f"largest absolute difference {worst_diff:.6g}", worst_pos, worst_flat
    else:
        head, pos, flat = "first difference", bits_pos, bits_flat
    mine, theirs = _pair(ref.reshape(-1)[flat], values[pos].reshape(-1)[flat])
    at = _unravel(flat, ref.shape)
    return text + f"; {head} at index {at} (rank {ref_rank}: {mine}, rank {entry.ranks[pos]}: {theirs})"


# -- the check ---------------------------------------------------------------------------------------------------
#: How many names a message lists before "and N more".
_NAMES_SHOWN = 5

#: What each rank tells the others of one entry: (name, layout, group ranks, shape, dtype).
_Described = tuple[str, str, tuple[int, ...], tuple[int, ...], str]


def _agree_on_structure(entries: list[_Entry], pg: Any, ranks: tuple[int, ...]) -> tuple[list[_Entry], _Finding | None]:
    """Gather every rank's entries, described, over the group: this rank's entries in the lowest rank's order, and
    the first difference of structure (or None).

    Entries are matched by name (a dict compares by key, whatever order it was filled in), then put in the lowest
    rank's order: every rank then issues the same collectives in the same order, and :func:`_verdict` decides
    alike everywhere."""
    mine: list[_Described] = [
        (e.name, f"{e.layout}{'' if e.ranks == ranks else ' (subgroup)'}", e.ranks, e.shape, str(e.dtype))
        for e in entries
    ]
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=pg)
    order, finding = _match_structure(everyone, ranks)
    if finding is not None:
        return entries, finding
    by_key = {(name, layout): entry for (name, layout, *_), entry in zip(mine, entries)}
    return [by_key[key] for key in order], None


def _match_structure(
    everyone: Sequence[Sequence[_Described]], ranks: tuple[int, ...]
) -> tuple[list[tuple[str, str]], _Finding | None]:
    """The keys (name, layout) in the lowest rank's order and the first difference of structure among every
    rank's described entries (``everyone[i]`` of ``ranks[i]``), or None. The same on every rank, from the same
    gathered lists: a name held twice by a rank (two dict keys with the same ``repr``) raises InvalidArgument on
    every rank, which cannot tell them apart."""
    keyed: list[dict[tuple[str, str], _Described]] = []
    for rank, theirs in zip(ranks, everyone):
        held: dict[tuple[str, str], _Described] = {}
        for described in theirs:
            key = (described[0], described[1])
            if key in held:
                raise InvalidArgument(
                    f"assert_replicas: rank {rank} holds two tensors named {key[0]} (dict keys whose repr() is the "
                    "same); replicas are matched by name across ranks: give them names that differ"
                )
            held[key] = described
        keyed.append(held)
    reference = list(keyed[0])
    known = set(reference)
    by_change: dict[tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], list[int]] = {}
    for rank, held in zip(ranks, keyed):
        lacking = tuple(key for key in reference if key not in held)
        extra = tuple(key for key in held if key not in known)
        if lacking or extra:
            by_change.setdefault((lacking, extra), []).append(rank)
    if by_change:
        changes = []
        for (lacking, extra), members in by_change.items():
            said = []
            if lacking:
                said.append(f"lack {_listed(lacking, set(extra))}")
            if extra:
                said.append(f"hold {_listed(extra, set(lacking))} extra")
            changes.append(f"ranks {members} " + " and ".join(said))
        text = (
            f"the ranks hold different tensors (rank {ranks[0]} holds {len(reference)}: "
            f"{_listed(tuple(reference), set())}): " + "; ".join(changes)
        )
        return reference, _Finding(-1, (), text)
    for index, key in enumerate(reference):
        by_group: dict[tuple[int, ...], dict[tuple[Any, ...], list[int]]] = {}
        for rank, held in zip(ranks, keyed):
            _, _, group_ranks, shape, dtype = held[key]
            by_group.setdefault(tuple(group_ranks), {}).setdefault((tuple(shape), dtype), []).append(rank)
        for group_ranks, kinds in sorted(by_group.items()):
            if len(kinds) > 1:
                kinds_text = " vs ".join(
                    f"ranks {members} {dtype.removeprefix('torch.')}{list(shape)}"
                    for (shape, dtype), members in kinds.items()
                )
                return reference, _Finding(index, group_ranks, f"{key[0]} has different shapes or dtypes: {kinds_text}")
    return reference, None


def _listed(keys: tuple[tuple[str, str], ...], others: set[tuple[str, str]]) -> str:
    """Names for a message, the first few; a name that is also among ``others`` under another layout (a DTensor
    on one rank, a tensor on another) with its layout."""
    names_elsewhere = {name for name, _ in others}
    shown = [name if name not in names_elsewhere else f"{name} ({layout})" for name, layout in keys[:_NAMES_SHOWN]]
    more = len(keys) - _NAMES_SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _slots(entries: list[_Entry]) -> dict[tuple[int, ...], list[int]]:
    """Entry indices by the ranks of the group they are compared over, in order of first appearance (the same
    order on every member of a group, so the collectives of different groups cannot cross)."""
    slots: dict[tuple[int, ...], list[int]] = {}
    for index, entry in enumerate(entries):
        if len(entry.ranks) > 1:
            slots.setdefault(entry.ranks, []).append(index)
    return slots


def _first_difference(entries: list[_Entry], rtol: float, atol: float) -> _Finding | None:
    """Digests over each group, values of the differing tensors; this rank's first finding."""
    slots = _slots(entries)
    tensors = {i: _materialize(entries[i]) for indices in slots.values() for i in indices}
    differing: dict[tuple[int, ...], list[int]] = {}
    for ranks, indices in slots.items():
        group = entries[indices[0]].group
        device = _device_of(tensors[i] for i in indices)
        prints = _digests([tensors[i] for i in indices]).to(device)
        out = [torch.empty_like(prints) for _ in ranks]
        dist.all_gather(out, prints, group=group)
        stacked = torch.stack([o.cpu() for o in out])  # [ranks, entries, digest words]
        same = (stacked == stacked[0]).all(dim=2).all(dim=0)
        differing[ranks] = [i for i, ok in zip(indices, same.tolist()) if not ok]
    found: list[_Finding] = []
    for ranks, indices in differing.items():
        names: list[str] = []
        first: _Finding | None = None
        for i in indices:
            if first is not None and rtol == 0.0 and atol == 0.0:
                names.append(entries[i].name)  # different bits: differs, no need to gather it
                continue
            if first is not None:
                break
            text = _compare(entries[i], _gather_values(entries[i], tensors[i]), rtol, atol)
            if text is not None:
                first = _Finding(i, ranks, text)
        if first is not None:
            first.others = names
            found.append(first)
    return min(found, key=lambda f: f.key) if found else None


def _materialize(entry: _Entry) -> torch.Tensor:
    if entry.tensor is None:
        entry.tensor = entry.dtensor.full_tensor().detach()
    return entry.tensor


def _verdict(finding: _Finding | None, entries: list[_Entry], pg: Any, ranks: tuple[int, ...]) -> _Finding | None:
    """The same finding on every rank of the group: only needed when some comparisons ran over subgroups."""
    if all(e.ranks == ranks for e in entries):
        return finding
    flag = torch.tensor([0 if finding is None else 1], dtype=torch.int64)
    device = _device_of(e.tensor for e in entries)
    flag = flag.to(device)
    dist.all_reduce(flag, group=pg)
    if int(flag.item()) == 0:
        return None
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, finding, group=pg)
    found: list[_Finding] = [f for f in everyone if isinstance(f, _Finding)]
    return min(found, key=lambda f: f.key)


def _device_of(tensors: Iterable[torch.Tensor | None]) -> torch.device:
    """Where the small exchanges of a check go: the first device of the tensors that is not the CPU (NCCL takes
    CUDA tensors only), else the CPU (gloo, dstest's worlds)."""
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def assert_replicas(
    module_or_tensors: object,
    group: Any = None,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    what: str | None = None,
) -> None:
    """Raise :class:`~dstest.errors.ReplicasDiverge` on every rank of ``group`` if what must be identical is not.

    A collective: every rank of ``group`` (default: the world) calls it with the same structure (the same
    module, or tensors under the same names). Bit for bit by default; with ``rtol``/``atol``, ``|x - x0| <=
    atol + rtol * |x0|`` elementwise, x0 the value of the lowest rank of the group compared over. See the module
    docstring for what each layout compares. ``what`` names the thing in the message (default: the module's
    class, or "tensors"). Bad arguments raise :class:`~dstest.errors.InvalidArgument` before any collective.
    """
    r, a = _check_tolerance(rtol, atol)
    if what is not None and not isinstance(what, str):
        raise InvalidArgument(f"what={what!r}: must be a str naming what is compared, or None")
    pg, ranks = _resolve_group(group)
    label, entries = _entries(module_or_tensors, pg, ranks)
    label = what or label
    entries, finding = _agree_on_structure(entries, pg, ranks)
    if finding is None:
        finding = _verdict(_first_difference(entries, r, a), entries, pg, ranks)
    if finding is None:
        return
    text = f"replicas of {label} diverge over ranks {list(ranks)}: {finding.text}"
    if finding.others:
        shown = ", ".join(finding.others[:_ALSO_SHOWN])
        more = len(finding.others) - _ALSO_SHOWN
        text += f"; also different: {shown}" + (f" and {more} more" if more > 0 else "")
    raise ReplicasDiverge(text)


def replicas_checked(
    module: object, group: Any = None, *, rtol: float = 0.0, atol: float = 0.0
) -> contextlib.AbstractContextManager[None]:
    """While active, :func:`assert_replicas` ``(module, group, rtol=, atol=)`` after every ``optimizer.step()``
    of an optimizer that steps one of ``module``'s parameters (torch's global optimizer step post-hook; per rank
    on the threaded world, as in a process of its own). Every rank of ``group`` must step such an optimizer
    equally often: each check is a collective. The arguments are checked here, when it is called."""
    import torch.nn as nn

    if not isinstance(module, nn.Module):
        raise InvalidArgument(f"replicas_checked: module is a {type(module).__name__}; it takes an nn.Module")
    _check_tolerance(rtol, atol)
    _resolve_group(group)
    return _hooked(module, group, rtol, atol)


@contextlib.contextmanager
def _hooked(module: Any, group: Any, rtol: float, atol: float) -> Iterator[None]:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    watched = {id(p) for p in module.parameters()}
    steps = [0]

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not any(id(p) in watched for g in optimizer.param_groups for p in g["params"]):
            return
        steps[0] += 1
        what = f"{type(_unwrap(module)).__name__} after optimizer step {steps[0]} ({type(optimizer).__name__})"
        assert_replicas(module, group, rtol=rtol, atol=atol, what=what)

    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield
    finally:
        handle.remove()
