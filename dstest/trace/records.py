"""The records: one :class:`CallRecord` per rank per collective or transfer, a :class:`RankLog` per rank,
with exact totals, and how a call is labelled and measured (the table in :mod:`dstest.trace`). No torch import."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dstest.trace import native

#: Records kept per rank while a trace is asked for (``dstest.recording()``, ``--dstest-trace``); the
#: oldest are dropped beyond it. Counts and bytes stay exact whatever is kept.
RECORD_LIMIT = 100_000
#: Records kept per rank otherwise: enough for a failure's timeline and its trace file. Keeping every
#: record costs the garbage collector time in long runs (measured: benchmarks/bench_trace.py).
RING_LIMIT = 256
#: Calls per rank shown in a failure report's timeline.
TIMELINE_CALLS = 6
#: Ranks shown in a failure report's timeline (ranks with an unfinished or failed call first).
TIMELINE_RANKS = 16

# Frames in dstest's worlds and in this package are never a call site.
_here = os.path.dirname(os.path.abspath(__file__))
_OWN_DIRS: tuple[str, ...] = (os.path.join(os.path.dirname(_here), "worlds") + os.sep, _here + os.sep)
_SKIP_DIRS: tuple[str, ...] = _OWN_DIRS


def _skip_dirs() -> tuple[str, ...]:
    """Directories whose frames are not a call site: dstest's worlds and torch (found once torch is loaded)."""
    global _SKIP_DIRS
    if len(_SKIP_DIRS) == len(_OWN_DIRS):
        torch = sys.modules.get("torch")
        path = getattr(torch, "__file__", None)
        if path:
            found = [*_OWN_DIRS, os.path.dirname(os.path.abspath(path)) + os.sep]
            # torch's deprecation wrappers (torch 2.13: all_gather_into_tensor) run through this file
            extensions = getattr(sys.modules.get("typing_extensions"), "__file__", None)
            if extensions:
                found.append(os.path.abspath(extensions))
            _SKIP_DIRS = tuple(found)
            _SKIPPED_FILES.clear()
    return _SKIP_DIRS


#: Per file name: whether its frames are skipped (:func:`_skip_dirs`). Every collective walks the same few
#: frames of dstest and torch; a dict lookup per frame (a str caches its hash, a code object does not)
#: replaces a ``startswith`` over the directories.
_SKIPPED_FILES: dict[str, bool] = {}
_SKIPPED_FILES_LIMIT = 50_000  # file names of code made at run time (exec, generated code) must not pile up


def _classify(filename: str) -> bool:
    """Whether frames of ``filename`` are skipped, stored in the table the walks read first."""
    known = _SKIPPED_FILES
    skipped = filename.startswith(_skip_dirs())
    if len(known) >= _SKIPPED_FILES_LIMIT:
        known.clear()
    known[filename] = skipped
    return skipped


