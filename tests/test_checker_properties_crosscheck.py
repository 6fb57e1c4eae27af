"""Checking the checkers: crosscheck's comparison of results (contract E14), as properties.

:func:`dstest.crosscheck.difference` is what decides whether two worlds gave the same per-rank result. These
properties drive it directly over random results: tensors of every dtype torch can hold in bytes and numpy
arrays of every numeric dtype, of random bytes (so NaNs of every payload, infinities, ``-0.0``), from empty to
about 1 MB, contiguous or seen through a transpose, a conjugate or a negative view, nested in random lists,
tuples, dicts, namedtuples and dataclasses, next to plain Python floats and ints. Then:

- two results built alike (equal bits, distinct objects) compare equal;
- one perturbation anywhere (a flipped bit, a sign flip of a block of elements, two elements swapped at any
  distance, ``0.0`` against ``-0.0``, a NaN against a NaN of another payload, one element added or removed,
  a dict key renamed, one element added to or removed from a list or tuple) is reported, at the path of the
  perturbed value and, for an element, at the index of the first perturbed element in row-major order;
- with tolerances, values within them compare equal (NaN equal to NaN) and one element beyond them is named.

A small fixed sample then goes through :func:`dstest.crosscheck` itself (threaded and process world).
See docs/checking-the-checkers.md.
"""

from __future__ import annotations

import math
import random
import struct
from collections import namedtuple
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dstest
from dstest.crosscheck import difference
from dstest.errors import WorldsDiverge

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

MAX_BYTES = 1 << 20  # the largest leaf: about 1 MB

TORCH_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
]
NUMPY_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
# (exponent bits, mantissa bits) of each floating format, by the dtype of one component; "fn": float8_e4m3fn,
# whose only NaNs are S.1111.111.
FLOAT_FORMATS: dict[str, Any] = {
    "float16": (5, 10),
    "bfloat16": (8, 7),
    "float32": (8, 23),
    "float64": (11, 52),
    "float8_e5m2": (5, 2),
    "float8_e4m3fn": "fn",
}
COMPONENT = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}

Pair = namedtuple("Pair", "first second")


@dataclass
class Box:
    left: Any
    right: Any


@dataclass(frozen=True)
class Leaf:
    kind: str  # "torch" | "numpy" | "float" (a Python float) | "int" (a Python int)
    dtype: str
    shape: tuple[int, ...]
    seed: int
    view: str = "plain"  # "plain" | "t" (transposed) | "conj" | "neg" (torch's conjugate and negative views)

    @property
    def itemsize(self) -> int:
        if self.kind == "torch":
            return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return np.dtype(self.dtype).itemsize if self.kind == "numpy" else 8

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def floating(self) -> bool:
        return self.kind == "float" or COMPONENT.get(self.dtype, self.dtype) in FLOAT_FORMATS


# -- building results from bytes -----------------------------------------------------------------------------
def leaf_bytes(leaf: Leaf) -> bytearray:
    raw = bytearray(random.Random(leaf.seed).randbytes(leaf.numel * leaf.itemsize))
    if leaf.dtype == "bool":
        raw = bytearray(b & 1 for b in raw)
    return raw


def build_leaf(leaf: Leaf, raw: bytearray) -> Any:
    if leaf.kind == "float":
        return struct.unpack("<d", bytes(raw))[0]
    if leaf.kind == "int":
        return int.from_bytes(raw, "little", signed=True)
    if leaf.kind == "numpy":
        a = np.frombuffer(bytes(raw), dtype=np.dtype(leaf.dtype)).reshape(leaf.shape).copy()
        if leaf.view == "t":
            return a.T
        return a[()] if leaf.shape == () else a  # 0-d: a numpy scalar
    flat = (
        torch.tensor(list(raw[:0]), dtype=torch.uint8)
        if not raw
        else torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    )
    t = flat.view(getattr(torch, leaf.dtype)).reshape(leaf.shape).clone()
    if leaf.view == "t":
        return t.t()
    if leaf.view == "conj":
        return t.conj()
    if leaf.view == "neg":
        return torch._neg_view(t)
    return t


