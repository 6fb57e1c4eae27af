"""Compaction of padded gathers, and the layouts both ops share (contract D5, D6).

A padded all-gather leaves W equal rows, one per rank; rank r's row holds ``counts[r]`` valid elements
(several tensors side by side for a grouped gather, ``P_t = max(counts_t)`` columns each) and padding.
Compaction is the exact concatenation of the valid elements: on CUDA one kernel launch
(``csrc/allgather_compact.cu``), on CPU a C++ op (``csrc/allgather_compact_cpu.cpp``), both built on
first use (:mod:`impl.ops._build`). The pure-torch references (:func:`compact_reference`,
:func:`compact_grouped_reference`) define the results that the native ops are tested against.

Input errors are ``ValueError`` naming the argument, the value and what is allowed, raised before any op
runs. :class:`Layout`, :func:`grouped_layout`, :func:`check_counts`, :func:`check_impl`, :func:`check_out`
and :func:`compact_layout` are the pieces :mod:`impl.ops.allgather` builds on (not re-exported by
:mod:`impl.ops`).

>>> compact(torch.tensor([1, 2, 0, 0, 0, 0, 7, 8, 9]), [2, 0, 3])
tensor([1, 2, 7, 8, 9])
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from impl.ops import _build

__all__ = [
    "Impl",
    "compact",
    "compact_grouped",
    "compact_grouped_reference",
    "compact_reference",
    "shard_size",
]

Impl = Literal["native", "reference"]
_IMPLS: tuple[str, ...] = ("native", "reference")


# --------------------------------------------------------------------------------------------------
# Layouts and validation


def check_counts(counts: Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(counts, (str, bytes, Tensor)) or not isinstance(counts, Sequence):
        raise ValueError(f"{name}={counts!r} must be a sequence of element counts, one per rank")
    checked: list[int] = []
    for i, c in enumerate(counts):
        if isinstance(c, bool):
            raise ValueError(f"{name}[{i}]={c!r} must be an int >= 0, not a bool")
        try:
            value = operator.index(c)
        except TypeError:
            raise ValueError(f"{name}[{i}]={c!r} must be an int >= 0") from None
        if value < 0:
            raise ValueError(f"{name}[{i}]={value} must be >= 0 (an element count)")
        checked.append(value)
    if not checked:
        raise ValueError(f"{name}={counts!r} must have one entry per rank (at least one)")
    return tuple(checked)


def check_impl(impl: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {list(_IMPLS)}")


def shard_size(counts: Sequence[int]) -> int:
    """The uniform shard size ``P`` one padded gather of ``counts`` uses: ``max(counts)`` (0 is fine)."""
    return max(check_counts(counts, "counts"))


@dataclass(frozen=True)
class Layout:
    """T tensors gathered over W ranks in one collective; ``counts[t][r]`` is tensor t on rank r."""

    counts: tuple[tuple[int, ...], ...]
    shard_sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.counts[0])

    @property
    def row(self) -> int:
        """Elements each rank sends: the tensors' padded shards side by side."""
        return sum(self.shard_sizes)

    @property
    def columns(self) -> tuple[int, ...]:
        """Offset of tensor t's shard within a rank's row."""
        offsets, at = [], 0
        for p in self.shard_sizes:
            offsets.append(at)
            at += p
        return tuple(offsets)

    @property
    def totals(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.counts)

    @property
    def flat_counts(self) -> list[int]:
        return [c for per_tensor in self.counts for c in per_tensor]


def grouped_layout(counts_list: Sequence[Sequence[int]], shard_sizes: Sequence[int] | None) -> Layout:
    if isinstance(counts_list, (str, bytes, Tensor)) or not isinstance(counts_list, Sequence):
        raise ValueError(f"counts_list={counts_list!r} must be a sequence of per-rank count lists")
    if len(counts_list) == 0:
        raise ValueError("counts_list=[] must hold one count list per tensor (at least one)")
    counts = tuple(check_counts(c, f"counts_list[{t}]") for t, c in enumerate(counts_list))
    world = len(counts[0])
    for t, c in enumerate(counts):
        if len(c) != world:
            raise ValueError(
                f"counts_list[{t}] has {len(c)} entries but counts_list[0] has {world}: "
                "every tensor needs one count per rank"
            )
    if shard_sizes is None:
        sizes = tuple(max(c) for c in counts)  # the single-gather formula, per tensor (D6)
    else:
        sizes = check_counts(shard_sizes, "shard_sizes")
        if len(sizes) != len(counts):
            raise ValueError(f"shard_sizes={list(sizes)!r} must have one entry per tensor ({len(counts)})")
        for t, (p, c) in enumerate(zip(sizes, counts, strict=True)):
            if max(c) > p:
                raise ValueError(f"shard_sizes[{t}]={p} is smaller than max(counts_list[{t}])={max(c)}")
    return Layout(counts=counts, shard_sizes=sizes)


def _check_padded(padded: Tensor, layout: Layout) -> None:
    expected = layout.world * layout.row
    if padded.numel() != expected:
        raise ValueError(
            f"padded.numel()={padded.numel()} must equal ranks * sum(shard sizes) = "
            f"{layout.world} * {layout.row} = {expected}"
        )


