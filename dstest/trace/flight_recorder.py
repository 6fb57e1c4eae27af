"""A run's records as torch flight-recorder dumps, for ``python -m torch.distributed.flight_recorder.fr_trace``
(contract G6).

Why: on a cluster hang, people dump torch's flight recorder on every rank and read the dumps with the
analyzer torch ships (``fr_trace``), which matches each group's collectives across ranks by sequence number
and names the first one that some rank did not join, or joined with another op, size or dtype. torch
records only groups with a C++ backend; dstest's groups are Python ``ProcessGroup`` subclasses (threaded
world) or wrapped by one (process world), so torch records nothing of a dstest run. dstest records every
call itself (:mod:`dstest.trace.records`); this module writes those records in the dump format, so a dstest
failure can be read with the tool people already know, and a dump of a real cluster hang can be compared
with the dump of its reproduction.

The format, as torch 2.13's analyzer reads it (``components/loader.py``, ``builder.py``, ``types.py`` and
``utils.py`` of ``torch/distributed/flight_recorder``; its reader is the same in the 2.15 sources): one file
per rank, named ``<prefix><rank>``, holding a pickled dict with

- ``version``: ``"2.10"``, what torch 2.13's recorder writes; the analyzer wants ``"<major>.<minor>"``, the
  same on every rank, and treats 2.7 or later as able to record coalesced groups of any op;
- ``pg_config``: ``{group name: {"name", "desc", "ranks"}}`` for every group the rank is a member of, the
  ranks as the text of a list of global ranks (the analyzer ``literal_eval``\\ s it);
- ``pg_status``: ``{pg_id (text): {"last_enqueued_collective", "last_started_collective",
  "last_completed_collective"}}``, sequence numbers, -1 for none;
- ``entries``: one dict per call, oldest first (below); ``comm_lib_version`` and ``rank`` besides.

An entry: ``record_id`` (the rank's call index in the run, counting calls the ring dropped: the analyzer
aligns ranks on it), ``pg_id``, ``process_group`` (``(name, desc)``), ``collective_seq_id`` (the group's
sequence number of the call: dstest's ``seq``; for a transfer, the group's last collective's),
``p2p_seq_id`` (the rank's count of transfers on the group; 0 for collectives), ``op_id``, ``is_p2p``,
``profiling_name`` (``"nccl:all_reduce"``; transfers ``"nccl:send 0->1"`` / ``"nccl:recv 1<-0"`` in group
ranks), ``input_sizes`` / ``output_sizes`` and ``input_dtypes`` / ``output_dtypes`` (c10's names:
``"Float"``, ``"Long"``), ``time_created_ns`` (wall clock), ``state``, ``time_discovered_started_ns``,
``time_discovered_completed_ns``, ``duration_ms``, ``timeout_ms``, ``retired``, ``frames`` (the call site,
``{"name", "filename", "line"}``), ``thread_id``, ``thread_name``.

The mapping: a call that completed is ``"completed"``; one that failed or never completed is ``"started"``
when the rank was waiting in it and ``"scheduled"`` when it was posted (``async_op=True``) but never waited
for. Ops are named as ProcessGroupNCCL names them (``all_gather_into_tensor`` is ``_all_gather_base``,
``reduce_scatter_tensor`` ``_reduce_scatter_base``, ``all_to_all_single`` ``all_to_all``), with the ``nccl:``
prefix the analyzer's users read whatever world ran (``backend=`` changes it). Sizes: the tensors as NCCL
records them (an ``all_gather`` into a list is its flattened output, ``[W, *input]``); dstest keeps one
shape per tensor it counts, so an ``all_to_all``'s outputs are written as its inputs' shapes.

What the format cannot say: dstest's own verdict (which rank's call is wrong and why) is in the failure
report; the analyzer infers its own from the entries. Groups are identified by their dstest name (the
world group is ``"0"``, ``"default_pg"``); a group of more than 8 ranks whose label dstest abbreviates
gets its members from the ranks that called on it. A limit of the analyzer, not of the dumps (torch 2.13,
and its NCCL dumps alike): it takes consecutive entries of one group whose sequence numbers are equal for a
coalesced group, comparing a transfer's ``p2p_seq_id`` with a collective's ``collective_seq_id``, so a
transfer right after a collective can stop it ("can't get dst of non-p2p op"). The package's rule holds: no
torch import.
"""

from __future__ import annotations

import ast
import os
import pickle
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dstest.worlds.core.c10d import RECORDED_OPS

if TYPE_CHECKING:
    from dstest.trace.recorder import Recorder
    from dstest.trace.records import CallRecord

