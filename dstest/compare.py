"""How two worlds' runs of one body are compared: verdicts, per-rank results and collective traces (contract E14).

Used by :func:`dstest.crosscheck` (one body on two worlds) and by the plugin's ``--dstest-crosscheck`` (a spec's
threaded cases also run on the process world). Results are compared by type and exactly (:func:`difference`):
tensors and numpy arrays by dtype, shape and bytes (a NaN equals the same NaN bits, ``-0.0`` differs from
``0.0``) or within ``rtol``/``atol``; containers recursively, the first difference named by its path
(``rank 1's result[1]['w'][3]``); plain values by ``==``. Traces are compared call by call: op, group, sequence
number, dtype, shapes, reduce op, root and peer (:func:`trace_signature`). Nothing here runs a world.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from dstest.errors import InvalidArgument, RankFailure, WorldsDiverge

__all__ = ["Difference", "Outcome", "compare_outcomes", "difference", "run_recorded", "trace_signature"]


def trace_signature(record: Any) -> tuple[Any, ...]:
    """What two worlds must agree on for one call of the trace (timings and call sites left out)."""
    return (
        record.op,
        record.group,
        record.seq,
        record.dtype,
        record.shapes,
        record.reduce_op,
        record.root,
        record.peer,
        record.tag,
    )


def _describe(sig: tuple[Any, ...]) -> str:
    op, group, seq, dtype, shapes, reduce_op, root, peer, _ = sig
    extra = [f"{dtype}{list(s)}" for s in shapes]
    extra += [f"op={reduce_op}"] if reduce_op else []
    extra += [f"root={root}"] if root is not None else []
    extra += [f"peer={peer}"] if peer is not None else []
    return f"{op}({', '.join(extra)}) on {group}" + (f" (seq {seq})" if seq is not None else "")


class Difference(NamedTuple):
    """Where two results first differ (``path``: ``[1]['w'][3]``, after the ``where`` given to
    :func:`difference`) and how (``why``: ``7.0 vs 3.0 (1 of 6 elements differ)``)."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path or 'the value'}: {self.why}"


def difference(
    a: Any,
    b: Any,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    names: tuple[str, str] = ("first", "second"),
    where: str = "",
) -> Difference | None:
    """The first difference between ``a`` and ``b``, or None when they are equal (pure: no world is run).

    Compared by type, exactly: both sides must have the same type. Tensors by dtype, shape and bytes (a NaN
    equals the same NaN bits; ``-0.0`` differs from ``0.0``); numpy arrays and scalars the same way; with
    ``rtol``/``atol`` (either > 0), floating and complex elements within ``|a - b| <= atol + rtol * |b|``
    instead, any NaN equal to any NaN. Python floats and complex numbers by bits too (by ``math.isclose``
    with tolerances). dicts by key (insertion order aside; missing and extra keys named, ``names`` the two
    sides), lists and tuples by length then element, namedtuples and dataclasses field by field, all
    recursively; anything else by ``==``, which must give True or False (otherwise
    :class:`~dstest.errors.InvalidArgument`: dstest cannot tell). ``path`` names the first difference
    from ``where`` on, down to the element of a tensor or array.
    """
    return _Compare(rtol, atol, names).diff(a, b, where)


