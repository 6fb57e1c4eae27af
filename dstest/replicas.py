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
from collections.abc import Iterator, Mapping, Sequence
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
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _unwrap(module: Any) -> Any:
    """A DistributedDataParallel's ``.module``; any other module itself."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _named_tensors(obj: object) -> tuple[str, list[tuple[str, str, torch.Tensor]]]:
    """(what, [(name, kind, tensor)]) of a module, a tensor, or a dict/list of tensors; else InvalidArgument."""
    import torch.nn as nn

    if isinstance(obj, nn.Module):
        module = _unwrap(obj)
        items = [(n, "parameter", p) for n, p in module.named_parameters()]
        items += [(n, "buffer", b) for n, b in module.named_buffers()]
        return type(module).__name__, items
    if isinstance(obj, torch.Tensor):
        return "tensor", [("tensor", "tensor", obj)]
    if isinstance(obj, Mapping):
        pairs = [(repr(k), v) for k, v in obj.items()]
        what = "tensors"
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        pairs = [(f"[{i}]", v) for i, v in enumerate(obj)]
        what = "tensors"
    else:
        raise InvalidArgument(
            f"assert_replicas got a {type(obj).__name__}: it compares an nn.Module (its parameters and buffers), "
            "a tensor, or a dict or list of tensors"
        )
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(
                f"assert_replicas: entry {name} is a {type(value).__name__}, not a tensor; a dict or list "
                "passed to assert_replicas holds tensors only"
            )
    return what, [(name, "tensor", value) for name, value in pairs]


def _entries(obj: object, pg: Any, ranks: tuple[int, ...]) -> tuple[str, list[_Entry]]:
    what, named = _named_tensors(obj)
    members = set(ranks)
    entries: list[_Entry] = []
    for name, kind, tensor in named:
        t: Any = tensor
        label = f"{kind} {name!r}" if kind != "tensor" else ("the tensor" if name == "tensor" else f"tensor {name}")
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
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int64 tensor of its 4-byte (or 1-byte) words."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    return words.to(torch.int64)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the bits: plain (any one changed word changes it) and position-weighted (catches
    values moved between positions). Integer sums wrap, in any order, to the same value on every device."""
    words = _bits(t)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    return (
        torch.stack([words.sum(), (words * weights).sum()])
        if words.numel()
        else torch.zeros(2, dtype=torch.int64, device=words.device)
    )


def _gather_values(entry: _Entry, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (of ``entry.group``), gathered as bytes and viewed back; on the CPU."""
    raw = t.detach().contiguous().reshape(-1)
    raw = (raw.view(torch.uint8) if raw.dtype == torch.bool else raw).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in entry.ranks]
    dist.all_gather(out, raw, group=entry.group)
    return [
        (o.cpu().view(torch.bool) if t.dtype == torch.bool else o.cpu().view(t.dtype)).reshape(t.shape) for o in out
    ]


def _fmt(value: torch.Tensor) -> str:
    item = value.item()
    return repr(item) if not isinstance(item, float) else f"{item:.9g}"


def _compare(entry: _Entry, values: list[torch.Tensor], rtol: float, atol: float) -> str | None:
    """The text of a difference among ``values`` (one per rank of the entry's group), or None if within tolerance."""
    classes: list[tuple[torch.Tensor, list[int]]] = []
    for rank, v in zip(entry.ranks, values):
        for first, members in classes:
            if torch.equal(_bits(first), _bits(v)):
                members.append(rank)
                break
        else:
            classes.append((v, [rank]))
    if len(classes) == 1:
        return None
    ref, ref_rank = values[0], entry.ranks[0]
    exact = rtol == 0.0 and atol == 0.0
    numeric = ref.dtype.is_floating_point or ref.dtype.is_complex or not (ref.dtype == torch.bool)
    worst_diff, worst_rank = -1.0, ref_rank
    worst_at: tuple[int, ...] = ()
    failing = exact
    for rank, v in zip(entry.ranks[1:], values[1:]):
        if not numeric or v.numel() == 0:
            continue
        a, b = (
            v.to(torch.complex128 if ref.dtype.is_complex else torch.float64),
            ref.to(torch.complex128 if ref.dtype.is_complex else torch.float64),
        )
        diff = (a - b).abs()
        nan_mismatch = a.isnan() != b.isnan()
        diff = torch.where(nan_mismatch, torch.full_like(diff, float("inf")), torch.nan_to_num(diff, nan=0.0))
        if not exact and bool((diff > atol + rtol * b.abs()).any()):
            failing = True
        if diff.numel() and float(diff.max()) > worst_diff:
            flat = int(diff.reshape(-1).argmax())
            worst_diff, worst_rank = float(diff.max()), rank
            worst_at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), v.shape)) if v.dim() else ()
    if not failing:
        return None
    dtype = str(ref.dtype).removeprefix("torch.")
    groups = " vs ".join(f"ranks {members}" for _, members in classes)
    tol = "bit for bit" if exact else f"beyond rtol={rtol:g}, atol={atol:g}"
    text = f"{entry.name} ({dtype}{list(entry.shape)}) differs {tol}: {groups}"
    if worst_diff >= 0:
        at = values[entry.ranks.index(worst_rank)]
        text += (
            f"; largest absolute difference {worst_diff:.6g} at index {worst_at} "
            f"(rank {ref_rank}: {_fmt(ref[worst_at])}, rank {worst_rank}: {_fmt(at[worst_at])})"
        )
    return text


# -- the check ---------------------------------------------------------------------------------------------------
def _agree_on_structure(entries: list[_Entry], pg: Any, ranks: tuple[int, ...]) -> _Finding | None:
    """Gather every rank's list of (name, layout, group, shape, dtype) over the group; the first difference."""
    mine = [(e.name, e.layout, e.ranks, e.shape, str(e.dtype)) for e in entries]
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
        prints = torch.stack([_fingerprint(tensors[i]) for i in indices])
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
    device = _device_of(entries)
    flag = flag.to(device)
    dist.all_reduce(flag, group=pg)
    if int(flag.item()) == 0:
        return None
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, finding, group=pg)
    found: list[_Finding] = [f for f in everyone if isinstance(f, _Finding)]
    return min(found, key=lambda f: f.key)


def _device_of(entries: list[_Entry]) -> torch.device:
    for e in entries:
        if e.tensor is not None:
            return e.tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


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