#: What torch 2.13's flight recorder writes as the dump's ``version`` (the analyzer wants "<major>.<minor>").
FR_VERSION = "2.10"
#: The file-name prefix of each rank's dump: torch's default dump file (``TORCH_FR_DUMP_TEMP_FILE``,
#: ``/tmp/nccl_trace_rank_``) without its folder; the analyzer infers it or takes ``--prefix``.
FR_PREFIX = "nccl_trace_rank_"
#: Worlds up to this size get a dump for every rank; larger ones only for the ranks that recorded (read
#: those with the analyzer's ``--allow-incomplete-ranks``).
MAX_DUMP_RANKS = 1024
#: The command that reads a directory of dumps (append the directory).
FR_COMMAND = "python -m torch.distributed.flight_recorder.fr_trace"

# dstest's op names -> ProcessGroupNCCL's profiling names (without the backend prefix).
_PROFILING_NAMES = {
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_to_all_single": "all_to_all",
    # ProcessGroupNCCL's barrier is an all_reduce of one element, recorded under this name; torch 2.11's
    # analyzer knows only it (2.13's also accepts "barrier").
    "barrier": "all_reduce_barrier",
}

# torch dtype names (as records keep them) -> c10::ScalarType names (as the recorder writes them).
_SCALAR_TYPES = {
    "float32": "Float",
    "float64": "Double",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "int64": "Long",
    "int32": "Int",
    "int16": "Short",
    "int8": "Char",
    "uint8": "Byte",
    "uint16": "UInt16",
    "uint32": "UInt32",
    "uint64": "UInt64",
    "bool": "Bool",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "complex32": "ComplexHalf",
    "float8_e4m3fn": "Float8_e4m3fn",
    "float8_e5m2": "Float8_e5m2",
    "float8_e4m3fnuz": "Float8_e4m3fnuz",
    "float8_e5m2fnuz": "Float8_e5m2fnuz",
}

_WORLD = ("0", "default_pg")
_SUBGROUP_DESC = "undefined"  # what torch writes for a group created without group_desc


def scalar_type(dtype: str) -> str:
    """The c10 name of a dtype as records keep it (``"float32"`` -> ``"Float"``); unknown names unchanged."""
    return _SCALAR_TYPES.get(dtype, dtype)


class _Group:
    """A group of the run as the dump names it."""

    __slots__ = ("desc", "label", "name", "pg_id", "ranks")

    def __init__(self, label: str, name: str, desc: str, ranks: tuple[int, ...]) -> None:
        self.label = label
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.pg_id = 0

    def local(self, global_rank: int) -> int:
        """The group rank of a global rank (the global rank itself if the group does not list it)."""
        return self.ranks.index(global_rank) if global_rank in self.ranks else global_rank


def _parse_label(label: str) -> tuple[str, tuple[int, ...] | None]:
    """(name, ranks) of a group label ``"<name> [r0, r1, ...]"``; ranks None when abbreviated or unreadable."""
    name, sep, rest = label.partition(" [")
    if not sep:
        return label, None
    listed = "[" + rest
    if "..." in listed:
        return name, None
    try:
        ranks = ast.literal_eval(listed)
    except (ValueError, SyntaxError):
        return name, None
    if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
        return name, None
    return name, tuple(ranks)


def _groups(recorder: Recorder, records: dict[int, list[CallRecord]]) -> dict[str, _Group]:
    """Every group named in the records, by label, with its members and a pg_id (the world's is 0)."""
    callers: dict[str, set[int]] = {}
    for rank, recs in records.items():
        for rec in recs:
            callers.setdefault(rec.group, set()).add(rank)
            if rec.peer is not None:
                callers[rec.group].add(rec.peer)
    groups: dict[str, _Group] = {"world": _Group("world", *_WORLD, tuple(range(recorder.world_size)))}
    for label in sorted(callers):
        if label in groups:
            continue
        name, ranks = _parse_label(label)
        if ranks is None:
            ranks = tuple(sorted(callers[label]))
        groups[label] = _Group(label, name, _SUBGROUP_DESC, ranks)
    taken = {"0"}
    for group in groups.values():
        if group.name in taken and group.label != "world":
            # Two labels with one name (it cannot happen with torch's names; keep the dump readable anyway).
            group.name = f"{group.name}.{len(taken)}"
        taken.add(group.name)
    for pg_id, group in enumerate(groups.values()):
        group.pg_id = pg_id
    return groups