def py_call_site(depth: int = 2) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame outside dstest's worlds and torch."""
    known = _SKIPPED_FILES
    frame: Any = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        skipped = known.get(filename)
        if skipped is None:
            skipped = _classify(filename)
        if not skipped:
            return (filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def call_stack(depth: int = 2, limit: int = 4) -> tuple[tuple[str, int, str], ...]:
    """Up to ``limit`` frames outside dstest's worlds and torch, innermost first: the call site and its
    callers (a project's own communication wrapper is seldom the place to look)."""
    known = _SKIPPED_FILES
    found: list[tuple[str, int, str]] = []
    frame: Any = sys._getframe(depth)
    while frame is not None and len(found) < limit:
        code = frame.f_code
        filename = code.co_filename
        skipped = known.get(filename)
        if skipped is None:
            skipped = _classify(filename)
        if not skipped:
            found.append((filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(found)


def site_text(site: tuple[str, int, str] | None) -> str:
    if site is None:
        return "?"
    return f"{os.path.basename(site[0])}:{site[1]} ({site[2]})"


def _short_path(path: str) -> str:
    """The file and its directory: enough to tell ``deepspeed/comm/torch.py`` from torch's files."""
    head, tail = os.path.split(path)
    return os.path.join(os.path.basename(head), tail) if head else tail


#: The clock of every record (ns; the system-wide monotonic clock on Linux and macOS); bound directly,
#: not wrapped, as it is read four times per collective per rank.
now_ns = time.perf_counter_ns


#: A record's fields, in the order of ``as_dict``; both implementations have exactly these.
FIELDS: tuple[str, ...] = (
    "callers",
    "dtype",
    "error",
    "group",
    "kind",
    "nbytes",
    "numel",
    "op",
    "peer",
    "rank",
    "reduce_op",
    "root",
    "seq",
    "shapes",
    "site",
    "sync",
    "t_done",
    "t_post",
    "t_wait",
    "t_waited",
    "tag",
    "wait_site",
)


def error_text(error: BaseException) -> str:
    """A failed call's one-line error, as records keep it."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


class _Reading:
    """What a record answers, the same for both implementations (:class:`PyCallRecord`, the C one)."""

    __slots__ = ()
    # the fields, declared for the type checker (each implementation holds them)
    callers: tuple[tuple[str, int, str], ...]
    dtype: str
    error: str | None
    group: str
    kind: str
    nbytes: int
    numel: int
    op: str
    peer: int | None
    rank: int
    reduce_op: str | None
    root: int | None
    seq: int | None
    shapes: tuple[tuple[int, ...], ...]
    site: tuple[str, int, str] | None
    sync: bool
    t_done: int | None
    t_post: int
    t_wait: int | None
    t_waited: int | None
    tag: int | None
    wait_site: tuple[str, int, str] | None

    def issued_at(self) -> str:
        """Where the call was made and from where, innermost first: ``comm/torch.py:263 (all_gather) <-
        zero/partition_parameters.py:2046 (_allgather_params) <- ...``."""
        sites = [s for s in (self.site, *self.callers) if s is not None]
        if not sites:
            return "?"
        return " <- ".join(f"{_short_path(f)}:{line} ({fn})" for f, line, fn in sites)

    def describe(self) -> str:
        parts = [f"{self.dtype}{list(s)}" for s in self.shapes[:4]]
        if len(self.shapes) > 4:
            parts.append(f"... {len(self.shapes)} tensors")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"{'to' if self.op == 'send' else 'from'} rank {self.peer}")
        if self.tag:
            parts.append(f"tag={self.tag}")
        where = f" on {self.group}" + (f" seq {self.seq}" if self.seq is not None else "")
        return f"{self.op}({', '.join(parts)}){where}"

    def status(self) -> str:
        if self.error is not None:
            return f"failed: {self.error}"
        if self.t_done is None:
            return "not completed"
        return "done"

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        rec = cls.__new__(cls)
        for name in FIELDS:
            setattr(rec, name, d.get(name))
        return rec


class PyCallRecord(_Reading):
    """One rank's side of one collective or transfer: the pure-Python record (the C one,
    :mod:`dstest.trace.native`, is its twin, field for field and hook for hook)."""

    __slots__ = FIELDS

    def __init__(
        self,
        rank: int,
        op: str,
        group: str,
        seq: int | None,
        dtype: str,
        shapes: tuple[tuple[int, ...], ...],
        numel: int,
        nbytes: int,
    ) -> None:
        self.rank = rank
        self.op = op
        self.kind = "p2p" if op in ("send", "recv") else "collective"
        self.group = group
        self.seq = seq
        self.dtype = dtype
        self.shapes = shapes
        self.numel = numel
        self.nbytes = nbytes
        self.reduce_op = None
        self.root = None
        self.peer = None
        self.tag = None
        self.t_post = now_ns()
        self.t_done = None
        self.t_wait = None
        self.t_waited = None
        self.site = None
        self.callers = ()  # the site's callers outside torch and dstest
        self.wait_site = None
        self.error = None
        self.sync = False  # waited right after it was posted (a blocking call)

    # -- the world's hooks ---------------------------------------------------------------------------
    def finished(self, error: BaseException | None) -> None:
        """The call completed (any thread); ``error``: it failed."""
        if self.t_done is None:
            self.t_done = now_ns()
        if error is not None and self.error is None:
            self.error = error_text(error)

    def waiting(self, log: RankLog | None = None) -> None:
        """The rank starts waiting for this call (on its own thread)."""
        if self.t_wait is None:
            self.t_wait = now_ns()
            self.sync = log is not None and log.last is self
            # A blocking call waits where it was called; only a later wait needs its own site.
            self.wait_site = self.site if self.sync else py_call_site(3)

    def waited(self) -> None:
        if self.t_waited is None:
            self.t_waited = now_ns()


_native = native.load()
if TYPE_CHECKING:  # both implementations type as the Python one: same fields, same methods
    CallRecord = PyCallRecord
    call_site = py_call_site
elif _native is not None:
    _native.configure(_SKIPPED_FILES, _classify, error_text, time.perf_counter_ns)
    # The C record (:mod:`dstest.trace.native`) gets the reading methods the Python one inherits; it is
    # not subclassed, as a Python subclass would put its instances under the garbage collector.
    for _name in ("issued_at", "describe", "status", "as_dict"):
        setattr(_native.CallRecord, _name, _Reading.__dict__[_name])
    _native.CallRecord.from_dict = _Reading.__dict__["from_dict"]
    #: The record every world makes: the C one where it could be built, else :class:`PyCallRecord`.
    CallRecord = _native.CallRecord
    #: The records' call-site walk: the C one with the C records.
    call_site = _native.call_site
else:
    CallRecord = PyCallRecord
    call_site = py_call_site


class _Totals:
    """Counts, elements and bytes per (group, op)."""

    __slots__ = ("by_key",)

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], list[int]] = {}

    def add(self, rec: CallRecord) -> None:
        row = self.by_key.get((rec.group, rec.op))
        if row is None:
            self.by_key[(rec.group, rec.op)] = [1, rec.numel, rec.nbytes]
        else:
            row[0] += 1
            row[1] += rec.numel
            row[2] += rec.nbytes


class Window:
    def __init__(self) -> None:
        self.totals = _Totals()
        self.records: list[CallRecord] = []


class RankLog:
    """One rank's records and totals, and the windows open on it."""

    def __init__(self, rank: int, limit: int = RECORD_LIMIT) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.records: deque[CallRecord] = deque(maxlen=limit)
        self.posted = 0
        self.totals = _Totals()
        self.windows: list[Window] = []
        self.last: CallRecord | None = None

    def add(self, rec: CallRecord) -> None:
        key = (rec.group, rec.op)
        with self.lock:
            self.records.append(rec)
            self.posted += 1
            row = self.totals.by_key.get(key)
            if row is None:
                self.totals.by_key[key] = [1, rec.numel, rec.nbytes]
            else:
                row[0] += 1
                row[1] += rec.numel
                row[2] += rec.nbytes
            self.last = rec
            if self.windows:
                for w in self.windows:
                    w.totals.add(rec)
                    w.records.append(rec)

    @property
    def dropped(self) -> int:
        return self.posted - len(self.records)


# -- labels and measurements ----------------------------------------------------------------------------
def _abbrev(ranks: Sequence[int]) -> str:
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def group_label(group: Any, world_size: int | None = None) -> str:
    """How records name a group: ``"world"``, or ``"<name> [ranks]"`` (long rank lists abbreviated).

    ``group`` is a process group as the code under test holds it; None is the world group.
    """
    if group is None:
        return "world"
    ranks = getattr(group, "global_ranks", None)
    name = getattr(group, "_group_name", None)
    if ranks is None:
        ranks = getattr(group, "members", None)
        name = getattr(group, "gid", None)
    if ranks is None:
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:
            return "world"
        ranks = dist.get_process_group_ranks(group)
        name = getattr(group, "group_name", "?")
    if world_size is None:
        session = getattr(group, "session", None)
        checker = getattr(group, "checker", None)
        world_size = getattr(session or checker, "world_size", None)
    if str(name) == "0" and len(ranks) == world_size:
        return "world"
    return f"{name} {_abbrev(list(ranks))}"


_DTYPE_NAMES: dict[Any, tuple[str, int]] = {}


def dtype_info(dtype: Any) -> tuple[str, int]:
    """(name without "torch.", bytes per element) of a torch dtype."""
    known = _DTYPE_NAMES.get(dtype)
    if known is None:
        known = _DTYPE_NAMES[dtype] = (str(dtype).replace("torch.", ""), int(getattr(dtype, "itemsize", 0) or 0))
    return known


def size_of(t: Any) -> int:
    return int(t.numel())


def sizes_of(ts: Any) -> int:
    """The elements of ``ts`` in all: counted in C for tensors (a list all_gather's W outputs on each of W
    ranks), one at a time for what is not a tensor (the process world's metadata). Tensors come from a
    loaded torch: it is looked up, not imported."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return sum(map(torch.Tensor.numel, ts))
        except TypeError:
            pass
    return sum(size_of(t) for t in ts)


def measure(call: Any) -> tuple[str, tuple[tuple[int, ...], ...], int, int]:
    """(dtype, shapes, elements, bytes) of one rank's side of a collective (a ``collectives.Call``)."""
    op = call.op
    shapes: tuple[tuple[int, ...], ...]
    if op in ("all_reduce", "reduce", "broadcast"):
        t = call.tensor
        shapes, n, dtype = (tuple(t.shape),), size_of(t), t.dtype
    elif op == "all_gather":
        t = call.inp
        shapes, n, dtype = (tuple(t.shape),), sizes_of(call.outs), t.dtype
    elif op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        shapes, dtype = (tuple(call.inp.shape), tuple(call.out.shape)), call.inp.dtype
        n = size_of(call.out) if op == "all_gather_into_tensor" else size_of(call.inp)
    elif op == "reduce_scatter":
        t = call.out
        shapes, n, dtype = (tuple(t.shape),), sizes_of(call.inps), t.dtype
    elif op == "all_to_all":
        ins = call.inps
        shapes = tuple(tuple(i.shape) for i in ins)
        n = sizes_of(ins)
        dtype = ins[0].dtype if ins else None
    elif op == "all_to_all_single":
        shapes, n, dtype = (tuple(call.inp.shape), tuple(call.out.shape)), size_of(call.inp), call.inp.dtype
    elif op == "gather":
        t = call.inp
        shapes, n, dtype = (tuple(t.shape),), size_of(t) * call.group_size, t.dtype
    elif op == "scatter":
        t = call.out
        shapes, n, dtype = (tuple(t.shape),), size_of(t) * call.group_size, t.dtype
    else:  # barrier
        return ("", (), 0, 0)
    name, itemsize = dtype_info(dtype)
    return (name, shapes, n, n * itemsize)