class _Compare:
    def __init__(self, rtol: float, atol: float, names: tuple[str, str]) -> None:
        self.tolerant = rtol > 0 or atol > 0
        self.rtol, self.atol, self.names = rtol, atol, names
        self.open: set[tuple[int, int]] = set()  # container pairs being compared (a cycle compares once)

    def diff(self, a: Any, b: Any, path: str) -> Difference | None:
        if type(a) is not type(b):
            return Difference(path, f"{type(a).__qualname__} vs {type(b).__qualname__}")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(a, torch.Tensor):
            return self.tensors(a, b, path)
        np = sys.modules.get("numpy")  # not imported: no value can be numpy's
        if np is not None and isinstance(a, np.ndarray | np.generic):
            return self.arrays(np, np.asarray(a), np.asarray(b), path)
        if isinstance(a, float):
            return self.floats(a, b, path)
        if isinstance(a, complex):
            return self.floats(a, b, path)
        if isinstance(a, dict | list | tuple) or (dataclasses.is_dataclass(a) and not isinstance(a, type)):
            key = (id(a), id(b))
            if key in self.open:
                return None
            self.open.add(key)
            try:
                return self.containers(a, b, path)
            finally:
                self.open.discard(key)
        return self.plain(a, b, path)

    # -- containers ------------------------------------------------------------------------------------------
    def containers(self, a: Any, b: Any, path: str) -> Difference | None:
        if isinstance(a, dict):
            only_a, only_b = [k for k in a if k not in b], [k for k in b if k not in a]
            if only_a or only_b:
                parts = [
                    f"{ks!r} only on the {name}"
                    for ks, name in ((only_a, self.names[0]), (only_b, self.names[1]))
                    if ks
                ]
                return Difference(path, "keys " + ", ".join(parts))
            pairs: Any = ((f"[{k!r}]", a[k], b[k]) for k in a)
        elif isinstance(a, tuple) and hasattr(type(a), "_fields"):  # a namedtuple
            names: tuple[str, ...] = type(a)._fields  # type: ignore[attr-defined]
            pairs = ((f".{name}", x, y) for name, x, y in zip(names, a, b))
        elif isinstance(a, list | tuple):
            if len(a) != len(b):
                return Difference(path, f"{type(a).__qualname__} of {len(a)} vs {type(b).__qualname__} of {len(b)}")
            pairs = ((f"[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b)))
        else:
            fields = [f.name for f in dataclasses.fields(a) if f.compare]
            pairs = ((f".{name}", getattr(a, name), getattr(b, name)) for name in fields)
        for step, x, y in pairs:
            found = self.diff(x, y, path + step)
            if found is not None:
                return found
        return None

    # -- numbers -----------------------------------------------------------------------------------------------
    def floats(self, a: Any, b: Any, path: str) -> Difference | None:
        """Python floats and complex numbers: bit for bit, or within the tolerances."""
        if self.tolerant:
            parts = [(a.real, b.real), (a.imag, b.imag)] if isinstance(a, complex) else [(a, b)]
            if all(
                (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=self.rtol, abs_tol=self.atol)
                for x, y in parts
            ):
                return None
            return Difference(path, f"{a!r} vs {b!r} (beyond rtol={self.rtol:g}, atol={self.atol:g})")
        bits = [_float_bits(a.real), _float_bits(a.imag)] if isinstance(a, complex) else [_float_bits(a)]
        other = [_float_bits(b.real), _float_bits(b.imag)] if isinstance(b, complex) else [_float_bits(b)]
        if bits == other:
            return None
        why = f"{a!r} vs {b!r}"
        if repr(a) == repr(b):  # NaNs of other payloads print alike: show the bits
            why += f" (bits {' '.join(f'{x:#018x}' for x in bits)} vs {' '.join(f'{y:#018x}' for y in other)})"
        return Difference(path, why)

    def plain(self, a: Any, b: Any, path: str) -> Difference | None:
        try:
            same = a == b
        except Exception as exc:
            raise InvalidArgument(
                f"crosscheck cannot compare {path or 'the value'}: {type(a).__qualname__} == "
                f"{type(b).__qualname__} raised {type(exc).__name__}: {exc}"
            ) from exc
        np = sys.modules.get("numpy")  # numpy's bool scalar is fine (named bool_ before numpy 2, bool since)
        if not isinstance(same, bool) and not (np is not None and isinstance(same, np.bool_)):
            raise InvalidArgument(
                f"crosscheck cannot compare {path or 'the value'}: {type(a).__qualname__} == {type(b).__qualname__} "
                f"gave {type(same).__qualname__}, not True or False, so dstest cannot tell whether the worlds agree; "
                "return tensors, numpy arrays, containers of them, or values whose == gives a bool"
            )
        if same:
            return None
        if isinstance(a, set | frozenset):
            return Difference(path, f"only on the {self.names[0]}: {a - b!r}; only on the {self.names[1]}: {b - a!r}")
        return Difference(path, f"{a!r} vs {b!r}")

    # -- tensors and arrays --------------------------------------------------------------------------------------
    def tensors(self, a: Any, b: Any, path: str) -> Difference | None:
        import torch

        if a.dtype != b.dtype or a.shape != b.shape:
            return Difference(path, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        if a.layout != b.layout or a.is_meta != b.is_meta:
            return Difference(path, f"{_layout(a)} vs {_layout(b)} tensors")
        if a.is_meta:
            return None  # no data: dtype and shape are all there is
        if a.is_quantized:  # its integers and how they map to values (its bytes: torch.equal crashes on them)
            qa, qb = _quantization(a), _quantization(b)
            if qa != qb:
                return Difference(path, f"quantized {a.dtype} tensors of other quantization: {qa} vs {qb}")
            return self.tensors(a.int_repr(), b.int_repr(), path)
        try:
            x, y = _tensor_bytes(a), _tensor_bytes(b)
        except Exception as exc:
            raise InvalidArgument(
                f"crosscheck cannot compare {path or 'the value'}: a {_layout(a)} {a.dtype} tensor has no bytes "
                f"to compare ({type(exc).__name__}: {exc})"
            ) from exc
        kind = f"{a.dtype} tensors"
        if self.tolerant and (a.is_floating_point() or a.is_complex()):
            wide = torch.complex128 if a.is_complex() else torch.float64
            va, vb = x.view(a.dtype).to(wide), y.view(a.dtype).to(wide)
            bad = ~torch.isclose(va, vb, rtol=self.rtol, atol=self.atol, equal_nan=True)
            if not bool(bad.any()):
                return None
            first, count = int(bad.to(torch.uint8).argmax()), int(bad.sum())
            kind += f" differ beyond rtol={self.rtol:g}, atol={self.atol:g}"
        else:
            if torch.equal(x, y):
                return None
            bad = (x != y).view(-1, a.element_size()).any(1)
            first, count = int(bad.to(torch.uint8).argmax()), int(bad.sum())
            kind += " differ"
        size = a.element_size()
        ea, eb = x[first * size : (first + 1) * size], y[first * size : (first + 1) * size]
        shown = _shown(_item(ea.view(a.dtype)), _item(eb.view(a.dtype)), bytes(ea.tolist()), bytes(eb.tolist()))
        return Difference(
            path + _index(first, tuple(a.shape)), f"{kind}: {shown} ({count} of {a.numel()} elements differ)"
        )

    def arrays(self, np: Any, a: Any, b: Any, path: str) -> Difference | None:
        if a.dtype != b.dtype or a.shape != b.shape:
            return Difference(path, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)} arrays")
        if a.dtype.names:  # a structured array: field by field (an aligned dtype's padding holds anything)
            for name in a.dtype.names:
                found = self.arrays(np, a[name], b[name], f"{path}[{name!r}]")
                if found is not None:
                    return found
            return None
        fa, fb = a.reshape(-1), b.reshape(-1)
        if a.dtype.hasobject:  # the bytes are pointers: compare the objects
            for i in range(fa.size):
                found = self.diff(fa[i], fb[i], path + _index(i, a.shape))
                if found is not None:
                    return found
            return None
        size = a.dtype.itemsize
        x = np.ascontiguousarray(fa).view(np.uint8)
        y = np.ascontiguousarray(fb).view(np.uint8)
        kind = f"{a.dtype} arrays"
        if self.tolerant and a.dtype.kind in "fc":
            bad = ~np.isclose(fa, fb, rtol=self.rtol, atol=self.atol, equal_nan=True)
            kind += f" differ beyond rtol={self.rtol:g}, atol={self.atol:g}"
        elif a.dtype.type in (np.longdouble, np.clongdouble) and np.finfo(np.longdouble).nmant == 63:
            # x87 extended precision: 10 bytes of value in 12 or 16, the rest padding that no computation
            # sets: compare values (equal with the same sign, or both NaN; NaN payloads are not seen)
            parts = [(fa.real, fb.real), (fa.imag, fb.imag)] if a.dtype.kind == "c" else [(fa, fb)]
            bad = np.zeros(fa.shape, dtype=bool)
            for p, q in parts:
                bad |= ~(((p == q) & (np.signbit(p) == np.signbit(q))) | (np.isnan(p) & np.isnan(q)))
            kind += " differ"
        else:
            if size == 0 or np.array_equal(x, y):
                return None
            bad = (x != y).reshape(-1, size).any(axis=1)
            kind += " differ"
        if not bad.any():
            return None
        first, count = int(bad.argmax()), int(bad.sum())
        ea, eb = x[first * size : (first + 1) * size], y[first * size : (first + 1) * size]
        shown = _shown(fa[first].item(), fb[first].item(), ea.tobytes(), eb.tobytes())
        return Difference(path + _index(first, a.shape), f"{kind}: {shown} ({count} of {a.size} elements differ)")


def _float_bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


def _layout(t: Any) -> str:
    return "meta" if t.is_meta else str(t.layout).removeprefix("torch.")


def _tensor_bytes(t: Any) -> Any:
    """The tensor's elements as one flat uint8 tensor, in row-major order, on the CPU (sparse tensors made
    dense). A conjugate or negative view is resolved by flipping sign bits, not by computing: torch's
    ``resolve_neg`` goes through float for bfloat16 and half, and makes every NaN the same NaN."""
    import torch

    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    conj, neg = t.is_conj(), t.is_neg()
    if neg and not (t.is_floating_point() or t.is_complex()):
        t, neg = t.resolve_neg(), False  # integers negate exactly
    if conj:
        t = t.conj()  # the stored values: conj() of a conjugate view only clears the bit
    if neg:  # the stored values: a plain tensor over the view's storage (the negative bit is the view's only)
        t = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    if not (conj or neg):
        return raw
    size = t.element_size()
    half = size // 2 if t.is_complex() else size
    flips = torch.zeros(size, dtype=torch.uint8)  # the sign bits to flip in each element
    if neg:
        flips[half - 1] ^= 0x80  # the real part (the whole element of a real dtype)
    if t.is_complex() and neg != conj:
        flips[size - 1] ^= 0x80  # the imaginary part: negated by one of the two, not by both
    return (raw.view(-1, size) ^ flips).reshape(-1)


def _quantization(t: Any) -> tuple[Any, ...]:
    """A quantized tensor's scheme and parameters (per tensor, or per channel along an axis)."""
    import torch

    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return (str(scheme), _float_bits(t.q_scale()), t.q_zero_point())
    return (
        str(scheme),
        t.q_per_channel_axis(),
        [_float_bits(x) for x in t.q_per_channel_scales().tolist()],
        t.q_per_channel_zero_points().tolist(),
    )


def _item(t: Any) -> Any:
    try:
        return t.reshape(()).item()
    except Exception:  # a dtype whose elements Python cannot hold: the bits speak
        return None


def _shown(x: Any, y: Any, bits_x: bytes, bits_y: bytes) -> str:
    """``7.0 vs 3.0``; the bits too when the values print alike (NaN payloads) or not at all."""
    text = f"{x!r} vs {y!r}"
    if x is None or repr(x) == repr(y):
        text += f" (bits {_hex(bits_x)} vs {_hex(bits_y)})"
    return text


def _hex(raw: bytes) -> str:
    """An element's bytes as the number they make (little-endian, as every CPU dstest runs on stores them)."""
    return f"{int.from_bytes(raw, 'little'):#0{2 + 2 * len(raw)}x}"


def _index(flat: int, shape: tuple[int, ...]) -> str:
    """``[1, 0]``: the index of element ``flat`` (row-major) of ``shape``; ``""`` for a 0-d value."""
    if not shape:
        return ""
    out = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        out.append(i)
    return "[" + ", ".join(map(str, reversed(out))) + "]"


def _trace_difference(world_size: int, traces: dict[str, list[list[tuple[Any, ...]]]]) -> str | None:
    (first, a), (second, b) = traces.items()
    for rank in range(world_size):
        calls_a, calls_b = a[rank], b[rank]
        for i in range(max(len(calls_a), len(calls_b))):
            x = calls_a[i] if i < len(calls_a) else None
            y = calls_b[i] if i < len(calls_b) else None
            if x != y:
                return (
                    f"rank {rank}'s call {i + 1}: {first} world {_describe(x) if x else 'no call'}, "
                    f"{second} world {_describe(y) if y else 'no call'}"
                )
    return None


class Outcome(NamedTuple):
    """One world's run of a body: its per-rank results or its failure, and each rank's trace signatures."""

    results: list[Any] | None
    failure: RankFailure | None
    traces: list[list[tuple[Any, ...]]]


def run_recorded(world_size: int, call: Callable[[], list[Any]]) -> Outcome:
    """Run ``call`` (one world run) under a trace recording: its results or failure, and each rank's trace."""
    from dstest.trace import recording

    results, failure = None, None
    with recording() as rec:
        try:
            results = call()
        except RankFailure as err:
            failure = err
    runs = rec.runs[-1:] if rec.runs else []
    traces = [[trace_signature(c) for c in runs[0].view(r).calls] if runs else [] for r in range(world_size)]
    return Outcome(results, failure, traces)


def compare_outcomes(
    name: str, world_size: int, outcomes: dict[str, Outcome], *, rtol: float, atol: float
) -> list[Any]:
    """Compare two worlds' outcomes of one body: verdicts, per-rank results, traces; the first difference raises
    :class:`WorldsDiverge` naming the rank, what differs and both sides. Returns the first world's results;
    both failing raises the first world's failure."""
    first, second = outcomes
    failures = {world: o.failure for world, o in outcomes.items() if o.failure is not None}
    if len(failures) == 2:
        raise failures[first]
    if failures:
        bad = next(iter(failures))
        good = second if bad == first else first
        raise WorldsDiverge(
            f"{name} at world size {world_size} passes on the {good} world and fails on the {bad} world; "
            f"the {bad} world's failure:\n{failures[bad]}"
        ) from failures[bad]
    results = [outcomes[first].results or [], outcomes[second].results or []]
    sides = (f"{first} world", f"{second} world")
    for rank in range(world_size):
        where = f"rank {rank}'s result"
        found = difference(results[0][rank], results[1][rank], rtol=rtol, atol=atol, names=sides, where=where)
        if found is not None:
            raise WorldsDiverge(f"{name} at world size {world_size}: {found} ({first} world vs {second} world)")
    why = _trace_difference(world_size, {world: o.traces for world, o in outcomes.items()})
    if why:
        raise WorldsDiverge(f"{name} at world size {world_size}: the collective traces differ at {why}")
    return results[0]
