"""Digests and values: the bytes a tensor's values stand for, their digest (what the ranks exchange first),
the values gathered where digests differ, and the text that names the first or largest difference."""

from __future__ import annotations

import ctypes
import hashlib
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dstest.replicas.layouts import Entry

__all__ = ["compare", "digests", "gather_values"]

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


def digests(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The digests of ``tensors`` as an int64 tensor ``[len(tensors), 2]``, to exchange."""
    joined = bytearray(b"".join(_digest(t) for t in tensors))
    return torch.frombuffer(joined, dtype=torch.int64).reshape(len(tensors), _DIGEST_BYTES // 8).clone()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # torch runs without numpy; the torch path then serves
        return None
    return numpy


def gather_values(entry: Entry, t: torch.Tensor) -> list[torch.Tensor]:
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


def compare(entry: Entry, values: list[torch.Tensor], rtol: float, atol: float) -> str | None:
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
