"""What every rank of a world run communicated: one record per collective and transfer, per-rank totals.

Every world records, per rank, each collective and point-to-point call as a :class:`CallRecord` (group,
op, sequence number, shapes, dtype, elements and bytes, root or peer, post / completion / wait times, the
call site and the waiting call site). Three things read the records:

- assertions: ``ctx.comm`` (a :class:`CommView` of the calling rank, whole run or a ``window()``);
- failure reports: :meth:`Recorder.timeline`, the last calls of each rank, appended to the report of a
  failing run (:func:`world_run` does it for every world);
- files: :func:`chrome_trace` writes Chrome-trace / Perfetto JSON, one track per rank
  (:func:`recording` collects the runs of a block, the pytest plugin writes them per test);
  :func:`write_flight_recorder` writes torch flight-recorder dumps, one per rank, that torch's ``fr_trace``
  analyzer reads (:mod:`~dstest.trace.flight_recorder`).

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
of each rank, or :data:`RECORD_LIMIT` while a trace is asked for. The package imports no torch: the
plugin uses it. :mod:`~dstest.trace.records` holds the records, :mod:`~dstest.trace.view` ``ctx.comm``,
:mod:`~dstest.trace.recorder` a run's recorder, trace files and :func:`recording`.
"""

from __future__ import annotations

from dstest.trace.flight_recorder import FR_PREFIX, write_flight_recorder
from dstest.trace.recorder import (
    Recorder,
    Recording,
    chrome_trace,
    recording,
    run_notes,
    world_run,
    write_chrome_trace,
)
from dstest.trace.records import (
    RECORD_LIMIT,
    RING_LIMIT,
    TIMELINE_CALLS,
    TIMELINE_RANKS,
    CallRecord,
    RankLog,
    call_site,
    group_label,
    measure,
)
from dstest.trace.view import CommView

__all__ = [
    "FR_PREFIX",
    "RECORD_LIMIT",
    "RING_LIMIT",
    "TIMELINE_CALLS",
    "TIMELINE_RANKS",
    "CallRecord",
    "CommView",
    "RankLog",
    "Recorder",
    "Recording",
    "call_site",
    "chrome_trace",
    "group_label",
    "measure",
    "recording",
    "run_notes",
    "world_run",
    "write_chrome_trace",
    "write_flight_recorder",
]