def _sizes(rec: CallRecord, group_size: int, is_root: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(input sizes, output sizes) of one call, as ProcessGroupNCCL records the tensors it is given."""
    shapes = [list(s) for s in rec.shapes]
    op = rec.op
    if op in ("all_reduce", "reduce", "broadcast"):
        return shapes[:1], shapes[:1]
    if op == "all_gather":
        return shapes[:1], [[group_size, *shapes[0]]] if shapes else []
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return shapes[:1], shapes[1:2]
    if op == "reduce_scatter":
        return [[group_size, *shapes[0]]] if shapes else [], shapes[:1]
    if op == "all_to_all":
        return shapes, [list(s) for s in shapes]
    if op == "gather":
        return shapes[:1], [[group_size, *shapes[0]]] if shapes and is_root else []
    if op == "scatter":
        return [[group_size, *shapes[0]]] if shapes and is_root else [], shapes[:1]
    if op == "send":
        return shapes[:1], []
    if op == "recv":
        return [], shapes[:1]
    if op == "barrier":
        return [], []
    # a new op of the c10d table must say here how NCCL records it, never pass for a barrier
    raise ValueError(f"flight recorder: no sizes for op {op!r}; the ops dstest records: {list(RECORDED_OPS)}")


def _state(rec: CallRecord) -> str:
    if rec.t_done is not None and rec.error is None:
        return "completed"
    return "started" if rec.t_wait is not None else "scheduled"


def _frames(rec: CallRecord) -> list[dict[str, Any]]:
    if rec.site is None:
        return []
    filename, line, name = rec.site
    return [{"name": name, "filename": filename, "line": line}]


def rank_dump(recorder: Recorder, rank: int, backend: str = "nccl", timeout_ms: int = 0) -> dict[str, Any]:
    """The flight-recorder dump of one rank of a run (the dict :func:`write_flight_recorder` pickles)."""
    records = {r: list(log.records) for r, log in recorder.logs.items()}
    return _rank_dump(recorder, rank, records, _groups(recorder, records), backend, timeout_ms)


def _note_status(status: dict[str, dict[str, int]], pg_id: int, seq: int, state: str) -> None:
    """A collective's sequence number into its group's ``pg_status`` row (last enqueued, started, completed)."""
    row = status.setdefault(
        str(pg_id),
        {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1},
    )
    row["last_enqueued_collective"] = max(row["last_enqueued_collective"], seq)
    if state != "scheduled":
        row["last_started_collective"] = max(row["last_started_collective"], seq)
    if state == "completed":
        row["last_completed_collective"] = max(row["last_completed_collective"], seq)


class _Numbering:
    """A rank's running numbers per group, as torch's recorder gives them: the group's sequence number of
    its last collective (a transfer carries it), its count of transfers, and its count of calls."""

    def __init__(self) -> None:
        self.last_seq: dict[str, int] = {}
        self.p2p_seq: dict[str, int] = {}
        self.op_ids: dict[str, int] = {}

    def next(self, rec: CallRecord, label: str) -> tuple[int, int, int]:
        """(``collective_seq_id``, ``p2p_seq_id``, ``op_id``) of the rank's next call on the group ``label``."""
        op_id = self.op_ids[label] = self.op_ids.get(label, 0) + 1
        if rec.kind == "p2p":
            p2p = self.p2p_seq[label] = self.p2p_seq.get(label, 0) + 1
            return self.last_seq.get(label, 0), p2p, op_id
        seq = self.last_seq[label] = rec.seq if rec.seq is not None else self.last_seq.get(label, 0) + 1
        return seq, 0, op_id


def _profiling_name(rec: CallRecord, group: _Group, rank: int, backend: str) -> str:
    """``"nccl:all_reduce"``; a transfer ``"nccl:send 0->1"`` / ``"nccl:recv 1<-0"``, in group ranks."""
    if rec.kind != "p2p":
        return f"{backend}:{_PROFILING_NAMES.get(rec.op, rec.op)}"
    me, peer = group.local(rank), group.local(rec.peer if rec.peer is not None else rank)
    arrow = f"{me}->{peer}" if rec.op == "send" else f"{me}<-{peer}"
    return f"{backend}:{rec.op} {arrow}"


class _Entries:
    """One rank's entries, oldest first, and the ``pg_status`` rows of its groups, as its calls are added."""

    def __init__(self, rank: int, backend: str, timeout_ms: int, first_id: int) -> None:
        self.rank, self.backend, self.timeout_ms = rank, backend, timeout_ms
        self.next_id = first_id  # the analyzer aligns ranks on it: calls the ring dropped count too
        self.shift = time.time_ns() - time.perf_counter_ns()  # records hold the monotonic clock, dumps wall time
        self.numbering = _Numbering()
        self.status: dict[str, dict[str, int]] = {}
        self.entries: list[dict[str, Any]] = []

    def add(self, rec: CallRecord, group: _Group) -> None:
        rank, shift, is_p2p = self.rank, self.shift, rec.kind == "p2p"
        seq, p2p_seq, op_id = self.numbering.next(rec, group.label)
        inputs, outputs = _sizes(rec, len(group.ranks), rec.root is not None and group.local(rank) == rec.root)
        dtype = scalar_type(rec.dtype)
        state = _state(rec)
        if not is_p2p:
            _note_status(self.status, group.pg_id, seq, state)
        done = rec.t_done if state == "completed" else None
        # Started: when the rank began waiting in it, or when it completed if that came first (a call a
        # rank waits for later may be over by then).
        started = rec.t_wait if done is None or rec.t_wait is None else min(rec.t_wait, done)
        self.entries.append(
            {
                "record_id": self.next_id,
                "pg_id": group.pg_id,
                "process_group": (group.name, group.desc),
                "collective_seq_id": seq,
                "p2p_seq_id": p2p_seq,
                "op_id": op_id,
                "profiling_name": _profiling_name(rec, group, rank, self.backend),
                "time_created_ns": rec.t_post + shift,
                "input_sizes": inputs,
                "input_dtypes": [dtype] * len(inputs),
                "output_sizes": outputs,
                "output_dtypes": [dtype] * len(outputs),
                "state": state,
                "time_discovered_started_ns": started + shift if started is not None else None,
                "time_discovered_completed_ns": done + shift if done is not None else None,
                "duration_ms": (done - rec.t_post) / 1e6 if done is not None else None,
                "timeout_ms": self.timeout_ms,
                "retired": rec.t_done is not None,
                "is_p2p": is_p2p,
                "frames": _frames(rec),
                "thread_id": str(rank),
                "thread_name": f"dstest rank {rank}",
            }
        )
        self.next_id += 1


def _rank_dump(
    recorder: Recorder,
    rank: int,
    records: dict[int, list[CallRecord]],
    groups: dict[str, _Group],
    backend: str,
    timeout_ms: int,
) -> dict[str, Any]:
    log = recorder.logs.get(rank)
    written = _Entries(rank, backend, timeout_ms, log.dropped if log is not None else 0)
    for rec in records.get(rank, []):
        written.add(rec, groups[rec.group])
    pg_config = {
        g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
        for g in groups.values()
        if rank in g.ranks
    }
    return {
        "version": FR_VERSION,
        "comm_lib_version": f"dstest ({recorder.world} world)",
        "rank": rank,
        "pg_config": pg_config,
        "pg_status": written.status,
        "entries": written.entries,
    }


def write_flight_recorder(
    directory: str | os.PathLike[str],
    recorder: Recorder,
    *,
    prefix: str = FR_PREFIX,
    backend: str = "nccl",
    timeout_ms: int = 0,
) -> list[str]:
    """Write a run's records as torch flight-recorder dumps, ``directory/<prefix><rank>`` for every rank of
    the world (ranks that called nothing get an empty dump: the analyzer wants one file per member). Read
    them with ``python -m torch.distributed.flight_recorder.fr_trace DIRECTORY``. Returns the paths.

    Give each run its own directory: the analyzer reads every file under the directory it is given,
    subdirectories included, and two runs' ``<prefix>0`` would be taken for one rank.
    """
    if not prefix or prefix[-1:].isdigit():
        raise ValueError(
            f"write_flight_recorder: prefix={prefix!r}: give a non-empty prefix that does not end in a digit"
        )
    folder = os.fspath(directory)
    os.makedirs(folder, exist_ok=True)
    records = {r: list(log.records) for r, log in recorder.logs.items()}
    groups = _groups(recorder, records)
    paths = []
    for rank in _ranks(recorder):
        path = os.path.join(folder, f"{prefix}{rank}")
        with open(path, "wb") as f:
            pickle.dump(_rank_dump(recorder, rank, records, groups, backend, timeout_ms), f)
        paths.append(path)
    return paths


def _ranks(recorder: Recorder) -> Iterable[int]:
    """Every rank of the world (the analyzer wants a dump of each member), or, in a world of more than
    :data:`MAX_DUMP_RANKS` (the fake world simulates a few ranks of thousands), the ranks that recorded."""
    if recorder.world_size <= MAX_DUMP_RANKS:
        return sorted(set(range(recorder.world_size)) | set(recorder.logs))
    return sorted(recorder.logs)


def analyzer_command(directory: str | os.PathLike[str], prefix: str = FR_PREFIX) -> str:
    """The command line that reads the dumps in ``directory``."""
    return f"{FR_COMMAND} {os.fspath(directory)} --prefix {prefix}"
