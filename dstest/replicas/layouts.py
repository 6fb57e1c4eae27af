"""What is compared: the tensors an ``nn.Module``, a tensor, or a dict or list of tensors holds, each as an
:class:`Entry` over the group of ranks it is compared across (a plain tensor over the whole group, a DTensor's
local tensor over each replicated mesh dimension within it, its full tensor when the mesh is a strict part of
the group; see :mod:`dstest.replicas`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument

__all__ = ["Entry", "entries_of", "unwrap"]


@dataclass
class Entry:
    """One comparison: a tensor (or, for a full DTensor, how to make it) over one group of ranks."""

    name: str
    layout: str  # how the tensor was found: "tensor", "dtensor local (mesh dim 1)", "dtensor full"
    group: Any  # the ProcessGroup compared over
    ranks: tuple[int, ...]  # its global ranks
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None = None
    dtensor: Any = None  # a DTensor whose full_tensor() is compared (made after the structure is agreed)


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (never importing DTensor: a body that has none has not loaded it)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def unwrap(module: Any) -> Any:
    """A DistributedDataParallel's ``.module``; any other module itself."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _named_tensors(obj: object) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """(what, [(label, tensor)]) of a module, a tensor, or a dict/list of tensors; else InvalidArgument."""
    import torch.nn as nn

    if isinstance(obj, nn.Module):
        module = unwrap(obj)
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


def entries_of(obj: object, pg: Any, ranks: tuple[int, ...]) -> tuple[str, list[Entry]]:
    what, named = _named_tensors(obj)
    members = set(ranks)
    entries: list[Entry] = []
    for label, tensor in named:
        t: Any = tensor
        if not _is_dtensor(t):
            entries.append(Entry(label, "tensor", pg, ranks, tuple(t.shape), t.dtype, tensor=t.detach()))
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
                Entry(
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
                Entry(f"{label} (full tensor)", "dtensor full", pg, ranks, tuple(t.shape), t.dtype, dtensor=t)
            )
    return what, entries
