"""What every rank of a world run communicated: one record per collective and transfer, per-rank totals.

Every world records, per rank, each collective and point-to-point call as a :class:`CallRecord` (group,
op, sequence number, shapes, dtype, elements and bytes, root or peer, post / completion / wait times, the
call site and the waiting call site). Three things read the records:

- assertions: ``ctx.comm`` (a :class:`CommView` of the calling rank, whole run or a ``window()``);
- failure reports: :meth:`Recorder.timeline`, the last calls of each rank, appended to the report of a
  failing run (:func:`world_run` does it for every world);
- files: :func:`chrome_trace` writes Chrome-trace / Perfetto JSON, one track per rank
  (:func:`recording` collects the runs of a block, the pytest plugin writes them per test).

What a call counts (``numel`` and ``bytes``, per rank, whatever the algorithm moves on a wire; the
convention of nccl-tests' "size"):

==========================================  ======================================================
all_reduce, reduce, broadcast               the tensor
all_gather, all_gather_into_tensor          the output (group size x the input)
reduce_scatter, reduce_scatter_tensor       the input (group size x the output)
all_to_all, all_to_all_single               the input this rank sends (all of it)
gather, scatter                             group size x the input (gather) / the output (scatter)
send, recv                                  the tensor
barrier                                     nothing
==========================================  ======================================================

Counts and bytes are exact for every call (always on); the records keep the last :data:`RING_LIMIT` calls
of each rank, or :data:`RECORD_LIMIT` while a trace is asked for. The module imports no torch: the
plugin uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "RECORD_LIMIT",
    "CallRecord",
    "CommView",
    "Recorder",
    "Recording",
    "chrome_trace",
    "group_label",
    "recording",
    "world_run",
]

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

_OPS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)

_here = os.path.dirname(os.path.abspath(__file__))
_SKIP_DIRS: tuple[str, ...] = (_here + os.sep,)


def _skip_dirs() -> tuple[str, ...]:
    """Directories whose frames are not a call site: dstest's worlds and torch (found once torch is loaded)."""
    global _SKIP_DIRS
    if len(_SKIP_DIRS) == 1:
        torch = sys.modules.get("torch")
        path = getattr(torch, "__file__", None)
        if path:
            found = [_SKIP_DIRS[0], os.path.dirname(os.path.abspath(path)) + os.sep]
            # torch's deprecation wrappers (torch 2.13: all_gather_into_tensor) run through this file
            extensions = getattr(sys.modules.get("typing_extensions"), "__file__", None)
            if extensions:
                found.append(os.path.abspath(extensions))
            _SKIP_DIRS = tuple(found)
    return _SKIP_DIRS


