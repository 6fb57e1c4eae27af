"""The check itself: its arguments, the exchanges that find the first difference over each group and make
every rank of ``group`` reach the same verdict, :func:`assert_replicas` and :func:`replicas_checked`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument, ReplicasDiverge
from dstest.replicas.layouts import Entry, entries_of, unwrap
from dstest.replicas.structure import Finding, agree_on_structure
from dstest.replicas.values import compare, digests, gather_values

__all__ = ["assert_replicas", "replicas_checked"]

#: How many other differing tensors the message names after the first.
_ALSO_SHOWN = 5


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


def _slots(entries: list[Entry]) -> dict[tuple[int, ...], list[int]]:
    """Entry indices by the ranks of the group they are compared over, in order of first appearance (the same
    order on every member of a group, so the collectives of different groups cannot cross)."""
    slots: dict[tuple[int, ...], list[int]] = {}
    for index, entry in enumerate(entries):
        if len(entry.ranks) > 1:
            slots.setdefault(entry.ranks, []).append(index)
    return slots


def _first_difference(entries: list[Entry], rtol: float, atol: float) -> Finding | None:
    """Digests over each group, values of the differing tensors; this rank's first finding."""
    slots = _slots(entries)
    tensors = {i: _materialize(entries[i]) for indices in slots.values() for i in indices}
    differing: dict[tuple[int, ...], list[int]] = {}
    for ranks, indices in slots.items():
        group = entries[indices[0]].group
        device = _device_of(tensors[i] for i in indices)
        prints = digests([tensors[i] for i in indices]).to(device)
        out = [torch.empty_like(prints) for _ in ranks]
        dist.all_gather(out, prints, group=group)
        stacked = torch.stack([o.cpu() for o in out])  # [ranks, entries, digest words]
        same = (stacked == stacked[0]).all(dim=2).all(dim=0)
        differing[ranks] = [i for i, ok in zip(indices, same.tolist()) if not ok]
    found: list[Finding] = []
    for ranks, indices in differing.items():
        names: list[str] = []
        first: Finding | None = None
        for i in indices:
            if first is not None and rtol == 0.0 and atol == 0.0:
                names.append(entries[i].name)  # different bits: differs, no need to gather it
                continue
            if first is not None:
                break
            text = compare(entries[i], gather_values(entries[i], tensors[i]), rtol, atol)
            if text is not None:
                first = Finding(i, ranks, text)
        if first is not None:
            first.others = names
            found.append(first)
    return min(found, key=lambda f: f.key) if found else None


def _materialize(entry: Entry) -> torch.Tensor:
    if entry.tensor is None:
        entry.tensor = entry.dtensor.full_tensor().detach()
    return entry.tensor


def _verdict(finding: Finding | None, entries: list[Entry], pg: Any, ranks: tuple[int, ...]) -> Finding | None:
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
    found: list[Finding] = [f for f in everyone if isinstance(f, Finding)]
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
    atol + rtol * |x0|`` elementwise, x0 the value of the lowest rank of the group compared over. See
    :mod:`dstest.replicas` for what each layout compares. ``what`` names the thing in the message (default: the
    module's class, or "tensors"). Bad arguments raise :class:`~dstest.errors.InvalidArgument` before any collective.
    """
    r, a = _check_tolerance(rtol, atol)
    if what is not None and not isinstance(what, str):
        raise InvalidArgument(f"what={what!r}: must be a str naming what is compared, or None")
    pg, ranks = _resolve_group(group)
    label, entries = entries_of(module_or_tensors, pg, ranks)
    label = what or label
    entries, finding = agree_on_structure(entries, pg, ranks)
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
        what = f"{type(unwrap(module)).__name__} after optimizer step {steps[0]} ({type(optimizer).__name__})"
        assert_replicas(module, group, rtol=rtol, atol=atol, what=what)

    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield
    finally:
        handle.remove()