def build(node: Any, raws: dict[str, bytearray], path: str = "") -> Any:
    """The result a spec describes; ``raws`` holds the bytes of leaves that are not their seed's."""
    if isinstance(node, Leaf):
        return build_leaf(node, raws[path] if path in raws else leaf_bytes(node))
    kind, children = node
    if kind == "dict":
        return {k: build(c, raws, f"{path}[{k!r}]") for k, c in children}
    if kind == "pair":
        return Pair(*(build(c, raws, f"{path}.{f}") for f, c in zip(Pair._fields, children)))
    if kind == "box":
        return Box(*(build(c, raws, f"{path}.{f}") for f, c in zip(("left", "right"), children)))
    items = [build(c, raws, f"{path}[{i}]") for i, c in enumerate(children)]
    return items if kind == "list" else tuple(items)


def nodes(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (path, node) of a spec, the root first."""
    out = [(path, node)]
    if isinstance(node, Leaf):
        return out
    kind, children = node
    if kind == "dict":
        steps = [(f"[{k!r}]", c) for k, c in children]
    elif kind in ("pair", "box"):
        steps = [(f".{f}", c) for f, c in zip(Pair._fields if kind == "pair" else ("left", "right"), children)]
    else:
        steps = [(f"[{i}]", c) for i, c in enumerate(children)]
    for step, child in steps:
        out += nodes(child, path + step)
    return out


def replace_at(node: Any, path: str, new: Any, here: str = "") -> Any:
    """The spec with the node at ``path`` replaced by ``new``."""
    if here == path:
        return new
    if isinstance(node, Leaf):
        return node
    kind, children = node
    if kind == "dict":
        return (kind, tuple((k, replace_at(c, path, new, f"{here}[{k!r}]")) for k, c in children))
    if kind in ("pair", "box"):
        fields = Pair._fields if kind == "pair" else ("left", "right")
        return (kind, tuple(replace_at(c, path, new, f"{here}.{f}") for f, c in zip(fields, children)))
    return (kind, tuple(replace_at(c, path, new, f"{here}[{i}]") for i, c in enumerate(children)))


# -- strategies -------------------------------------------------------------------------------------------------
#: The perturbations of one value; each has its own property run, so that each gets the examples it needs.
PERTURBATIONS = ["flip", "sign", "swap", "negzero", "nan", "grow", "shrink"]
FLOATING = {"torch": [d for d in TORCH_DTYPES if COMPONENT.get(d, d) in FLOAT_FORMATS]}
FLOATING["numpy"] = [d for d in NUMPY_DTYPES if COMPONENT.get(d, d) in FLOAT_FORMATS]


@st.composite
def leaves(draw: Any, how: str | None = None) -> Leaf:
    """A value (a tensor, a numpy array or scalar, a Python float or int) that the perturbation ``how``
    applies to (any when None)."""
    kinds = ["torch", "torch", "numpy", "numpy", "float", "int"]
    if how in ("negzero", "nan"):
        kinds = ["torch", "torch", "numpy", "float"]
    elif how in ("swap", "grow", "shrink"):
        kinds = ["torch", "numpy"]
    kind = draw(st.sampled_from(kinds))
    if kind in ("float", "int"):
        return Leaf(kind, "float64" if kind == "float" else "int64", (), draw(st.integers(0, 2**32)))
    floating = how in ("negzero", "nan")
    dtype = draw(st.sampled_from(FLOATING[kind] if floating else TORCH_DTYPES if kind == "torch" else NUMPY_DTYPES))
    itemsize = Leaf(kind, dtype, (), 0).itemsize
    least = {"swap": 2, "grow": 0, None: 0}.get(how, 1)
    n = draw(st.one_of(st.integers(least, 8), st.integers(least, 300), st.integers(least, MAX_BYTES // itemsize)))
    form = draw(st.sampled_from(["flat", "rows", "scalar"]))
    if form == "scalar" and n == 1:
        shape: tuple[int, ...] = ()
    elif form == "rows":
        cols = draw(st.sampled_from([k for k in (1, 2, 3, 4, 8, 64) if n % k == 0]))
        shape = (n // cols, cols)
    else:
        shape = (n,)
    views = ["plain"] + (["t"] if len(shape) == 2 else [])
    if kind == "torch" and dtype.startswith("complex"):
        views += ["conj", "neg"]
    elif kind == "torch" and dtype in FLOAT_FORMATS and not dtype.startswith("float8"):
        views += ["neg"]
    return Leaf(kind, dtype, shape, draw(st.integers(0, 2**32)), draw(st.sampled_from(views)))


KEYS = st.one_of(st.text(alphabet="abwxyz", min_size=1, max_size=3), st.integers(0, 9))


def specs() -> Any:
    def extend(children: Any) -> Any:
        return st.one_of(
            st.lists(children, max_size=4).map(lambda cs: ("list", tuple(cs))),
            st.lists(children, max_size=4).map(lambda cs: ("tuple", tuple(cs))),
            st.dictionaries(KEYS, children, max_size=4).map(lambda d: ("dict", tuple(d.items()))),
            st.tuples(children, children).map(lambda cs: ("pair", cs)),
            st.tuples(children, children).map(lambda cs: ("box", cs)),
        )

    return st.recursive(leaves(), extend, max_leaves=6)


# -- perturbations ------------------------------------------------------------------------------------------------
def _view_index(leaf: Leaf, positions: list[int]) -> str:
    """The index at which the comparison must report the first of the perturbed elements (base row-major
    positions), in the order of the value as the result holds it (a transpose reorders)."""
    if leaf.shape == () or (leaf.kind == "numpy" and leaf.shape == ()):
        return ""
    pos = np.asarray(positions)
    shape = leaf.shape
    if leaf.view == "t":
        rows, cols = shape
        pos = (pos % cols) * rows + pos // cols
        shape = (cols, rows)
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(int(pos.min()), shape)) + "]"


def _nan_bits(dtype: str, sign: int, mantissa: int) -> int:
    fmt = FLOAT_FORMATS[dtype]
    if fmt == "fn":
        return (sign << 7) | 0x7F
    e, m = int(fmt[0]), int(fmt[1])
    return (sign << (e + m)) | (((1 << e) - 1) << m) | (1 + mantissa % ((1 << m) - 1))


def perturb_leaf(
    data: Any, leaf: Leaf, raw: bytearray, how: str | None = None
) -> tuple[bytearray, Leaf, bytearray, str]:
    """(bytes of the original, the perturbed leaf, its bytes, the index the difference must be named at);
    ``how``: one of :data:`PERTURBATIONS` that applies to the leaf, or None for any that does."""
    s, n = leaf.itemsize, leaf.numel
    a, b = bytearray(raw), bytearray(raw)
    kinds = ["flip", "sign"] if n >= 1 else []
    kinds += ["swap"] if n >= 2 else []
    kinds += ["negzero", "nan"] if leaf.floating and n >= 1 else []
    kinds += ["grow"] + (["shrink"] if n >= 1 else []) if leaf.kind in ("torch", "numpy") else []
    how = how or data.draw(st.sampled_from(kinds), label="perturbation")
    assert how in kinds, (how, leaf)
    top = 0x01 if leaf.dtype == "bool" else 0x80  # the sign bit, in an element's last byte (little-endian)
    if how == "flip":
        i = data.draw(st.integers(0, n - 1), label="element")
        bit = 0 if leaf.dtype == "bool" else data.draw(st.integers(0, 8 * s - 1), label="bit")
        b[i * s + bit // 8] ^= 1 << (bit % 8)
        return a, leaf, b, _view_index(leaf, [i])
    if how == "sign":
        i = data.draw(st.integers(0, n - 1), label="block start")
        j = data.draw(st.integers(i, n - 1), label="block end")
        flipped = np.frombuffer(b, dtype=np.uint8).copy()
        flipped[np.arange(i, j + 1) * s + s - 1] ^= top
        b = bytearray(flipped.tobytes())
        return a, leaf, b, _view_index(leaf, list(range(i, j + 1)))
    if how == "swap":
        i = data.draw(st.integers(0, n - 2), label="first")
        j = data.draw(st.integers(i + 1, n - 1), label="second")
        if a[i * s : (i + 1) * s] == a[j * s : (j + 1) * s]:  # make them differ, on both sides
            a[j * s] ^= 1
            b[j * s] ^= 1
        b[i * s : (i + 1) * s], b[j * s : (j + 1) * s] = a[j * s : (j + 1) * s], a[i * s : (i + 1) * s]
        return a, leaf, b, _view_index(leaf, [i, j])
    if how in ("negzero", "nan"):
        i = data.draw(st.integers(0, n - 1), label="element")
        part = s // 2 if leaf.dtype in COMPONENT else s  # the real part of a complex element
        fmt = COMPONENT.get(leaf.dtype, leaf.dtype)
        if how == "negzero":
            first, second = 0, 1 << (8 * part - 1)
            if data.draw(st.booleans(), label="which side is -0.0"):
                first, second = second, first
        else:
            signs = data.draw(st.tuples(st.integers(0, 1), st.integers(0, 1)), label="signs")
            payloads = data.draw(st.tuples(st.integers(0, 2**52), st.integers(0, 2**52)), label="payloads")
            first, second = _nan_bits(fmt, signs[0], payloads[0]), _nan_bits(fmt, signs[1], payloads[1])
            if first == second:
                second = _nan_bits(fmt, 1 - signs[1], payloads[1])
        a[i * s : i * s + part] = first.to_bytes(part, "little")
        b[i * s : i * s + part] = second.to_bytes(part, "little")
        return a, leaf, b, _view_index(leaf, [i])
    # one element more or fewer: a flat value of another shape, named at the value itself
    i = data.draw(st.integers(0, n if how == "grow" else n - 1), label="where")
    if how == "grow":
        b[i * s : i * s] = a[0:s] if n else bytes(s)
    else:
        del b[i * s : (i + 1) * s]
    return a, replace(leaf, shape=(n + 1 if how == "grow" else n - 1,), view="plain"), b, ""


def perturb(data: Any, spec: Any) -> tuple[dict[str, bytearray], Any, dict[str, bytearray], str]:
    """(the original's leaf bytes, the perturbed spec, its leaf bytes, the path the difference must have)."""
    everything = nodes(spec)
    containers = [
        (p, n) for p, n in everything if not isinstance(n, Leaf) and (n[0] == "dict" or n[0] in ("list", "tuple"))
    ]
    targets = [(p, n) for p, n in everything if isinstance(n, Leaf)] + containers
    path, node = data.draw(st.sampled_from(targets), label="target")
    if isinstance(node, Leaf):
        a, leaf, b, index = perturb_leaf(data, node, leaf_bytes(node))
        return {path: a}, replace_at(spec, path, leaf), {path: b}, path + index
    kind, children = node
    if kind == "dict":
        choices = ["add"] + (["rename", "remove"] if children else [])
        how = data.draw(st.sampled_from(choices), label="dict change")
        keys = [k for k, _ in children]
        if how == "add":
            new_children = (*children, ("new key", Leaf("int", "int64", (), 0)))
        elif how == "remove":
            drop = data.draw(st.integers(0, len(children) - 1), label="key")
            new_children = children[:drop] + children[drop + 1 :]
        else:
            at = data.draw(st.integers(0, len(children) - 1), label="key")
            old = keys[at]
            renamed = f"{old}_renamed" if isinstance(old, str) else old + 100
            new_children = tuple((renamed if k == old else k, c) for k, c in children)
        return {}, replace_at(spec, path, (kind, new_children)), {}, path
    choices = ["grow"] + (["shrink"] if children else [])
    how = data.draw(st.sampled_from(choices), label="sequence change")
    at = data.draw(st.integers(0, len(children) - (0 if how == "grow" else 1)), label="where")
    if how == "grow":
        new = (*children[:at], Leaf("int", "int64", (), 7), *children[at:])
    else:
        new = children[:at] + children[at + 1 :]
    return {}, replace_at(spec, path, (kind, new)), {}, path


# -- the properties -------------------------------------------------------------------------------------------------
@given(specs())
def test_results_built_alike_compare_equal(spec: Any) -> None:
    assert difference(build(spec, {}), build(spec, {})) is None


@pytest.mark.parametrize("how", PERTURBATIONS)
@given(data=st.data())
def test_each_perturbation_of_a_value_is_reported_at_its_first_element(how: str, data: Any) -> None:
    leaf = data.draw(leaves(how), label="value")
    a, changed, b, index = perturb_leaf(data, leaf, leaf_bytes(leaf), how)
    original = build_leaf(leaf, a)
    assert difference(original, build_leaf(leaf, bytearray(a))) is None  # the unperturbed pair is equal
    found = difference(original, build_leaf(changed, b))
    assert found is not None, f"{how} of {leaf} was not seen"
    assert found.path == index, found


@given(specs(), st.data())
def test_one_perturbation_anywhere_is_reported_at_its_path(spec: Any, data: Any) -> None:
    raws_a, spec_b, raws_b, path = perturb(data, spec)
    original = build(spec, raws_a)
    assert difference(original, build(spec, raws_a)) is None  # the unperturbed pair (NaNs and all) is equal
    found = difference(original, build(spec_b, raws_b))
    assert found is not None, f"the perturbation at {path or 'the root'} was not seen"
    assert found.path == path, found


@st.composite
def close_values(draw: Any) -> tuple[Any, Any, int, str]:
    """(a, b within the tolerances of a, a flat index to push beyond them, the dtype)"""
    kind = draw(st.sampled_from(["torch", "numpy"]))
    dtype = draw(st.sampled_from(["float32", "float64", "complex64", "complex128"]))
    n = draw(st.integers(1, 20000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    values = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
    if dtype.startswith("complex"):
        values = values + 1j * rng.standard_normal(n)
    values[rng.random(n) < 0.1] = np.nan
    a = values.astype(dtype)
    b = (values + rng.uniform(-1e-7, 1e-7, n) * np.abs(values)).astype(dtype)  # well within rtol=1e-5
    i = draw(st.integers(0, n - 1))
    if kind == "torch":
        return torch.from_numpy(a), torch.from_numpy(b), i, dtype
    return a, b, i, dtype


@given(close_values())
def test_within_tolerances_values_compare_equal_and_one_beyond_is_named(case: Any) -> None:
    a, b, i, kind = case
    assert difference(a, b, rtol=1e-5, atol=1e-6) is None  # NaN equals NaN within tolerances
    beyond: Any = b.clone() if isinstance(b, torch.Tensor) else b.copy()
    x = complex(a[i])
    pushed = complex(3.0) if math.isnan(abs(x)) else x * 1.01 + 1.0  # NaN against a number, or 1% + 1 off
    beyond[i] = pushed if kind.startswith("complex") else pushed.real
    found = difference(a, beyond, rtol=1e-5, atol=1e-6)
    assert found is not None and found.path == f"[{i}]", found


# -- through dstest.crosscheck -------------------------------------------------------------------------------------
SAMPLE_SPEC = (
    "list",
    (
        Leaf("int", "int64", (), 1),
        (
            "dict",
            (
                ("w", Leaf("torch", "float32", (512, 256), 2)),  # 512 KB of random bits: NaNs of many payloads
                ("a", Leaf("numpy", "float64", (70000,), 3)),  # over numpy's repr threshold many times
                ("z", Leaf("torch", "complex64", (40, 64), 4, "t")),
                ("x", Leaf("float", "float64", (), 5)),
            ),
        ),
    ),
)


def sample_result(ctx: Any, changes: dict[str, Any]) -> Any:
    """The sample spec built from bytes; on rank 1 of the threaded world, with ``changes`` (a perturbed spec
    and leaf bytes). Module level: the process world finds it by reference."""
    if ctx.world == "threaded" and ctx.rank == 1:
        return build(changes["spec"], changes["raws"])
    return build(SAMPLE_SPEC, changes["original"])


def _sample_changes(path: str, how: str) -> tuple[dict[str, Any], str]:
    """A deterministic perturbation of the sample at ``path``, as the property's perturb would make it."""
    leaf = next(n for p, n in nodes(SAMPLE_SPEC) if p == path)
    raw = leaf_bytes(leaf)
    a, b = bytearray(raw), bytearray(raw)
    s = leaf.itemsize
    i = leaf.numel // 2 + 17
    if how == "flip":
        b[i * s] ^= 0x04
        index = _view_index(leaf, [i])
    elif how == "swap":
        j = leaf.numel - 1
        a[j * s] ^= 1 if a[i * s : (i + 1) * s] == a[j * s : (j + 1) * s] else 0
        b[:] = a
        b[i * s : (i + 1) * s], b[j * s : (j + 1) * s] = a[j * s : (j + 1) * s], a[i * s : (i + 1) * s]
        index = _view_index(leaf, [i, j])
    else:  # "negzero": the original holds 0.0, the perturbed -0.0
        part = s // 2 if leaf.dtype in COMPONENT else s
        a[i * s : i * s + part] = bytes(part)
        b[:] = a
        b[i * s + part - 1] ^= 0x80
        index = _view_index(leaf, [i])
    return {"spec": SAMPLE_SPEC, "raws": {path: b}, "original": {path: a}}, path + index


@pytest.mark.parametrize(
    ("path", "how"),
    [("[1]['a']", "flip"), ("[1]['w']", "swap"), ("[1]['z']", "negzero"), ("[1]['w']", "negzero"), ("", "same")],
)
def test_crosscheck_reports_a_perturbed_sample_at_its_path(path: str, how: str) -> None:
    if how == "same":
        results = dstest.crosscheck(
            sample_result, 2, kwargs={"changes": {"spec": SAMPLE_SPEC, "raws": {}, "original": {}}}
        )
        assert len(results) == 2
        return
    changes, expected = _sample_changes(path, how)
    with pytest.raises(WorldsDiverge) as info:
        dstest.crosscheck(sample_result, 2, kwargs={"changes": changes})
    assert f"rank 1's result{expected}: " in str(info.value), str(info.value)