def _single_layout(padded: Tensor, counts: Sequence[int]) -> Layout:
    checked = check_counts(counts, "counts")
    world = len(checked)
    if padded.numel() % world != 0:
        raise ValueError(
            f"padded.numel()={padded.numel()} must be a multiple of len(counts)={world} (one equal-size shard per rank)"
        )
    p = padded.numel() // world
    for r, c in enumerate(checked):
        if c > p:
            raise ValueError(f"counts[{r}]={c} exceeds the shard size padded.numel() // len(counts) = {p}")
    return Layout(counts=(checked,), shard_sizes=(p,))


def check_out(out: Tensor, total: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Returns ``out`` as a 1-D view after checking that it can hold the result."""
    if out.numel() != total:
        raise ValueError(f"out.numel()={out.numel()} must equal the total count {total}")
    if out.dtype != dtype:
        raise ValueError(f"out.dtype={out.dtype} must equal the input dtype {dtype}")
    if out.device != device:
        raise ValueError(f"out.device={out.device} must equal the input device {device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got stride={out.stride()} for shape={tuple(out.shape)}")
    return out.view(-1)


# --------------------------------------------------------------------------------------------------
# Compaction: references and native ops


def compact_reference(padded: Tensor, counts: Sequence[int]) -> Tensor:
    """Pure-torch compaction: the first ``counts[r]`` elements of each of ``len(counts)`` equal shards.

    ``padded`` holds ``W * P`` elements, rank r's shard at offset ``r * P``; the result is 1-D with
    ``sum(counts)`` elements. This is the definition the native op is tested against (D5).
    """
    layout = _single_layout(padded, counts)
    p = layout.shard_sizes[0]
    flat = padded.reshape(-1)
    return torch.cat([flat[r * p : r * p + c] for r, c in enumerate(layout.counts[0])])


def compact(padded: Tensor, counts: Sequence[int], *, impl: Impl = "native") -> Tensor:
    """The exact concatenation of the valid prefixes of ``len(counts)`` equal shards of ``padded``.

    Same result as :func:`compact_reference`; ``impl="native"`` runs the C++ (CPU) or CUDA op, built
    on first use, ``impl="reference"`` the pure-torch reference.

    >>> compact(torch.tensor([1, 2, 0, 0, 0, 0, 7, 8, 9]), [2, 0, 3])
    tensor([1, 2, 7, 8, 9])
    """
    check_impl(impl)
    _single_layout(padded, counts)  # ValueError before reaching the op's RuntimeError checks
    if impl == "reference":
        return compact_reference(padded, counts)
    _build.load_extension()
    result: Tensor = torch.ops.dstest_impl.compact(padded, [operator.index(c) for c in counts])
    return result


def compact_grouped_reference(
    padded: Tensor,
    counts_list: Sequence[Sequence[int]],
    shard_sizes: Sequence[int] | None = None,
) -> list[Tensor]:
    """Pure-torch grouped compaction (D6).

    ``padded`` is W rows (one per rank) of ``sum(shard_sizes)`` elements; tensor t's shard sits at
    column ``sum(shard_sizes[:t])`` of each row and ``counts_list[t][r]`` of it is valid. Returns, per
    tensor, the 1-D concatenation of its valid elements over the ranks. ``shard_sizes`` defaults to
    ``max(counts_list[t])`` per tensor, the size formula of a single gather.
    """
    layout = grouped_layout(counts_list, shard_sizes)
    _check_padded(padded, layout)
    rows = padded.reshape(layout.world, layout.row)
    return [
        torch.cat([rows[r, col : col + c] for r, c in enumerate(counts)])
        for counts, col in zip(layout.counts, layout.columns, strict=True)
    ]


def compact_grouped(
    padded: Tensor,
    counts_list: Sequence[Sequence[int]],
    shard_sizes: Sequence[int] | None = None,
    *,
    out: Tensor | None = None,
    impl: Impl = "native",
) -> list[Tensor]:
    """Grouped compaction in one launch; same result as :func:`compact_grouped_reference`.

    The results are 1-D views into one tensor (``out`` when given: contiguous, ``sum`` of all counts
    elements, the dtype and device of ``padded``), tensor 0's elements first.
    """
    check_impl(impl)
    layout = grouped_layout(counts_list, shard_sizes)
    _check_padded(padded, layout)
    return compact_layout(padded, layout, out, impl)


def compact_layout(padded: Tensor, layout: Layout, out: Tensor | None, impl: str) -> list[Tensor]:
    total = sum(layout.totals)
    if out is None:
        flat = torch.empty(total, dtype=padded.dtype, device=padded.device)
    else:
        flat = check_out(out, total, padded.dtype, padded.device)
    if impl == "reference":
        parts = compact_grouped_reference(padded, layout.counts, layout.shard_sizes)
        torch.cat(parts, out=flat)
    elif total > 0:
        _build.load_extension()
        torch.ops.dstest_impl.compact_grouped_out(padded, layout.flat_counts, list(layout.shard_sizes), flat)
    return list(torch.split(flat, list(layout.totals)))