def call_site(depth: int = 2) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame outside dstest's worlds and torch."""
    skip = _skip_dirs()
    frame: Any = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(skip):
            return (code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def _site_text(site: tuple[str, int, str] | None) -> str:
    if site is None:
        return "?"
    return f"{os.path.basename(site[0])}:{site[1]} ({site[2]})"


def _now() -> int:
    return time.perf_counter_ns()


class CallRecord:
    """One rank's side of one collective or transfer."""

    __slots__ = (
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
        self.reduce_op: str | None = None
        self.root: int | None = None
        self.peer: int | None = None
        self.tag: int | None = None
        self.t_post = _now()
        self.t_done: int | None = None
        self.t_wait: int | None = None
        self.t_waited: int | None = None
        self.site: tuple[str, int, str] | None = None
        self.wait_site: tuple[str, int, str] | None = None
        self.error: str | None = None
        self.sync = False  # waited right after it was posted (a blocking call)

    # -- the world's hooks ---------------------------------------------------------------------------
    def finished(self, error: BaseException | None) -> None:
        """The call completed (any thread); ``error``: it failed."""
        if self.t_done is None:
            self.t_done = _now()
        if error is not None and self.error is None:
            self.error = f"{type(error).__name__}: {error}".splitlines()[0][:200]

    def waiting(self, log: RankLog | None = None) -> None:
        """The rank starts waiting for this call (on its own thread)."""
        if self.t_wait is None:
            self.t_wait = _now()
            self.sync = log is not None and log.last is self
            # A blocking call waits where it was called; only a later wait needs its own site.
            self.wait_site = self.site if self.sync else call_site(3)

    def waited(self) -> None:
        if self.t_waited is None:
            self.t_waited = _now()

    # -- reading -------------------------------------------------------------------------------------
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
        return {name: getattr(self, name) for name in CallRecord.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallRecord:
        rec = cls.__new__(cls)
        for name in cls.__slots__:
            setattr(rec, name, d.get(name))
        return rec


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


class RankLog:
    """One rank's records and totals, and the windows open on it."""

    def __init__(self, rank: int, limit: int = RECORD_LIMIT) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.records: deque[CallRecord] = deque(maxlen=limit)
        self.posted = 0
        self.totals = _Totals()
        self.windows: list[_Window] = []
        self.last: CallRecord | None = None

    def add(self, rec: CallRecord) -> None:
        with self.lock:
            self.records.append(rec)
            self.posted += 1
            self.totals.add(rec)
            self.last = rec
            for w in self.windows:
                w.totals.add(rec)
                w.records.append(rec)

    @property
    def dropped(self) -> int:
        return self.posted - len(self.records)


class _Window:
    def __init__(self) -> None:
        self.totals = _Totals()
        self.records: list[CallRecord] = []


def _check_op(op: str | None) -> None:
    if op is not None and op not in _OPS:
        from dstest.errors import InvalidArgument

        raise InvalidArgument(f"op={op!r} is not a collective or transfer dstest records; allowed: {list(_OPS)}")


class CommView:
    """Counts and bytes of one rank's collectives and transfers: ``ctx.comm`` (the run so far) or a
    window of it (``with ctx.comm.window() as w: ...``).

    ``op`` names a collective as torch.distributed does (``"all_reduce"``, ``"all_gather_into_tensor"``,
    ``"send"``, ...); ``group`` is a process group (as passed to the collective; None: every group) or
    its label (see :func:`group_label`). What a call counts is in :mod:`dstest.worlds._trace`: for
    an all-gather, the gathered output (W x the shard).

    Per rank, on a group of W ranks::

        dist.all_gather_into_tensor(out[W*P], shard[P])   ctx.comm.numel("all_gather_into_tensor") == W*P
        dist.all_reduce(t[N])                              ctx.comm.count("all_reduce") == 1
    """

    def __init__(self, log: RankLog, window: _Window | None = None) -> None:
        self._log = log
        self._window = window

    def _totals(self) -> dict[tuple[str, str], list[int]]:
        with self._log.lock:
            src = self._window.totals if self._window is not None else self._log.totals
            return {k: list(v) for k, v in src.by_key.items()}

    def _sum(self, column: int, op: str | None, group: Any) -> int:
        _check_op(op)
        label = None if group is None else (group if isinstance(group, str) else group_label(group))
        return sum(
            row[column]
            for (g, o), row in self._totals().items()
            if (op is None or o == op) and (label is None or g == label)
        )

    @property
    def rank(self) -> int:
        return self._log.rank

    def count(self, op: str | None = None, group: Any = None) -> int:
        """How many calls (of ``op``, on ``group``)."""
        return self._sum(0, op, group)

    def numel(self, op: str | None = None, group: Any = None) -> int:
        """Elements the calls counted (see the table of :mod:`dstest.worlds._trace`)."""
        return self._sum(1, op, group)

    def bytes(self, op: str | None = None, group: Any = None) -> int:
        """Bytes the calls counted: elements x element size."""
        return self._sum(2, op, group)

    def counts(self) -> dict[str, int]:
        """Calls by op, every group together: ``{"all_reduce": 2, "broadcast": 1}``."""
        out: dict[str, int] = {}
        for (_, op), row in self._totals().items():
            out[op] = out.get(op, 0) + row[0]
        return out

    def bytes_by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, op), row in self._totals().items():
            out[op] = out.get(op, 0) + row[2]
        return out

    def by_group(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``{group label: {op: (calls, bytes)}}``."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (g, op), row in self._totals().items():
            out.setdefault(g, {})[op] = (row[0], row[2])
        return out

    @property
    def calls(self) -> list[CallRecord]:
        """The records, oldest first (the whole run keeps the last :data:`RECORD_LIMIT`)."""
        with self._log.lock:
            return list(self._window.records if self._window is not None else self._log.records)

    @contextlib.contextmanager
    def window(self) -> Iterator[CommView]:
        """Count only what this rank posts inside the block (the view stays readable afterwards)."""
        win = _Window()
        with self._log.lock:
            self._log.windows.append(win)
        try:
            yield CommView(self._log, win)
        finally:
            with self._log.lock:
                self._log.windows.remove(win)

    def __repr__(self) -> str:
        return f"<CommView rank {self.rank}: {self.counts()}>"


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
    name = getattr(group, "_name", None)
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


def _dtype_info(dtype: Any) -> tuple[str, int]:
    """(name without "torch.", bytes per element) of a torch dtype."""
    known = _DTYPE_NAMES.get(dtype)
    if known is None:
        known = _DTYPE_NAMES[dtype] = (str(dtype).replace("torch.", ""), int(getattr(dtype, "itemsize", 0) or 0))
    return known


def _size(t: Any) -> int:
    return int(t.numel())


def measure(call: Any) -> tuple[str, tuple[tuple[int, ...], ...], int, int]:
    """(dtype, shapes, elements, bytes) of one rank's side of a collective (a ``_collectives.Call``)."""
    op = call.op
    shapes: tuple[tuple[int, ...], ...]
    if op in ("all_reduce", "reduce", "broadcast"):
        t = call.tensor
        shapes, n, dtype = (tuple(t.shape),), _size(t), t.dtype
    elif op == "all_gather":
        t = call.inp
        shapes, n, dtype = (tuple(t.shape),), sum(_size(o) for o in call.outs), t.dtype
    elif op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        shapes, dtype = (tuple(call.inp.shape), tuple(call.out.shape)), call.inp.dtype
        n = _size(call.out) if op == "all_gather_into_tensor" else _size(call.inp)
    elif op == "reduce_scatter":
        t = call.out
        shapes, n, dtype = (tuple(t.shape),), sum(_size(i) for i in call.inps), t.dtype
    elif op == "all_to_all":
        ins = call.inps
        shapes = tuple(tuple(i.shape) for i in ins)
        n = sum(_size(i) for i in ins)
        dtype = ins[0].dtype if ins else None
    elif op == "all_to_all_single":
        shapes, n, dtype = (tuple(call.inp.shape), tuple(call.out.shape)), _size(call.inp), call.inp.dtype
    elif op == "gather":
        t = call.inp
        shapes, n, dtype = (tuple(t.shape),), _size(t) * call.group_size, t.dtype
    elif op == "scatter":
        t = call.out
        shapes, n, dtype = (tuple(t.shape),), _size(t) * call.group_size, t.dtype
    else:  # barrier
        return ("", (), 0, 0)
    name, itemsize = _dtype_info(dtype)
    return (name, shapes, n, n * itemsize)


# -- one run --------------------------------------------------------------------------------------------
class Recorder:
    """The records of one world run: a :class:`RankLog` per rank that communicated."""

    def __init__(self, world_size: int, world: str = "?", limit: int = RECORD_LIMIT) -> None:
        self.world_size = world_size
        self.world = world
        self.limit = limit
        self.label = ""  # what ran (a test id), for the trace's track names
        self.t0 = _now()
        self.t_end: int | None = None
        self.logs: dict[int, RankLog] = {}
        self._lock = threading.Lock()
        self._labels: dict[int, tuple[Any, str]] = {}

    def log(self, rank: int) -> RankLog:
        log = self.logs.get(rank)
        if log is None:
            with self._lock:
                log = self.logs.get(rank)
                if log is None:
                    log = self.logs[rank] = RankLog(rank, self.limit)
        return log

    def view(self, rank: int) -> CommView:
        return CommView(self.log(rank))

    def _label(self, group: Any) -> str:
        known = self._labels.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        label = group_label(group, self.world_size)
        self._labels[id(group)] = (group, label)
        return label

    def collective(self, group: Any, call: Any, seq: int, rank: int) -> CallRecord:
        """Record ``call`` (a ``_collectives.Call``) as global rank ``rank`` posts it on ``group``."""
        dtype, shapes, n, nbytes = measure(call)
        rec = CallRecord(rank, call.op, self._label(group), seq, dtype, shapes, n, nbytes)
        rec.reduce_op = call.reduce_op
        rec.root = call.root
        rec.site = call_site(3)
        self.log(rank).add(rec)
        return rec

    def p2p(self, group: Any, kind: str, tensor: Any, peer: int, tag: int, rank: int) -> CallRecord:
        """Record a send or recv of ``tensor`` to / from global rank ``peer``."""
        n = _size(tensor)
        name, itemsize = _dtype_info(tensor.dtype)
        rec = CallRecord(rank, kind, self._label(group), None, name, (tuple(tensor.shape),), n, n * itemsize)
        rec.peer = peer
        rec.tag = tag
        rec.site = call_site(3)
        self.log(rank).add(rec)
        return rec

    def merge(self, rank: int, records: Sequence[dict[str, Any]], totals: dict[tuple[str, str], list[int]]) -> None:
        """Take in a rank's records made in another process of this machine (``time.perf_counter_ns``
        is the system-wide monotonic clock on Linux and macOS, so times need no shift)."""
        log = self.log(rank)
        with log.lock:
            for d in records:
                rec = CallRecord.from_dict(d)
                log.records.append(rec)
                log.last = rec
            for key, row in totals.items():
                log.totals.by_key[tuple(key)] = list(row)  # type: ignore[index]
            log.posted = sum(row[0] for row in totals.values())

    def export(self, rank: int) -> tuple[list[dict[str, Any]], dict[tuple[str, str], list[int]]]:
        """A rank's records and totals, for :meth:`merge` in another process."""
        log = self.log(rank)
        with log.lock:
            return ([r.as_dict() for r in log.records], {k: list(v) for k, v in log.totals.by_key.items()})

    # -- reports -------------------------------------------------------------------------------------
    def timeline(self, last: int = TIMELINE_CALLS, max_ranks: int = TIMELINE_RANKS) -> str:
        """The last calls of each rank, oldest first, for a failure report ("" when nothing was posted)."""
        logs = [self.logs[r] for r in sorted(self.logs) if self.logs[r].records]
        if not logs:
            return ""

        def troubled(log: RankLog) -> bool:
            return any(r.error is not None or r.t_done is None for r in list(log.records)[-last:])

        shown = sorted(logs, key=lambda lg: (not troubled(lg), lg.rank))[:max_ranks]
        lines = [f"last calls of each rank (oldest first; ms since the start of the run; {self.world} world):"]
        for log in sorted(shown, key=lambda lg: lg.rank):
            recs = list(log.records)[-last:]
            skipped = log.posted - len(recs)
            lines.append(f"  rank {log.rank}:" + (f" ({skipped} earlier calls)" if skipped else ""))
            for rec in recs:
                at = (rec.t_post - self.t0) / 1e6
                end = rec.t_waited or rec.t_done
                took = f", {(end - rec.t_post) / 1e6:.3f} ms" if end is not None else ""
                wait = ""
                if rec.wait_site is not None and rec.wait_site != rec.site:
                    wait = f", waited at {_site_text(rec.wait_site)}"
                lines.append(
                    f"    +{at:9.3f} ms  {rec.describe()}, {rec.nbytes} B{took}: {rec.status()}; "
                    f"called at {_site_text(rec.site)}{wait}"
                )
        hidden = len(logs) - len(shown)
        if hidden > 0:
            lines.append(f"  ... {hidden} more ranks")
        return "\n".join(lines)

    def chrome_events(self, pid: int) -> list[dict[str, Any]]:
        """This run as Chrome-trace events: process ``pid``, one thread (track) per rank."""
        end_of_run = self.t_end or _now()
        name = f"{self.world} world, {self.world_size} ranks" + (f": {self.label}" if self.label else "")
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        ]
        flow = 0
        for rank in sorted(self.logs):
            log = self.logs[rank]
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}})
            for rec in list(log.records):
                args = {
                    "group": rec.group,
                    "seq": rec.seq,
                    "dtype": rec.dtype,
                    "shapes": [list(s) for s in rec.shapes],
                    "numel": rec.numel,
                    "bytes": rec.nbytes,
                    "status": rec.status(),
                    "call site": _site_text(rec.site),
                }
                for key in ("reduce_op", "root", "peer", "tag", "error"):
                    value = getattr(rec, key)
                    if value is not None:
                        args[key] = value
                if rec.wait_site is not None:
                    args["wait site"] = _site_text(rec.wait_site)
                ts = (rec.t_post - self.t0) / 1e3
                done = rec.t_done if rec.t_done is not None else end_of_run
                base = {"cat": rec.kind, "pid": pid, "tid": rank, "args": args}
                if rec.sync or rec.t_wait is None:
                    # Blocking (or never waited): one slice from the post to the end of the wait.
                    stop = rec.t_waited if rec.t_waited is not None else done
                    events.append({**base, "name": rec.op, "ph": "X", "ts": ts, "dur": max(0.0, (stop - rec.t_post) / 1e3)})
                    continue
                # Asynchronous: an instant at the post, the flight as an async span, the wait as a slice.
                flow += 1
                events.append({**base, "name": f"post {rec.op}", "ph": "X", "ts": ts, "dur": 0.0})
                span = {"cat": rec.kind, "pid": pid, "tid": rank, "id": f"{pid}.{flow}", "name": rec.op}
                events.append({**span, "ph": "b", "ts": ts, "args": args})
                events.append({**span, "ph": "e", "ts": max(ts, (done - self.t0) / 1e3), "args": {}})
                stop = rec.t_waited if rec.t_waited is not None else done
                events.append(
                    {**base, "name": f"wait {rec.op}", "ph": "X", "ts": (rec.t_wait - self.t0) / 1e3,
                     "dur": max(0.0, (stop - rec.t_wait) / 1e3)}
                )  # fmt: skip
        return events


