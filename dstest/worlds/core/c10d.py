"""The c10d methods a process group answers, and the collective each one is: one table for both worlds.

torch calls a process group's methods (``allreduce``, ``_allgather_base``, ``alltoall_base``, ``send``...)
with its own argument conventions: lists of one tensor, nested output lists, an options object that holds
the reduce op and the root. Each entry of :data:`METHODS` says, once, how one method's arguments become a
``Call`` (by its op name in ``dstest.worlds.collectives.CALLS``); :func:`install` gives a class one
method per entry (and the aliases torch's releases use), each handing the entry and the bound arguments to
the class's ``_c10d(method, args)``. The threaded world's ``Group`` (which delivers data itself) and the
process world's ``CheckedGroup`` (which posts metadata to the referee, then issues the same method to
gloo) are both built this way, so the mapping from a c10d call to what ranks must agree on cannot differ
between the worlds.

What differs is how a world hands buffers to the ``Call`` (tensors, or their pickled metadata) and how it
reads c10d's options: a :class:`Buffers` of its own. Torch-free: the table names c10d's option classes
and ``Call`` ops as strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dstest.errors import InvalidArgument

__all__ = [
    "ALIASES",
    "COLLECTIVES",
    "METHODS",
    "RECORDED_OPS",
    "TRANSFERS",
    "Buffers",
    "Method",
    "bind",
    "check_peer_rank",
    "install",
    "one_tensor",
]


def one_tensor(tensors: Sequence[Any], what: str) -> Any:
    """The single tensor of a c10d tensor list (c10d passes lists; dstest's worlds take one per rank)."""
    if len(tensors) != 1:
        raise InvalidArgument(f"{what}: expected exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


def check_peer_rank(kind: str, peer: int, size: int, where: str) -> None:
    """Raise InvalidArgument when a transfer's peer (a group rank) is not a rank of its group."""
    if not 0 <= peer < size:
        raise InvalidArgument(f"{kind}: peer rank {peer} is not in {where} (group ranks 0..{size - 1})")


class Buffers(Protocol):
    """How a world gives a ``Call`` its buffers and reads c10d's options."""

    def tensor(self, t: Any) -> Any:
        """The buffer of one tensor."""

    def one(self, tensors: Sequence[Any], what: str) -> Any:
        """The buffer of a one-tensor list (:func:`one_tensor`)."""

    def each(self, tensors: Sequence[Any]) -> list[Any]:
        """A list of buffers."""

    def flat(self, tensors: Sequence[Any]) -> Any:
        """The tensors as one flat buffer (the coalesced all-reduce reduces them as one)."""

    def op(self, opts: Any) -> str:
        """The reduce op's name in ``opts`` (``"sum"``, ``"avg"``, a ``PremulSum``...)."""

    def root(self, opts: Any) -> int:
        """The root rank in ``opts``."""


Args = Mapping[str, Any]


@dataclass(frozen=True)
class Method:
    """One c10d method of a process group.

    ``kind``: ``"collective"`` (one ``Call``), ``"flat"`` (one ``Call`` over the tensors as one flat
    buffer), ``"coalesced"`` (pairs of ``outputs`` and ``inputs``, each run as the method ``part``, in list
    order), ``"p2p"`` (a transfer to or from the peer named by ``params[1]``).
    """

    name: str
    params: tuple[str, ...]  # positional parameters after self, as c10d passes them
    options: str = ""  # the c10d options class, built when the caller passes none
    op: str = ""  # the Call's op
    args: Callable[[Buffers, Args], tuple[Any, ...]] | None = None  # the Call's arguments after (rank, size)
    kind: str = "collective"
    part: str = ""


def _first(lists: Sequence[Sequence[Any]]) -> Sequence[Any]:
    return lists[0] if lists else []


METHODS: tuple[Method, ...] = (
    Method(
        "allreduce", ("tensors", "opts"), "AllreduceOptions", "all_reduce",
        lambda b, a: (b.one(a["tensors"], "all_reduce"), b.op(a["opts"])),
    ),
    Method(
        "allreduce_coalesced", ("tensors", "opts"), "AllreduceCoalescedOptions", "all_reduce",
        lambda b, a: (b.flat(a["tensors"]), b.op(a["opts"])), kind="flat",
    ),
    Method(
        "broadcast", ("tensors", "opts"), "BroadcastOptions", "broadcast",
        lambda b, a: (b.one(a["tensors"], "broadcast"), b.root(a["opts"])),
    ),
    Method(
        "reduce", ("tensors", "opts"), "ReduceOptions", "reduce",
        lambda b, a: (b.one(a["tensors"], "reduce"), b.op(a["opts"]), b.root(a["opts"])),
    ),
    Method(
        "allgather", ("outputs", "inputs", "opts"), "AllgatherOptions", "all_gather",
        lambda b, a: (b.each(a["outputs"][0]), b.one(a["inputs"], "all_gather")),
    ),
    Method(
        "_allgather_base", ("output", "inp", "opts"), "AllgatherOptions", "all_gather_into_tensor",
        lambda b, a: (b.tensor(a["output"]), b.tensor(a["inp"])),
    ),
    Method(
        "reduce_scatter", ("outputs", "inputs", "opts"), "ReduceScatterOptions", "reduce_scatter",
        lambda b, a: (b.one(a["outputs"], "reduce_scatter"), b.each(a["inputs"][0]), b.op(a["opts"])),
    ),
    Method(
        "_reduce_scatter_base", ("output", "inp", "opts"), "ReduceScatterOptions", "reduce_scatter_tensor",
        lambda b, a: (b.tensor(a["output"]), b.tensor(a["inp"]), b.op(a["opts"])),
    ),
    Method(
        "alltoall", ("outputs", "inputs", "opts"), "AllToAllOptions", "all_to_all",
        lambda b, a: (b.each(a["outputs"]), b.each(a["inputs"])),
    ),
    Method(
        "alltoall_base", ("output", "inp", "output_split_sizes", "input_split_sizes", "opts"), "AllToAllOptions",
        "all_to_all_single",
        lambda b, a: (
            b.tensor(a["output"]), b.tensor(a["inp"]), a["output_split_sizes"], a["input_split_sizes"]
        ),
    ),
    Method(
        "gather", ("outputs", "inputs", "opts"), "GatherOptions", "gather",
        lambda b, a: (b.each(_first(a["outputs"])), b.one(a["inputs"], "gather"), b.root(a["opts"])),
    ),
    Method(
        "scatter", ("outputs", "inputs", "opts"), "ScatterOptions", "scatter",
        lambda b, a: (b.one(a["outputs"], "scatter"), b.each(_first(a["inputs"])), b.root(a["opts"])),
    ),
    Method("barrier", ("opts",), "BarrierOptions", "barrier", lambda b, a: ()),
    Method(
        "all_gather_single_coalesced", ("outputs", "inputs", "opts"), "AllgatherOptions",
        kind="coalesced", part="_allgather_base",
    ),
    Method(
        "reduce_scatter_single_coalesced", ("outputs", "inputs", "opts"), "ReduceScatterOptions",
        kind="coalesced", part="_reduce_scatter_base",
    ),
    Method("send", ("tensors", "dst", "tag"), kind="p2p"),
    Method("recv", ("tensors", "src", "tag"), kind="p2p"),
)  # fmt: skip

#: The collectives of the table, each ``Call`` op once, in the table's order: every list of collective names
#: in dstest is made from this one.
COLLECTIVES: tuple[str, ...] = tuple(dict.fromkeys(m.op for m in METHODS if m.op))
#: The transfers of the table (its ``"p2p"`` methods), named as dstest records them.
TRANSFERS: tuple[str, ...] = tuple(m.name for m in METHODS if m.kind == "p2p")
#: Every op dstest records of a run: the collectives, then the transfers.
RECORDED_OPS: tuple[str, ...] = COLLECTIVES + TRANSFERS

#: Other names torch's releases call the same methods by (2.13 calls the first three; older ones the
#: ``_base`` names).
ALIASES: dict[str, str] = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}

_DEFAULTS: dict[str, Any] = {"opts": None, "tag": 0}


def bind(method: Method, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (``opts`` and ``tag`` may be left out)."""
    bound = dict(zip(method.params, args))
    if kwargs:
        unknown = set(kwargs) - set(method.params)
        if unknown:
            raise TypeError(f"{method.name}() got unexpected keyword arguments {sorted(unknown)}")
        bound.update(kwargs)
    if len(bound) < len(method.params):
        for p in method.params:
            if p not in bound:
                if p not in _DEFAULTS:
                    raise TypeError(f"{method.name}() missing argument {p!r}")
                bound[p] = _DEFAULTS[p]
    return bound


def _make(method: Method) -> Callable[..., Any]:
    params, count = method.params, len(method.params)

    def c10d_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == count:  # how torch calls them: every argument, by position
            return self._c10d(method, dict(zip(params, args)))
        return self._c10d(method, bind(method, args, kwargs))

    c10d_method.__name__ = c10d_method.__qualname__ = method.name
    c10d_method.__doc__ = f"c10d's ``{method.name}({', '.join(method.params)})`` (see dstest.worlds.core.c10d)."
    return c10d_method


_T = TypeVar("_T", bound=type)


def install(cls: _T) -> _T:
    """Class decorator: one method per entry of :data:`METHODS` and :data:`ALIASES`, each calling
    ``self._c10d(method, args)``; and ``recv_anysource``, which every world refuses."""
    for method in METHODS:
        setattr(cls, method.name, _make(method))
    for alias, name in ALIASES.items():
        setattr(cls, alias, getattr(cls, name))
    cls.recv_anysource = _recv_anysource  # type: ignore[attr-defined]
    return cls


def _recv_anysource(self: Any, tensors: Sequence[Any], tag: int = 0) -> Any:
    """``dist.recv`` without ``src``: refused in every world (a transfer is matched by its two ranks)."""
    raise InvalidArgument("recv without src (any source) is not supported by dstest's worlds: pass src")
