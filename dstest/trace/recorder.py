"""One run's :class:`Recorder`, Chrome-trace files, and the runs a ``with recording():`` block collects."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from dstest.trace.records import (
    RECORD_LIMIT,
    RING_LIMIT,
    TIMELINE_CALLS,
    TIMELINE_RANKS,
    CallRecord,
    RankLog,
    call_site,
    call_stack,
    dtype_info,
    group_label,
    measure,
    now_ns,
    site_text,
    size_of,
)
from dstest.trace.view import CommView


# -- one run --------------------------------------------------------------------------------------------
class Recorder:
    """The records of one world run: a :class:`RankLog` per rank that communicated."""

    def __init__(self, world_size: int, world: str = "?", limit: int = RECORD_LIMIT, callers: int = 0) -> None:
        self.world_size = world_size
        self.world = world
        self.limit = limit
        #: How many callers of each call site to keep (``CallRecord.callers``, named where work is left
        #: unwaited). About 0.6 us per frame and call: the process world, whose calls cost a round trip to
        #: the referee, keeps 3; the threaded world, whose whole path is ~17 us, keeps none.
        self.callers = callers
        self.label = ""  # what ran (a test id), for the trace's track names
        self.t0 = now_ns()
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
        """Record ``call`` (a ``collectives.Call``) as global rank ``rank`` posts it on ``group``."""
        dtype, shapes, n, nbytes = measure(call)
        rec = CallRecord(rank, call.op, self._label(group), seq, dtype, shapes, n, nbytes)
        rec.reduce_op = call.reduce_op
        rec.root = call.root
        if self.callers:
            stack = call_stack(3, 1 + self.callers)
            rec.site, rec.callers = (stack[0] if stack else None), stack[1:]
        else:
            rec.site = call_site(3)
        (self.logs.get(rank) or self.log(rank)).add(rec)
        return rec

    def p2p(self, group: Any, kind: str, tensor: Any, peer: int, tag: int, rank: int) -> CallRecord:
        """Record a send or recv of ``tensor`` to / from global rank ``peer``."""
        n = size_of(tensor)
        name, itemsize = dtype_info(tensor.dtype)
        rec = CallRecord(rank, kind, self._label(group), None, name, (tuple(tensor.shape),), n, n * itemsize)
        rec.peer = peer
        rec.tag = tag
        if self.callers:
            stack = call_stack(3, 1 + self.callers)
            rec.site, rec.callers = (stack[0] if stack else None), stack[1:]
        else:
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
                    wait = f", waited at {site_text(rec.wait_site)}"
                lines.append(
                    f"    +{at:9.3f} ms  {rec.describe()}, {rec.nbytes} B{took}: {rec.status()}; "
                    f"called at {site_text(rec.site)}{wait}"
                )
        hidden = len(logs) - len(shown)
        if hidden > 0:
            lines.append(f"  ... {hidden} more ranks")
        return "\n".join(lines)

    def chrome_events(self, pid: int) -> list[dict[str, Any]]:
        """This run as Chrome-trace events: process ``pid``, one thread (track) per rank."""
        end_of_run = self.t_end or now_ns()
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
                    "call site": site_text(rec.site),
                }
                for key in ("reduce_op", "root", "peer", "tag", "error"):
                    value = getattr(rec, key)
                    if value is not None:
                        args[key] = value
                if rec.wait_site is not None:
                    args["wait site"] = site_text(rec.wait_site)
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

    def __init__(self, full: bool = True, flight_recorder: str | os.PathLike[str] | None = None) -> None:
        self.runs: list[Recorder] = []
        self.full = full
        #: Where a failing run's flight-recorder dumps go (``<flight_recorder>/run-<n>``), or None.
        self.flight_recorder = os.fspath(flight_recorder) if flight_recorder is not None else None

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
def recording(full: bool = True, flight_recorder: str | os.PathLike[str] | None = None) -> Iterator[Recording]:
    """Record every world run made on this thread inside the block::

        with dstest.recording() as rec:
            dstest.run(fn, 4)
        rec.write("run.json")          # open in https://ui.perfetto.dev
        rec.comm(rank=0).counts()      # {"all_reduce": 1}

    ``full``: keep up to :data:`RECORD_LIMIT` records per rank (else the last :data:`RING_LIMIT`).
    ``flight_recorder``: a directory; a run of the block that fails (a mismatch, deadlock or timeout) writes
    its torch flight-recorder dumps to ``<flight_recorder>/run-<n>`` (its n-th run) and its failure report
    names them (:func:`~dstest.trace.write_flight_recorder`).
    """
    rec = Recording(full, flight_recorder)
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
        rec.t_end = now_ns()
        for r in _LOCAL.recordings:
            r.runs.append(rec)


#: Where :func:`_annotate` keeps what it added to a failure's message, for :func:`run_notes`.
_NOTES_ATTR = "_dstest_run_notes"


def _annotate(exc: BaseException, rec: Recorder) -> None:
    from dstest.errors import RankFailure, WorkerDied, WorldTimeout

    if not isinstance(exc, (RankFailure, WorldTimeout, WorkerDied)) or not exc.args:
        return
    text = rec.timeline()
    dumps = _flight_recorder_dumps(rec)
    if dumps:
        text = f"{text}\n{dumps}" if text else dumps
    if text and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}", *exc.args[1:])
        setattr(exc, _NOTES_ATTR, text)


def run_notes(exc: BaseException) -> str:
    """What a failed world run added to its error's message: each rank's last calls and the line naming the
    run's flight-recorder dumps ("" for an error no run annotated). A harness that reports a failed run in
    its own words, from each rank's traceback (the compat plugins: torch's bases say "Process 1 exited with
    error code 10", DeepSpeed's plugin lists the ranks), appends it, so that its report names the dumps and
    the calls as a spec's does."""
    return str(getattr(exc, _NOTES_ATTR, ""))


def _flight_recorder_dumps(rec: Recorder) -> str:
    """Write a failing run's flight-recorder dumps where an open :func:`recording` asks for them; the
    report's line naming them ("" when none was asked for)."""
    from dstest.trace.flight_recorder import analyzer_command, write_flight_recorder

    lines = []
    for r in _LOCAL.recordings:
        if r.flight_recorder is None or rec in r.runs:
            continue
        folder = os.path.join(r.flight_recorder, f"run-{len(r.runs) + 1}")
        try:
            write_flight_recorder(folder, rec)
        except OSError as err:
            lines.append(f"flight-recorder dumps of this run: not written to {folder}: {err}")
            continue
        lines.append(f"flight-recorder dumps of this run: {folder} (read them with: {analyzer_command(folder)})")
    return "\n".join(lines)