def chrome_trace(recorders: Sequence[Recorder]) -> dict[str, Any]:
    """Chrome-trace JSON (``{"traceEvents": [...]}``) of runs, one process per run, one track per rank;
    opens in https://ui.perfetto.dev and chrome://tracing."""
    events: list[dict[str, Any]] = []
    for pid, rec in enumerate(recorders, start=1):
        events.extend(rec.chrome_events(pid))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "dstest"}}


def write_chrome_trace(path: str | os.PathLike[str], recorders: Sequence[Recorder]) -> str:
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(recorders), f)
    return os.fspath(path)


# -- runs of a block ------------------------------------------------------------------------------------
class Recording:
    """The world runs made in a ``with recording():`` block on this thread (:func:`recording`)."""

    def __init__(self, full: bool = True) -> None:
        self.runs: list[Recorder] = []
        self.full = full

    def comm(self, rank: int, run: int = -1) -> CommView:
        """Counts and bytes of ``rank`` in a run (default: the last one)."""
        if not self.runs:
            from dstest.errors import InvalidArgument

            raise InvalidArgument("Recording.comm: no world ran inside the recording block")
        return self.runs[run].view(rank)

    def trace(self) -> dict[str, Any]:
        """Chrome-trace JSON of every run recorded."""
        return chrome_trace(self.runs)

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write :meth:`trace` to ``path`` (folders made); returns the path."""
        return write_chrome_trace(path, self.runs)


class _Local(threading.local):
    def __init__(self) -> None:
        self.recordings: list[Recording] = []


_LOCAL = _Local()


@contextlib.contextmanager
def recording(full: bool = True) -> Iterator[Recording]:
    """Record every world run made on this thread inside the block::

        with dstest.recording() as rec:
            dstest.run(fn, 4)
        rec.write("run.json")          # open in https://ui.perfetto.dev
        rec.comm(rank=0).counts()      # {"all_reduce": 1}

    ``full``: keep up to :data:`RECORD_LIMIT` records per rank (else the last :data:`RING_LIMIT`).
    """
    rec = Recording(full)
    _LOCAL.recordings.append(rec)
    try:
        yield rec
    finally:
        _LOCAL.recordings.remove(rec)


@contextlib.contextmanager
def world_run(world: str, world_size: int, recorder: Recorder | None = None) -> Iterator[Recorder]:
    """Around one ``World.run``: the run's recorder (``recorder``, the run request's, else a new one); a
    failure report gets the timeline of the last calls of each rank, and the run goes to every
    :func:`recording` open on this thread."""
    if recorder is None:
        full = any(r.full for r in _LOCAL.recordings)
        recorder = Recorder(world_size, world, RECORD_LIMIT if full else RING_LIMIT)
    elif recorder.world == "?":
        recorder.world = world
    rec = recorder
    try:
        yield rec
    except Exception as exc:
        _annotate(exc, rec)
        raise
    finally:
        rec.t_end = _now()
        for r in _LOCAL.recordings:
            r.runs.append(rec)


def _annotate(exc: BaseException, rec: Recorder) -> None:
    from dstest.errors import RankFailure, WorkerDied, WorldTimeout

    if not isinstance(exc, (RankFailure, WorldTimeout, WorkerDied)) or not exc.args:
        return
    text = rec.timeline()
    if text and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}", *exc.args[1:])
