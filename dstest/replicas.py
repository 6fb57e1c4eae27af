"""Replica checks (G4): what must be identical on every rank of a group, compared across the group.

The quietest bugs of data-parallel code leave no error and no hang: a parameter left out of DDP's
reduction, a buffer never broadcast, a rank-dependent op in an update, a ZeRO shard applied twice, a
replicated LayerNorm weight of a tensor-parallel block whose gradient was never all-reduced. Each leaves
replicas that should be identical slightly different, and the loss curve hides it for thousands of steps.
:func:`assert_replicas` compares them, bit for bit by default, and names the first tensor that differs,
the ranks grouped by value, and the largest difference.

It is a collective: every rank of ``group`` calls it, with the same structure of tensors. It uses only
ordinary ``torch.distributed`` collectives, so it runs the same on the threaded world, the process world and
NCCL. To stay cheap it exchanges, per tensor, a fingerprint of its bits (two int64 sums, one of them
position-weighted) and gathers a tensor's values only when fingerprints differ. Every rank ends with the
same verdict and raises the same :class:`~dstest.errors.ReplicasDiverge`, so no rank is left behind in a
collective.

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


# -- fingerprints and values -------------------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (uint8): what "bit for bit" compares."""
    flat = t.detach().contiguous().reshape(-1)
    return (flat.view(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.uint8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer tensor, viewed (not copied): int32 words for 4- and 8-byte dtypes,
    int16 for 2-byte ones, uint8 for 1-byte ones and bool."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view({1: torch.uint8, 2: torch.int16}.get(size, torch.int32))


#: Period (in words) of the position weights of :func:`_fingerprint`.
_PERIOD = 1024
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """Odd int32 weights, the same on every rank and device (a fixed seed): odd, so a changed word always
    changes its weighted term (odd numbers are invertible modulo 2**32)."""
    if device not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        odd = torch.randint(-(2**30), 2**30, (_PERIOD,), generator=g, dtype=torch.int32) * 2 + 1
        _WEIGHTS[device] = odd.to(device)
    return _WEIGHTS[device]


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers of the tensor's bits, the same on every rank and device for the same bits: the plain
    wrapping sum of its words, and their sum weighted by position with odd pseudo-random weights (a periodic
    pattern). One changed word always changes both (odd numbers are invertible modulo 2**64 and 2**32); values
    moved between positions change the weighted sum unless moved by a multiple of the period.

    On the CPU in numpy, on 8-byte words, without a copy and without the GIL: torch's integer reductions on the
    CPU run some forty times slower (measured: 6 ms per 4 MB against 0.15), CRC-32 twenty times slower. Elsewhere
    (CUDA) in torch on the device, on 4-byte words, without a copy to the host.
    """
    if t.device.type == "cpu":
        np = _numpy()
        if np is not None:
            raw = _raw(t).numpy()
            whole = raw.size - raw.size % (8 * _PERIOD)
            words = raw[:whole].view(np.int64).reshape(-1, _PERIOD)
            weights = _np_weights(np)
            plain, weighted = int(words.sum(dtype=np.int64)), int((words @ weights).sum(dtype=np.int64))
            if whole < raw.size:  # the tail, byte by byte
                tail = raw[whole:].astype(np.int64)
                plain += int(tail.sum())
                weighted += int(tail @ np.resize(weights, tail.size))
            return torch.tensor([_wrap64(plain), _wrap64(weighted)], dtype=torch.int64)
    words = _words(t)
    n = words.numel()
    whole = n - n % _PERIOD
    weights = _weights(words.device)
    plain_t = words.sum(dtype=torch.int64)
    weighted_t = (words[:whole].view(-1, _PERIOD) * weights).sum(dtype=torch.int64) if whole else plain_t * 0
    if whole < n:
        weighted_t = weighted_t + (words[whole:] * weights[: n - whole]).sum(dtype=torch.int64)
    return torch.stack([plain_t, weighted_t])


def _wrap64(value: int) -> int:
    """A Python int as the int64 it wraps to."""
    return (value + 2**63) % 2**64 - 2**63


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # torch runs without numpy; the torch path then serves the CPU too
        return None
    return numpy


_NP_WEIGHTS: list[Any] = []


def _np_weights(np: Any) -> Any:
    """Odd int64 weights of period :data:`_PERIOD`, from a fixed seed: the same on every rank."""
    if not _NP_WEIGHTS:
        _NP_WEIGHTS.append(np.random.default_rng(0x5EED).integers(-(2**62), 2**62, _PERIOD, dtype=np.int64) | 1)
    return _NP_WEIGHTS[0]


def _gather_values(entry: _Entry, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (of ``entry.group``), gathered as bytes and viewed back; on the CPU."""
    raw = _raw(t)
    out = [torch.empty_like(raw) for _ in entry.ranks]
    dist.all_gather(out, raw, group=entry.group)
    return [
        (o.cpu().view(torch.bool) if t.dtype == torch.bool else o.cpu().view(t.dtype)).reshape(t.shape) for o in out
    ]


def _fmt(value: torch.Tensor) -> str:
    item = value.item()
    return repr(item) if not isinstance(item, float) else f"{item:.9g}"


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
    wide = torch.complex128 if ref.dtype.is_complex else torch.float64
    numeric = ref.dtype != torch.bool
    failing = exact or not numeric
    worst_diff, worst_rank, worst_flat = -1.0, ref_rank, 0
    for pos in range(1, len(values)):
        where = _differing(ints[0], ints[pos])
        if not numeric or len(where) == 0:
            continue
        got = values[pos].reshape(-1)[where].to(wide)
        want = ref.reshape(-1)[where].to(wide)
        diff = (got - want).abs()
        diff = torch.where(got.isnan() != want.isnan(), torch.full_like(diff, float("inf")), diff.nan_to_num(nan=0.0))
        if not exact and bool((diff > atol + rtol * want.abs()).any()):
            failing = True
        largest = int(diff.argmax())
        if float(diff[largest]) > worst_diff:
            worst_diff, worst_rank, worst_flat = float(diff[largest]), entry.ranks[pos], int(where[largest])
    if not failing:
        return None
    dtype = str(ref.dtype).removeprefix("torch.")
    groups = " vs ".join(f"ranks {members}" for _, members in classes)
    tol = "bit for bit" if exact else f"beyond rtol={rtol:g}, atol={atol:g}"
    text = f"{entry.name} ({dtype}{list(entry.shape)}) differs {tol}: {groups}"
    if worst_diff >= 0:
        at = _unravel(worst_flat, ref.shape)
        other = values[entry.ranks.index(worst_rank)]
        text += (
            f"; largest absolute difference {worst_diff:.6g} at index {at} "
            f"(rank {ref_rank}: {_fmt(ref.reshape(-1)[worst_flat])}, "
            f"rank {worst_rank}: {_fmt(other.reshape(-1)[worst_flat])})"
        )
    return text


# -- the check ---------------------------------------------------------------------------------------------------
def _agree_on_structure(entries: list[_Entry], pg: Any, ranks: tuple[int, ...]) -> _Finding | None:
    """Gather every rank's list of (name, layout, group, shape, dtype) over the group; the first difference.

    The names, layouts and whether each is compared over the whole group must be the same on every rank: then
    every rank issues the same collectives in the same order, and :func:`_verdict` decides alike everywhere."""
    mine = [
        (e.name, f"{e.layout}{'' if e.ranks == ranks else ' (subgroup)'}", e.ranks, e.shape, str(e.dtype))
        for e in entries
    ]
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=pg)
    names = [[(name, layout) for name, layout, *_ in theirs] for theirs in everyone]
    if any(n != names[0] for n in names):
        by: dict[str, list[int]] = {}
        for rank, n in zip(ranks, names):
            by.setdefault(repr(n), []).append(rank)
        firsts = []
        for members in by.values():
            held = names[ranks.index(members[0])]
            shown = ", ".join(name for name, _ in held[:4]) + (", ..." if len(held) > 4 else "")
            firsts.append(f"ranks {members} hold {len(held)} ({shown})")
        return _Finding(-1, (), "the ranks hold different tensors: " + " vs ".join(firsts))
    for index in range(len(entries)):
        by_group: dict[tuple[int, ...], dict[tuple[Any, ...], list[int]]] = {}
        for rank, theirs in zip(ranks, everyone):
            _, _, group_ranks, shape, dtype = theirs[index]
            by_group.setdefault(group_ranks, {}).setdefault((tuple(shape), dtype), []).append(rank)
        for group_ranks, kinds in sorted(by_group.items()):
            if len(kinds) > 1:
                kinds_text = " vs ".join(
                    f"ranks {members} {dtype.removeprefix('torch.')}{list(shape)}"
                    for (shape, dtype), members in kinds.items()
                )
                name = everyone[0][index][0]
                return _Finding(index, group_ranks, f"{name} has different shapes or dtypes: {kinds_text}")
    return None


def _slots(entries: list[_Entry]) -> dict[tuple[int, ...], list[int]]:
    """Entry indices by the ranks of the group they are compared over, in order of first appearance (the same
    order on every member of a group, so the collectives of different groups cannot cross)."""
    slots: dict[tuple[int, ...], list[int]] = {}
    for index, entry in enumerate(entries):
        if len(entry.ranks) > 1:
            slots.setdefault(entry.ranks, []).append(index)
    return slots


def _first_difference(entries: list[_Entry], rtol: float, atol: float) -> _Finding | None:
    """Fingerprints over each group, values of the differing tensors; this rank's first finding."""
    slots = _slots(entries)
    tensors = {i: _materialize(entries[i]) for indices in slots.values() for i in indices}
    differing: dict[tuple[int, ...], list[int]] = {}
    for ranks, indices in slots.items():
        group = entries[indices[0]].group
        device = _device_of(tensors[i] for i in indices)
        prints = torch.stack([_fingerprint(tensors[i]).to(device) for i in indices])
        out = [torch.empty_like(prints) for _ in ranks]
        dist.all_gather(out, prints, group=group)
        stacked = torch.stack([o.cpu() for o in out])  # [ranks, entries, 2]
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
    finding = _agree_on_structure(entries, pg, ranks)
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
