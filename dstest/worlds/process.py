"""The process world: ranks are warm OS processes joined by a real backend (gloo on CPU, NCCL on GPUs).

For code with process-global state (DeepSpeed caches its groups in module globals), which threads cannot
host. A *pool* of worker processes per (backend, device, world size) has already imported torch and formed
its process group, so a spec costs milliseconds instead of the seconds of a fresh spawn:

    parent                                      worker r (one per rank, started once per pool)
    run(fn, W) --- pickled (reference to fn, args) ---> resolve fn by module + qualname (+ file path)
                                                        fn(RankContext(rank=r, ...)) under a fresh store prefix
               <-- pickled result | traceback, output -- destroy the groups fn created

Functions travel by reference, so they must be module-level (a ``@dstest.spec`` body, a test module's
function, a benchmark's ``__main__`` function); arguments and results travel by pickle.

Failures never leave a broken pool behind. gloo cannot abort a rank blocked in a collective, so when a
rank fails and the others do not finish within a short grace, when a worker dies, or when the run passes
its timeout (stacks taken with faulthandler first), the pool is killed and a replacement is started at
once; the run raises :class:`RankFailure`, :class:`WorkerDied` or :class:`WorldTimeout` naming the ranks.
Rendezvous goes through a ``FileStore`` in a private temporary directory (no fixed ports: ``pytest -n``
works). No worker outlives the session: :func:`shutdown_all` runs from the plugin's ``pytest_unconfigure``
and at interpreter exit, and an idle worker whose parent is gone exits by itself.

Every collective and transfer of a gloo pool is checked across ranks before gloo runs it (see "Cross-rank
checking" below): a mismatch of op, group, sequence number, shapes, dtypes, root or split sizes raises
:class:`CollectiveMismatch` on every rank involved, naming both ranks and both calls; a rank that waits for
a collective that a finished or failed rank never joined is told so; a deadlock of all running ranks is
reported with each rank's pending call; work a run leaves unmatched or unwaited fails it with
:class:`UnfinishedWork` and never reaches gloo, so it cannot leak into the next run. NCCL pools are not
checked.

Warm workers are capped (:func:`warm_worker_cap`: ``max_warm_workers`` in this module, else the
``DSTEST_PROCESS_MAX_WORKERS`` environment variable, else ``DEFAULT_MAX_WARM_WORKERS``), all pools
together; starting a pool closes the least recently used idle ones beyond the cap, and a world larger
than the cap runs cold. A script must start the process world under ``if __name__ == "__main__":``
(workers import it to find its functions); an unguarded call raises :class:`UnguardedMain`.

Workers are forked from multiprocessing's fork server, which imports torch once (see ``_mp_context``):
a pool of 8 starts in well under a second once that server runs, and a replaced pool costs little. Where
there is no fork server, workers are spawned. This module imports neither torch nor the target at import
time; a worker sets its environment (``RANK``, ``OMP_NUM_THREADS``, ...) before it touches torch.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import importlib.util
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from dstest.errors import (
    CollectiveMismatch,
    InvalidArgument,
    RankFailure,
    UnfinishedWork,
    UnguardedMain,
    WorkerDied,
    WorldAborted,
    WorldTimeout,
)
from dstest.worlds.protocol import check_run_arguments

__all__ = [
    "DEFAULT_MAX_WARM_WORKERS",
    "FAILURE_GRACE",
    "MAX_WARM_WORKERS_ENV",
    "POOL_START_TIMEOUT",
    "ProcessWorld",
    "max_warm_workers",
    "pool_pids",
    "shutdown_all",
    "warm_worker_cap",
]

#: Seconds a pool may take to start and form its group (a cold fork server imports torch first).
POOL_START_TIMEOUT = 180.0
#: After one rank fails, seconds the others get to finish before the pool counts as poisoned (they are
#: probably blocked in a collective that the failed rank will never join) and is replaced.
FAILURE_GRACE = 1.0
#: The backend's own collective timeout. The parent enforces the run's timeout by killing the pool, so
#: this only has to be longer than any run; a shorter one would turn hangs into confusing backend errors.
_BACKEND_TIMEOUT_S = 6 * 3600
#: Seconds to wait for faulthandler's dump after signalling a worker.
_STACK_WAIT_S = 1.0
#: The environment variable that caps the worker processes kept warm, all pools of this process together:
#: an integer >= 0 (0 keeps none: every world runs cold). Read at each run.
MAX_WARM_WORKERS_ENV = "DSTEST_PROCESS_MAX_WORKERS"
#: The same cap as a setting of this module; when not None it wins over the environment variable.
max_warm_workers: int | None = None
#: The cap when neither is set.
DEFAULT_MAX_WARM_WORKERS = max(32, 4 * (os.cpu_count() or 1))
_OUTPUT_LIMIT = 1 << 20  # bytes of one rank's output forwarded per run
_STOP = b"stop"


# ------------------------------------------------------------------------------------------------------
# Messages between parent and workers
# ------------------------------------------------------------------------------------------------------


class _FnRef(NamedTuple):
    """How a worker finds the function: ``module.qualname``, loaded from ``path`` if needed."""

    module: str
    qualname: str
    path: str | None
    rewrite_asserts: bool  # the parent's module was assertion-rewritten by pytest: do the same


class _Command(NamedTuple):
    run_id: int
    ref: _FnRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int
    target: str


class _Reply(NamedTuple):
    run_id: int
    rank: int
    ok: bool
    result: bytes | None  # pickled return value (ok)
    traceback: str  # formatted traceback (not ok)
    exception: bytes | None  # pickled exception, if it pickles (not ok)
    output: str  # what the rank printed during the run (stdout and stderr, interleaved)
    unhealthy: str | None  # why this worker cannot serve another run (it destroyed the world group, ...)


@dataclass(frozen=True)
class _PoolKey:
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    world_size: int


@dataclass(frozen=True)
class _WorkerConfig:
    key: _PoolKey
    rank: int
    world_name: str
    store_path: str
    log_path: str
    stack_path: str
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)


class RemoteRankError(Exception):
    """Stands in for an exception of a worker that did not survive pickling; the message keeps its type."""


# ------------------------------------------------------------------------------------------------------
# Cross-rank checking, worker side
# ------------------------------------------------------------------------------------------------------
#
# gloo checks almost nothing across ranks: a shape, op, root or group-order mismatch hangs, a dtype
# mismatch aborts the process. So in a gloo pool every process group a run uses is a ``_CheckedGroup``, a
# Python ProcessGroup (registered as the c10d backend ``dstest_gloo``) that forwards to a real
# ProcessGroupGloo only after the parent's referee (``_Referee``) saw every rank's side of the call and
# found that they match. torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper does a similar check with a
# monitored barrier and a fingerprint all-gather over a helper gloo group; that only tells a rank that
# *its* call differs, needs every rank to reach the check (a skipped collective still hangs), and cannot
# see a rank that finished. The referee sees all ranks at once: who posted what, who waits, who finished.
#
#   rank r                                   parent (referee, inside the run's wait loop)
#   dist.all_reduce(t)
#     -> post(group, seq, Call of metadata) ---> compare with the other ranks' calls of (group, seq)
#     <- "ok" (once all posted) | error   <---- mismatch / a member finished / deadlock -> error to all
#   listener thread: "ok" -> issue the gloo op; wait() waits for it
#
# A call is issued to gloo only once every rank of its group posted a matching one, so gloo never sees
# an unmatched or mismatched call, and work that a run leaves unmatched cannot leak into the next run.
# Issuing happens on the listener thread, in verdict order (per group: sequence order), so async calls
# keep their meaning: they start when every rank has posted them, whether or not anyone waits yet.

_CHECKED_BACKEND = "dstest_gloo"
_CHECK_DRAIN_S = 10.0  # seconds a rank waits, at the end of a run, for matched work still in flight
_CHECK_ACK_S = 30.0  # seconds a rank waits for the referee to acknowledge the end of its run


class _Dev(NamedTuple):
    type: str


class _Meta(NamedTuple):
    """What the check needs of a tensor (dtype, shape, device type); pickles in microseconds."""

    dtype: Any
    shape: tuple[int, ...]
    device: _Dev

    @classmethod
    def of(cls, t: Any) -> _Meta:
        return cls(t.dtype, tuple(t.shape), _Dev(t.device.type))

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dim(self) -> int:
        return len(self.shape)


class _Record:
    """One posted call of this rank: its verdict, the gloo work issued for it, whether anyone waited."""

    __slots__ = ("callbacks", "error", "event", "inner", "issue", "issue_error", "post_id", "waited", "what")

    def __init__(self, post_id: int, what: str, issue: Callable[[], Any]) -> None:
        self.post_id = post_id
        self.what = what  # "all_reduce(float32[4]@cpu, op=sum) on group world (seq 3)"
        self.issue = issue
        self.event = threading.Event()
        self.error: tuple[str, str] | None = None  # (kind, message) from the referee
        self.inner: Any = None  # the gloo Work, once issued
        self.issue_error: BaseException | None = None  # gloo refused the call when it was issued
        self.waited = False
        self.callbacks: list[Callable[[], None]] = []


def _check_error(kind: str, message: str) -> BaseException:
    if kind == "aborted":
        return WorldAborted(message)
    return CollectiveMismatch(message)


class _Checker:
    """This worker's side of the check: posts calls, receives verdicts, issues matched calls to gloo."""

    def __init__(self, conn: Connection, rank: int, world_size: int) -> None:
        self.conn = conn
        self.rank = rank
        self.world_size = world_size
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.run_id = 0  # 0: between runs, calls go straight to gloo (the pool's warm-up all_reduce)
        self.records: dict[int, _Record] = {}
        self.posted: list[_Record] = []
        self.raised: list[str] = []  # mismatches raised on this rank during the run
        self.next_id = 0
        self.acked = threading.Event()
        self.listener = threading.Thread(target=self._listen, name="dstest-check-listener", daemon=True)
        self.listener.start()

    @property
    def active(self) -> bool:
        return self.run_id != 0

    def _send(self, msg: tuple[Any, ...]) -> None:
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(blob)

    # -- runs -------------------------------------------------------------------------------------------
    def begin(self, run_id: int) -> None:
        with self.lock:
            self.run_id = run_id
            self.records.clear()
            self.posted = []
            self.raised = []
            self.next_id = 0
            self.acked.clear()

    def end(self, failure: BaseException | None) -> tuple[BaseException | None, str | None]:
        """Close this rank's run with the referee; returns (the error the run must fail with, why the
        worker is unusable), both None when everything this rank posted was matched and waited."""
        summary = "" if failure is None else f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
        try:
            self._send(("done", self.run_id, failure is None, summary))
        except (EOFError, OSError):
            self.run_id = 0
            return None, "the check channel to the parent is closed"
        acked = self.acked.wait(_CHECK_ACK_S)
        with self.lock:
            posted = list(self.posted)
            raised = list(self.raised)
            self.run_id = 0  # late verdicts of this run are dropped from here on
        unhealthy = None if acked else f"the referee did not acknowledge the end of the run within {_CHECK_ACK_S:g} s"
        problems: list[str] = []
        for rec in posted:
            if not rec.event.is_set():
                problems.append(
                    f"{rec.what} was not matched by the other ranks it needs before the function returned, "
                    f"and never waited (nothing of it reached gloo)"
                )
                continue
            if rec.inner is not None and not rec.waited:
                # Matched, so every rank issued it and it completes: let it finish before the next run.
                # Never a second wait on waited work: gloo closes the pair when that one times out.
                try:
                    rec.inner.wait(datetime.timedelta(seconds=_CHECK_DRAIN_S))
                except Exception as exc:
                    unhealthy = unhealthy or f"{rec.what} did not complete at the end of the run: {exc}"
            if not rec.waited:
                if rec.error is not None:
                    problems.append(f"{rec.what} failed and was never waited: {rec.error[1].splitlines()[0]}")
                else:
                    problems.append(f"{rec.what} was never waited (async_op=True, isend or irecv without wait())")
        if failure is not None:
            return None, unhealthy
        if problems:
            return (
                UnfinishedWork(f"rank {self.rank} finished its function with work left behind: " + "; ".join(problems)),
                unhealthy,
            )
        if raised:
            return (
                CollectiveMismatch(
                    f"rank {self.rank}: a collective mismatch was raised and caught by the code under test, "
                    f"which then finished normally; the world still fails: {raised[0]}"
                ),
                unhealthy,
            )
        return None, unhealthy

    # -- posting ------------------------------------------------------------------------------------------
    def post(self, msg: tuple[Any, ...], what: str, issue: Callable[[], Any]) -> _Record:
        """Send one call's description (``msg`` without run and post ids) and return its record."""
        with self.lock:
            self.next_id += 1
            rec = _Record(self.next_id, what, issue)
            self.records[rec.post_id] = rec
            self.posted.append(rec)
            run_id = self.run_id
        self._send((msg[0], run_id, rec.post_id, *msg[1:]))
        return rec

    def wait_verdict(self, rec: _Record) -> None:
        rec.waited = True
        if not rec.event.is_set():
            with contextlib.suppress(EOFError, OSError):
                self._send(("wait", self.run_id, rec.post_id))
            rec.event.wait()
        if rec.error is not None:
            if rec.error[0] != "aborted":
                with self.lock:
                    self.raised.append(rec.error[1].splitlines()[0])
            raise _check_error(*rec.error)
        if rec.issue_error is not None:
            raise rec.issue_error

    # -- verdicts -----------------------------------------------------------------------------------------
    def _listen(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return
            kind, run_id = msg[0], msg[1]
            if run_id != self.run_id:
                continue  # a verdict of an earlier run
            if kind == "ack":
                self.acked.set()
                continue
            rec = self.records.pop(msg[2], None)
            if rec is None:
                continue
            if kind == "ok":
                try:
                    rec.inner = rec.issue()
                except Exception as exc:
                    rec.issue_error = exc
            else:
                rec.error = (msg[3], msg[4])
            with self.lock:
                rec.event.set()
                callbacks = list(rec.callbacks)
            for cb in callbacks:
                with contextlib.suppress(Exception):
                    cb()


_CHECKER: _Checker | None = None  # this worker's checker (set once in _worker_main, gloo pools only)


def _install_checking(checker: _Checker) -> None:
    """Make every gloo group this worker creates a ``_CheckedGroup`` that still reports itself as gloo.

    torch-internal: registers the backend and wraps ``distributed_c10d._new_process_group_helper`` (the
    one function every group creation goes through: init_process_group, new_group, new_subgroups,
    DeviceMesh) so that a request for "gloo" builds the checked backend, and then puts "gloo" back as the
    group's backend name, so that ``dist.get_backend()`` and code that branches on it see gloo.
    """
    global _CHECKER
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _CHECKER = checker
    dist.Backend.register_backend(_CHECKED_BACKEND, _create_checked_group, extended_api=True, devices=["cpu"])
    original = c10d._new_process_group_helper
    gloo_config = str(c10d.BackendConfig(dist.Backend("gloo")))

    def helper(
        group_size: int, group_rank: int, global_ranks: list[int], backend: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if str(backend) == "gloo":
            backend = _CHECKED_BACKEND
        pg, store = original(group_size, group_rank, global_ranks, backend, *args, **kwargs)
        if isinstance(pg, _checked_group_class()):  # our group: still named gloo to torch and to the code
            c10d._world.pg_map[pg] = ("gloo", c10d._world.pg_map[pg][1])  # type: ignore[index]
            c10d._world.pg_backend_config[pg] = gloo_config  # type: ignore[index]
        return pg, store

    helper.unchecked = original  # type: ignore[attr-defined]  # benchmarks build plain gloo groups with it
    c10d._new_process_group_helper = helper  # type: ignore[assignment]


def _create_checked_group(opts: Any, pg_options: Any) -> Any:
    from torch._C import _distributed_c10d as c10d_c

    inner = c10d_c.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    with contextlib.suppress(Exception):
        inner._set_sequence_number_for_group()  # as torch does for its own gloo groups
    assert _CHECKER is not None
    members = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return _checked_group_class()(inner, opts.group_rank, opts.group_size, members, str(opts.group_id), _CHECKER)


def _make_checked_group_class() -> type:
    """Build ``_CheckedGroup`` on first use: its base classes come from torch, which this module does
    not import at import time."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d_c

    from dstest.worlds import _collectives as C
    from dstest.worlds import _compat

    class CheckedWork(dist._Work):  # type: ignore[misc, name-defined]
        """The handle of a checked call: waits for the verdict, then for the gloo work issued on it."""

        def __init__(self, checker: _Checker, rec: _Record) -> None:
            super().__init__()
            self._checker = checker
            self._rec = rec

        def wait(self, timeout: Any = None) -> bool:
            rec = self._rec
            self._checker.wait_verdict(rec)
            if rec.inner is None:
                return True
            return bool(rec.inner.wait() if timeout is None else rec.inner.wait(timeout))

        def is_completed(self) -> bool:
            rec = self._rec
            done = rec.event.is_set() and (rec.inner is None or bool(rec.inner.is_completed()))
            if done:
                rec.waited = True
            return done

        def is_success(self) -> bool:
            rec = self._rec
            return self.is_completed() and rec.error is None and rec.issue_error is None

        def exception(self) -> BaseException | None:
            rec = self._rec
            if rec.error is not None:
                return _check_error(*rec.error)
            return rec.issue_error

        def result(self) -> list[Any]:
            rec = self._rec
            return list(rec.inner.result()) if rec.inner is not None else []

        def source_rank(self) -> int:
            return int(self._rec.inner.source_rank()) if self._rec.inner is not None else -1

        def synchronize(self) -> None:
            self.wait()

        def get_future(self) -> Any:
            rec = self._rec
            rec.waited = True
            fut: Any = torch.futures.Future()

            def resolve() -> None:
                if rec.error is not None:
                    fut.set_exception(_check_error(*rec.error))
                elif rec.issue_error is not None:
                    fut.set_exception(rec.issue_error)
                elif rec.inner is None:
                    fut.set_result([])
                else:

                    def forward(inner_fut: Any) -> None:
                        try:
                            fut.set_result(inner_fut.value())
                        except Exception as exc:
                            fut.set_exception(exc)

                    rec.inner.get_future().add_done_callback(forward)

            with self._checker.lock:
                if not rec.event.is_set():
                    rec.callbacks.append(resolve)
                    return fut
            resolve()
            return fut

    class DoneWork(dist._Work):  # type: ignore[misc, name-defined]
        """Already complete: the coalesced forms, which wait for their parts before returning."""

        def __init__(self, tensors: list[Any]) -> None:
            super().__init__()
            self._tensors = tensors

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def result(self) -> list[Any]:
            return self._tensors

        def get_future(self) -> Any:
            fut: Any = torch.futures.Future()
            fut.set_result(self._tensors)
            return fut

    def metas(ts: Sequence[Any]) -> list[Any]:  # stand in for tensors where the Calls expect them
        return [_Meta.of(t) for t in ts]

    def meta(t: Any) -> Any:
        return _Meta.of(t)

    class CheckedGroup(dist.ProcessGroup):
        """One rank's handle on one group of a gloo pool: every call is checked across ranks, then gloo runs it.

        Between runs (the pool's own warm-up) calls go straight to gloo.
        """

        def __init__(
            self, inner: Any, rank: int, size: int, members: tuple[int, ...], gid: str, checker: _Checker
        ) -> None:
            super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload has no stub
            self.inner = inner
            self.rank_ = rank
            self.size_ = size
            self.members = members
            self.gid = gid
            self.checker = checker
            self.seq = 0
            self.seq_run = 0  # the run the sequence numbers count in (the world group outlives runs)
            self._group_name = ""
            self._group_desc = ""
            self.label = "world" if gid == "0" and len(members) == checker.world_size else f"{gid} {list(members)}"
            # C++ code that asks the group for its gloo backend by type (DDP's logger does) finds it; the
            # collectives it issues still come through the methods below (torch calls them virtually).
            self._register_backend(torch.device("cpu"), c10d_c.ProcessGroup.BackendType.GLOO, inner)
            self._set_default_backend(c10d_c.ProcessGroup.BackendType.GLOO)

        # -- what torch asks of a group ------------------------------------------------------------------
        def getGroupName(self) -> str:
            return self._group_name

        def setGroupName(self, name: str) -> None:
            self._group_name = name

        def getGroupDesc(self) -> str:
            return self._group_desc

        def setGroupDesc(self, desc: str) -> None:
            self._group_desc = desc

        @property
        def group_name(self) -> Any:
            return self._group_name

        @property
        def group_desc(self) -> str:
            return self._group_desc

        def _get_backend(self, device: Any) -> Any:
            return self

        def getBackendName(self) -> str:
            return "gloo"

        def name(self) -> str:
            return "gloo"

        def shutdown(self) -> None:
            pass

        # -- checking --------------------------------------------------------------------------------------
        def _next_seq(self) -> int:
            if self.seq_run != self.checker.run_id:
                self.seq_run, self.seq = self.checker.run_id, 0
            self.seq += 1
            return self.seq

        def _post(self, call: Any, issue: Callable[[], Any]) -> Any:
            checker = self.checker
            if not checker.active:
                return issue()
            call.check_local()
            seq = self._next_seq()
            what = f"{call.describe()} on group {self.label} (seq {seq})"
            rec = checker.post(("post", self.gid, self.members, seq, call), what, issue)
            return CheckedWork(checker, rec)

        def _p2p(self, kind: str, t: Any, peer: int, tag: int, issue: Callable[[], Any]) -> Any:
            checker = self.checker
            if not checker.active:
                return issue()
            if not 0 <= peer < self.size_:
                raise InvalidArgument(
                    f"{kind}: peer rank {peer} is not in group {self.label} (group ranks 0..{self.size_ - 1})"
                )
            arrow = "to" if kind == "send" else "from"
            what = f"{kind}({C.describe_tensor(t)} {arrow} rank {self.members[peer]}, tag={tag}) on group {self.label}"
            msg = ("p2p", self.gid, self.members, kind, self.rank_, peer, tag, _Meta.of(t), what)
            return CheckedWork(checker, checker.post(msg, what, issue))

        def _op(self, opts: Any) -> str:
            return _compat.reduce_op_name(opts.reduceOp)

        # -- collectives (signatures as c10d calls them) ---------------------------------------------------
        def allreduce(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.AllreduceOptions()
            t = C._one(tensors, "all_reduce")
            call = C.AllReduce(self.rank_, self.size_, meta(t), self._op(opts))
            return self._post(call, lambda: self.inner.allreduce(tensors, opts))

        def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> Any:
            opts = opts if opts is not None else c10d_c.AllreduceCoalescedOptions()
            n = sum(t.numel() for t in tensors)
            dtype = tensors[0].dtype if tensors else torch.float32
            call = C.AllReduce(self.rank_, self.size_, _Meta(dtype, (n,), _Dev("cpu")), self._op(opts))  # type: ignore[arg-type]
            return self._post(call, lambda: self.inner.allreduce_coalesced(tensors, opts))

        def broadcast(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.BroadcastOptions()
            t = C._one(tensors, "broadcast")
            call = C.Broadcast(self.rank_, self.size_, meta(t), int(opts.rootRank))
            return self._post(call, lambda: self.inner.broadcast(tensors, opts))

        def reduce(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.ReduceOptions()
            t = C._one(tensors, "reduce")
            call = C.Reduce(self.rank_, self.size_, meta(t), self._op(opts), int(opts.rootRank))
            return self._post(call, lambda: self.inner.reduce(tensors, opts))

        def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.AllgatherOptions()
            t = C._one(inputs, "all_gather")
            call = C.AllGather(self.rank_, self.size_, metas(outputs[0]), meta(t))
            return self._post(call, lambda: self.inner.allgather(outputs, inputs, opts))

        def _allgather_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else c10d_c.AllgatherOptions()
            call = C.AllGatherIntoTensor(self.rank_, self.size_, meta(output), meta(inp))
            return self._post(call, lambda: self.inner._allgather_base(output, inp, opts))

        def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.ReduceScatterOptions()
            out = C._one(outputs, "reduce_scatter")
            call = C.ReduceScatter(self.rank_, self.size_, meta(out), metas(inputs[0]), self._op(opts))
            return self._post(call, lambda: self.inner.reduce_scatter(outputs, inputs, opts))

        def _reduce_scatter_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else c10d_c.ReduceScatterOptions()
            call = C.ReduceScatterTensor(self.rank_, self.size_, meta(output), meta(inp), self._op(opts))
            return self._post(call, lambda: self.inner._reduce_scatter_base(output, inp, opts))

        def alltoall(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
            opts = opts if opts is not None else c10d_c.AllToAllOptions()
            call = C.AllToAll(self.rank_, self.size_, metas(outputs), metas(inputs))
            return self._post(call, lambda: self.inner.alltoall(outputs, inputs, opts))

        def alltoall_base(
            self, output: Any, inp: Any, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None
        ) -> Any:
            opts = opts if opts is not None else c10d_c.AllToAllOptions()
            call = C.AllToAllSingle(
                self.rank_, self.size_, meta(output), meta(inp), output_split_sizes, input_split_sizes
            )
            return self._post(
                call, lambda: self.inner.alltoall_base(output, inp, output_split_sizes, input_split_sizes, opts)
            )

        def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.GatherOptions()
            t = C._one(inputs, "gather")
            outs = outputs[0] if outputs else []
            call = C.Gather(self.rank_, self.size_, metas(outs), meta(t), int(opts.rootRank))
            return self._post(call, lambda: self.inner.gather(outputs, inputs, opts))

        def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:  # type: ignore[override]
            opts = opts if opts is not None else c10d_c.ScatterOptions()
            out = C._one(outputs, "scatter")
            ins = inputs[0] if inputs else []
            call = C.Scatter(self.rank_, self.size_, meta(out), metas(ins), int(opts.rootRank))
            return self._post(call, lambda: self.inner.scatter(outputs, inputs, opts))

        # torch renamed the single-tensor entry points (2.13 calls these; older releases the _base names).
        all_gather_single = _allgather_base  # type: ignore[assignment]
        reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
        all_to_all_single = alltoall_base  # type: ignore[assignment]

        def _coalesced(self, works: list[Any], tensors: list[Any]) -> Any:
            """Coalesced forms run as consecutive checked collectives, in list order, on every rank."""
            for work in works:
                work.wait()
            return DoneWork(tensors)

        def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
            return self._coalesced([self._allgather_base(o, i) for o, i in zip(outputs, inputs)], outputs)

        allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

        def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
            return self._coalesced([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

        def barrier(self, opts: Any = None) -> Any:
            opts = opts if opts is not None else c10d_c.BarrierOptions()
            return self._post(C.Barrier(self.rank_, self.size_), lambda: self.inner.barrier(opts))

        def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
            self.barrier().wait()

        def send(self, tensors: list[Any], dst: int, tag: int = 0) -> Any:
            t = C._one(tensors, "send")
            return self._p2p("send", t, int(dst), int(tag), lambda: self.inner.send(tensors, dst, tag))

        def recv(self, tensors: list[Any], src: int, tag: int = 0) -> Any:
            t = C._one(tensors, "recv")
            return self._p2p("recv", t, int(src), int(tag), lambda: self.inner.recv(tensors, src, tag))

        def recv_anysource(self, tensors: list[Any], tag: int = 0) -> Any:
            raise InvalidArgument(
                "recv without src (any source) is not supported by the checked process world: pass src"
            )

    return CheckedGroup


class _LazyCheckedGroup:
    """``isinstance(x, _CheckedGroup)`` before the class exists (torch not imported yet) is simply False."""

    cls: type | None = None


def _checked_group_class() -> type:
    if _LazyCheckedGroup.cls is None:
        _LazyCheckedGroup.cls = _make_checked_group_class()
    return _LazyCheckedGroup.cls


# ------------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------------


def _worker_main(cfg: _WorkerConfig, conn: Connection, check_conn: Connection) -> None:
    """Entry point of a worker process: form the group once, then serve runs until told to stop."""
    os.environ.update(cfg.env)  # before torch is imported: OMP_NUM_THREADS, RANK, ...
    log_fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for stream in (sys.stdout, sys.stderr):  # a hung rank's last prints must reach the file
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    read_fd = os.open(cfg.log_path, os.O_RDONLY)

    import faulthandler

    stack_file = open(cfg.stack_path, "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(
        target=_watch_parent, args=(cfg.parent_pid, os.getppid()), name="dstest-parent-watch", daemon=True
    ).start()
    _name_process(f"dstest-r{cfg.rank}")
    # Ctrl-C in a terminal reaches the whole process group; the parent handles it (and kills the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import datetime

    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" in cfg.env:
        torch.set_num_threads(int(cfg.env["OMP_NUM_THREADS"]))
    key = cfg.key
    if key.device == "cuda":
        device = torch.device("cuda", cfg.rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from torch._C import _distributed_c10d as c10d_store  # where the store classes live (and are typed)

    checker = None
    if key.backend == "gloo":
        checker = _Checker(check_conn, cfg.rank, key.world_size)
        _install_checking(checker)
    dist.init_process_group(
        key.backend,
        store=c10d_store.FileStore(cfg.store_path, key.world_size),
        rank=cfg.rank,
        world_size=key.world_size,
        timeout=datetime.timedelta(seconds=_BACKEND_TIMEOUT_S),
        device_id=device if key.device == "cuda" else None,  # NCCL: form the communicator now
    )
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # connect and warm the backend so the first spec pays nothing
    if key.device == "cuda":
        torch.cuda.synchronize()
    # Imported once here rather than by the first spec.
    import dstest.context
    import dstest.specification  # noqa: F401

    conn.send(("ready", os.getpid()))
    server = _Server(cfg, device, read_fd, checker)
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if blob == _STOP:
            break
        reply = server.serve(blob)
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except (EOFError, OSError):
            break
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # No teardown of the group: the parent is stopping every rank at once, and a collective shutdown
    # could wait for ranks that are already gone. The parent removes the store's directory.
    os._exit(0)


def _watch_parent(parent_pid: int, launcher_pid: int) -> None:
    """Exit when the parent is gone (killed with SIGKILL, say), even if this rank is stuck in a collective.

    ``launcher_pid`` is this worker's own parent: the parent itself, or the fork server, which exits
    with it.
    """
    while True:
        time.sleep(0.5)
        if os.getppid() != launcher_pid:
            os._exit(3)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except OSError:
            pass


def _name_process(name: str) -> None:
    """Show workers as ``dstest-r<rank>`` in ps/top and /proc/<pid>/comm (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class _Server:
    """One worker's state across runs: resolved functions, the world group's store, the log offsets."""

    def __init__(self, cfg: _WorkerConfig, device: Any, read_fd: int, checker: _Checker | None) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.cfg = cfg
        self.checker = checker
        self.device = device
        self.read_fd = read_fd
        self.functions: dict[_FnRef, Callable[..., Any]] = {}
        self.default_pg = c10d._get_default_group()
        self.backend_name, self.base_store = c10d._world.pg_map[self.default_pg]
        self.group_count = c10d._world.group_count

    def serve(self, blob: bytes) -> _Reply:
        import random

        import torch

        from dstest.context import RankContext, rank_seed

        rank = self.cfg.rank
        start = self._log_offset()
        ok, result, tb, exc_blob = False, None, "", None
        run_id = -1
        failure: BaseException | None = None
        value: Any = None
        checking = False
        try:
            cmd: _Command = pickle.loads(blob)
            run_id = cmd.run_id
            if self.checker is not None:
                self.checker.begin(run_id)  # before anything can fail: the referee hears of every end
                checking = True
            fn = self._resolve(cmd.ref)
            self._begin_run(run_id)
            ctx = RankContext(
                rank=rank,
                world_size=self.cfg.key.world_size,
                world=self.cfg.world_name,
                device=self.device,
                seed=cmd.seed,
                target_name=cmd.target,
            )
            # Processes, unlike threads, own their global RNGs: seed them too, so that a spec drawing from
            # torch.randn is as deterministic as one using ctx.generator (E5).
            torch.manual_seed(rank_seed(cmd.seed, rank))
            random.seed(rank_seed(cmd.seed, rank))
            token = ctx.bind()
            try:
                value = fn(ctx, *cmd.args, **cmd.kwargs)
            finally:
                RankContext.unbind(token)
        except BaseException as exc:  # the parent reports every rank's outcome, so catch all
            failure = exc
        check_unhealthy = None
        if checking:
            assert self.checker is not None
            try:
                left, check_unhealthy = self.checker.end(failure)
            except Exception as exc:
                left, check_unhealthy = None, f"closing the run's check failed: {type(exc).__name__}: {exc}"
            failure = failure or left
        if failure is None:
            try:
                try:
                    result = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise TypeError(
                        f"rank {rank} returned {type(value).__name__} {value!r:.200}, which cannot be pickled "
                        f"back to the parent ({type(exc).__name__}: {exc}); return picklable values"
                    ) from exc
                ok = True
            except TypeError as exc:
                failure = exc
        if failure is not None:
            tb = "".join(traceback.format_exception(failure))
            exc_blob = _pickle_exception(failure)
        unhealthy = self._end_run() or check_unhealthy
        return _Reply(run_id, rank, ok, result, tb, exc_blob, self._output_since(start), unhealthy)

    # -- finding the function ------------------------------------------------------------------------
    def _resolve(self, ref: _FnRef) -> Callable[..., Any]:
        fn = self.functions.get(ref)
        if fn is None:
            module = _import_module(ref)
            obj: Any = module
            for part in ref.qualname.split("."):
                obj = getattr(obj, part)
            from dstest.specification import spec_info

            info = spec_info(obj)
            fn = info.fn if info is not None else obj
            self.functions[ref] = fn
        return fn

    # -- groups of one run -------------------------------------------------------------------------------
    def _begin_run(self, run_id: int) -> None:
        """Give the run fresh store keys and the group names a fresh world would have.

        torch 2.13 names groups "1", "2", ... from ``_world.group_count`` and keeps their rendezvous keys
        in the default store under that name; a second run reusing a name would read the keys of a dead
        group. Each run therefore sees the default store under its own prefix (all ranks get the same
        run id), and every run starts counting names where a fresh world does, so ranks stay in sync
        even after a run in which they created different numbers of groups.
        """
        from torch._C import _distributed_c10d as c10d_store
        from torch.distributed import distributed_c10d as c10d

        prefixed = c10d_store.PrefixStore(f"dstest-run{run_id}/", self.base_store)
        c10d._world.pg_map[self.default_pg] = (self.backend_name, prefixed)
        c10d._world.group_count = self.group_count

    def _end_run(self) -> str | None:
        """Destroy the groups the run created; say why this worker is unusable, if it is."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized() or c10d._get_default_group() is not self.default_pg:
            return "the run destroyed or replaced the default process group"
        problem = None
        for pg in list(c10d._world.pg_map):
            if pg is self.default_pg:
                continue
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:
                problem = f"could not destroy a process group the run created: {type(exc).__name__}: {exc}"
        c10d._world.pg_map[self.default_pg] = (self.backend_name, self.base_store)
        c10d._world.group_count = self.group_count
        return problem

    # -- output --------------------------------------------------------------------------------------------
    def _log_offset(self) -> int:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        return os.lseek(1, 0, os.SEEK_CUR)

    def _output_since(self, start: int) -> str:
        end = self._log_offset()
        if end <= start:
            return ""
        size = min(end - start, _OUTPUT_LIMIT)
        data = os.pread(self.read_fd, size, end - size)
        skipped = end - start - size
        text = data.decode(errors="replace")
        return f"[... {skipped} bytes of output cut ...]\n{text}" if skipped else text


def _pickle_exception(exc: BaseException) -> bytes | None:
    outcome = _pytest_outcome(exc)
    try:
        return pickle.dumps(outcome or exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _pytest_outcome(exc: BaseException) -> tuple[str, str, str] | None:
    """pytest.skip/fail/xfail raise classes that claim to live in ``builtins`` and so do not pickle."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is None:
        return None
    for kind in ("Skipped", "XFailed", "Failed", "Exit"):
        cls = getattr(outcomes, kind, None)
        if cls is not None and isinstance(exc, cls):
            return ("pytest-outcome", kind, str(getattr(exc, "msg", None) or exc))
    return None


def _import_module(ref: _FnRef) -> Any:
    """The module ``ref`` names: already imported, importable by name, or loaded from its file."""
    module = sys.modules.get(ref.module)
    if module is not None and (ref.path is None or _same_file(getattr(module, "__file__", None), ref.path)):
        return module
    if ref.path is None:
        return importlib.import_module(ref.module)
    # Make the module's own imports work as they do under pytest's default import mode: the first
    # directory above it that is not a package goes on sys.path.
    base = os.path.dirname(os.path.abspath(ref.path))
    while os.path.isfile(os.path.join(base, "__init__.py")):
        base = os.path.dirname(base)
    if base not in sys.path:
        sys.path.insert(0, base)
    if not ref.rewrite_asserts:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(ref.module)
            if _same_file(getattr(module, "__file__", None), ref.path):
                return module
    return _load_from_path(ref.module, ref.path, ref.rewrite_asserts)


def _load_from_path(name: str, path: str, rewrite_asserts: bool) -> Any:
    """Load ``path`` as module ``name``, with pytest's assertion rewriting when the parent had it."""
    parent = name.rpartition(".")[0]
    if parent:
        with contextlib.suppress(ImportError):
            importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load module {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as f:
        source = f.read()
    code = None
    if rewrite_asserts:
        try:
            import ast

            from _pytest.assertion.rewrite import rewrite_asserts as rewrite

            tree = ast.parse(source, filename=path)
            rewrite(tree, source, path)
            code = compile(tree, path, "exec", dont_inherit=True)
        except Exception:
            code = None  # plain asserts still work, with less detail
    if code is None:
        code = compile(source, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------------
# Cross-rank checking, parent side
# ------------------------------------------------------------------------------------------------------


class _Exchange:
    """Every rank's side of one collective of one group (matched by group and sequence number)."""

    __slots__ = ("calls", "error", "gid", "members", "posts", "seq", "where")

    def __init__(self, gid: str, members: tuple[int, ...], seq: int, where: str) -> None:
        self.gid = gid
        self.members = members
        self.seq = seq
        self.where = where
        self.calls: dict[int, Any] = {}  # global rank -> Call
        self.posts: dict[int, int] = {}  # global rank -> post id
        self.error: tuple[str, str] | None = None


class _Transfer(NamedTuple):
    rank: int  # global rank that posted it
    post_id: int
    meta: Any
    what: str


class _Referee:
    """Matches the calls every rank of one run posts, and answers each rank with "ok" or an error.

    Lives in the parent for one run, fed by :meth:`_Pool._exchange`; it sees every rank at once, so it
    also tells a rank that waits for a collective another rank will never join because that rank
    finished or failed, and reports a deadlock when every rank still running waits in a call that
    cannot complete.
    """

    def __init__(self, run_id: int, world_size: int, conns: list[Connection]) -> None:
        self.run_id = run_id
        self.world_size = world_size
        self.conns = conns
        self.exchanges: dict[tuple[str, int], _Exchange] = {}
        self.transfers: dict[tuple[str, int, int, int], tuple[deque[_Transfer], deque[_Transfer]]] = {}
        # (rank, post id) -> (what, exchange or transfer key, the peer's global rank for a transfer)
        self.pending: dict[tuple[int, int], tuple[str, Any, int | None]] = {}
        self.blocked: dict[int, int] = {}  # rank -> post id it waits for
        self.done: dict[int, str] = {}  # rank -> "finished its function" | "failed (...)"
        self.failed: set[int] = set()

    # -- messages ---------------------------------------------------------------------------------------
    def handle(self, rank: int, blob: bytes) -> None:
        msg = pickle.loads(blob)
        if msg[1] != self.run_id:
            return
        kind = msg[0]
        if kind == "post":
            self._post(rank, msg[2], msg[3], msg[4], msg[5], msg[6])
        elif kind == "p2p":
            self._p2p(rank, *msg[2:])
        elif kind == "wait":
            if (rank, msg[2]) in self.pending:
                self.blocked[rank] = msg[2]
                self._detect_deadlock()
        elif kind == "done":
            self._done(rank, bool(msg[2]), str(msg[3]))

    def _send(self, rank: int, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(EOFError, OSError):
            self.conns[rank].send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _ok(self, rank: int, post_id: int) -> None:
        self.pending.pop((rank, post_id), None)
        if self.blocked.get(rank) == post_id:
            del self.blocked[rank]
        self._send(rank, ("ok", self.run_id, post_id))

    def _fail(self, rank: int, post_id: int, kind: str, message: str) -> None:
        self.pending.pop((rank, post_id), None)
        if self.blocked.get(rank) == post_id:
            del self.blocked[rank]
        self._send(rank, ("err", self.run_id, post_id, kind, message))

    def _fail_exchange(self, ex: _Exchange, kind: str, message: str, skip: int | None = None) -> None:
        """Fail every side of ``ex`` posted so far, and those posted later (``skip``: a rank that left)."""
        ex.error = (kind, message)
        for r, post_id in ex.posts.items():
            if r != skip and (r, post_id) in self.pending:
                self._fail(r, post_id, kind, message)

    def _gone(self, rank: int) -> tuple[str, str]:
        """(kind, phrase) for a rank that left the run: it finished normally or it failed."""
        return ("aborted" if rank in self.failed else "mismatch", self.done[rank])

    # -- collectives ----------------------------------------------------------------------------------------
    def _post(self, rank: int, post_id: int, gid: str, members: tuple[int, ...], seq: int, call: Any) -> None:
        from dstest.worlds import _collectives as C

        key = (gid, seq)
        ex = self.exchanges.get(key)
        if ex is None:
            label = "world" if gid == "0" and len(members) == self.world_size else f"{gid} {list(members)}"
            ex = self.exchanges[key] = _Exchange(gid, members, seq, f"group {label} (seq {seq})")
        what = f"{call.describe()} on {ex.where}"
        self.pending[(rank, post_id)] = (what, key, None)
        ex.posts[rank] = post_id
        if ex.error is not None:
            self._fail(rank, post_id, *ex.error)
            return
        if members != ex.members:
            first = next(iter(ex.calls.items()), None)
            other = f"rank {first[0]} called {first[1].describe()} on group {gid} {list(ex.members)}" if first else ""
            self._fail_exchange(
                ex,
                "mismatch",
                f"collective mismatch on group {gid} (seq {seq}): rank {rank} called {call.describe()} on group "
                f"{gid} {list(members)} but {other} (the ranks created their groups differently)",
            )
            return
        if ex.calls:
            first_rank, first = next(iter(ex.calls.items()))
            why = call.check_peer(first)
            if why is not None:
                err = C.mismatch(f"collective mismatch on {ex.where}", first_rank, first, rank, call, why)
                self._fail_exchange(ex, "mismatch", str(err))
                return
        ex.calls[rank] = call
        gone = [r for r in members if r in self.done and r not in ex.calls]
        if gone:
            kind, phrase = self._gone(gone[0])
            self._fail_exchange(ex, kind, self._left_message(ex, gone[0], phrase))
            return
        if len(ex.calls) < len(members):
            return
        del self.exchanges[key]
        calls = sorted(ex.calls.values(), key=lambda c: c.group_rank)
        why = calls[0].check_all(calls)
        if why is not None:
            self._fail_exchange(
                ex,
                "mismatch",
                f"collective mismatch on {ex.where}: {why}; calls: "
                + "; ".join(f"rank {r} called {ex.calls[r].describe()}" for r in members),
            )
            return
        for r, p in ex.posts.items():
            self._ok(r, p)

    def _left_message(self, ex: _Exchange, gone: int, phrase: str) -> str:
        waiting = "; ".join(f"rank {r} called {c.describe()}" for r, c in sorted(ex.calls.items()))
        if gone in ex.calls:
            return (
                f"collective on {ex.where} cannot complete: rank {gone} {phrase} without waiting for its "
                f"{ex.calls[gone].describe()}, and ranks {[r for r in ex.members if r not in ex.calls]} "
                f"have not joined; {waiting}"
            )
        return f"collective on {ex.where} cannot complete: rank {gone} {phrase} without calling it; {waiting}"

    # -- point to point -------------------------------------------------------------------------------------
    def _p2p(
        self,
        rank: int,
        post_id: int,
        gid: str,
        members: tuple[int, ...],
        kind: str,
        me: int,
        peer: int,
        tag: int,
        meta: Any,
        what: str,
    ) -> None:
        src, dst = (me, peer) if kind == "send" else (peer, me)
        key = (gid, src, dst, tag)
        peer_rank = members[peer]
        self.pending[(rank, post_id)] = (what, key, peer_rank)
        sends, recvs = self.transfers.setdefault(key, (deque(), deque()))
        mine, theirs = (sends, recvs) if kind == "send" else (recvs, sends)
        entry = _Transfer(rank, post_id, meta, what)
        if not theirs:
            if peer_rank in self.done:
                k, phrase = self._gone(peer_rank)
                self._fail(
                    rank,
                    post_id,
                    k,
                    f"rank {rank} called {what}, but rank {peer_rank} {phrase} without a matching "
                    f"{'recv' if kind == 'send' else 'send'}",
                )
                return
            mine.append(entry)
            return
        other = theirs.popleft()
        send, recv = (entry, other) if kind == "send" else (other, entry)
        if (send.meta.dtype, send.meta.shape) != (recv.meta.dtype, recv.meta.shape):
            message = (
                f"point-to-point mismatch on group {gid}: rank {send.rank} called {send.what} but rank "
                f"{recv.rank} called {recv.what}"
            )
            self._fail(send.rank, send.post_id, "mismatch", message)
            self._fail(recv.rank, recv.post_id, "mismatch", message)
            return
        self._ok(send.rank, send.post_id)
        self._ok(recv.rank, recv.post_id)

    # -- ranks leaving, deadlocks ---------------------------------------------------------------------------
    def _done(self, rank: int, ok: bool, summary: str) -> None:
        self.done[rank] = "finished its function" if ok else f"failed ({summary})"
        if not ok:
            self.failed.add(rank)
        self.blocked.pop(rank, None)
        kind, phrase = self._gone(rank)
        for ex in list(self.exchanges.values()):
            if rank in ex.members and ex.error is None:  # its own side stays unanswered: it reports that
                self._fail_exchange(ex, kind, self._left_message(ex, rank, phrase), skip=rank)
        for sends, recvs in self.transfers.values():
            for queue_ in (sends, recvs):
                for t in [t for t in queue_ if t.rank == rank]:
                    queue_.remove(t)  # left unmatched: the rank itself reports them
        for (r, post_id), (what, _key, peer) in list(self.pending.items()):
            if r != rank and peer == rank:
                self._fail(
                    r, post_id, kind, f"rank {r} called {what}, but rank {rank} {phrase} without a matching transfer"
                )
        self._send(rank, ("ack", self.run_id))
        self._detect_deadlock()

    def _needs(self, rank: int, post_id: int) -> list[int]:
        _what, key, peer = self.pending[(rank, post_id)]
        if peer is not None:
            return [peer]
        ex = self.exchanges.get(key)
        return [r for r in ex.members if r not in ex.calls] if ex is not None else []

    def _detect_deadlock(self) -> None:
        if not self.blocked or len(self.blocked) + len(self.done) < self.world_size:
            return  # some rank is still running and may yet post what the others wait for
        lines = []
        for r in sorted(self.blocked):
            what = self.pending[(r, self.blocked[r])][0]
            needs = ", ".join(
                f"rank {n} ("
                + (
                    self.done[n]
                    if n in self.done
                    else "waiting in " + self.pending[(n, self.blocked[n])][0]
                    if n in self.blocked
                    else "running"
                )
                + ")"
                for n in self._needs(r, self.blocked[r])
            )
            lines.append(f"  rank {r} waits in {what} for {needs}")
        message = (
            "deadlock: every rank still running waits for a collective that cannot complete "
            "(mismatched collectives, groups or peers):\n" + "\n".join(lines)
        )
        for r, post_id in list(self.blocked.items()):
            self._fail(r, post_id, "mismatch", message)


# ------------------------------------------------------------------------------------------------------
# Parent side: the pools
# ------------------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, rank: int, process: Any, conn: Connection, cfg: _WorkerConfig, check: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.cfg = cfg
        self.check = check  # calls to check and verdicts (gloo pools; unused by NCCL ones)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "is still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def output_since(self, offset: int, limit: int = 8000) -> str:
        """What this worker printed from ``offset`` of its log on (the last ``limit`` bytes of it)."""
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(offset, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, limit: int = 4000) -> str:
        try:
            with open(self.cfg.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class _Pool:
    """``world_size`` warm workers sharing one process group; serves one run at a time."""

    def __init__(self, key: _PoolKey, world_name: str) -> None:
        self.key = key
        self.world_name = world_name
        self.lock = threading.Lock()
        self.workers: list[_Worker] = []
        self.ready = False
        self.closed = False
        self.start_failed = False  # not worth replacing at once: the replacement would fail the same way
        self.run_ids = itertools.count(1)
        self.last_used = time.monotonic()
        self.started_at = 0.0
        self.start_seconds: float | None = None  # measured launch-to-ready time
        self.dir = ""
        self.launcher: threading.Thread | None = None
        self.launch_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> _Pool:
        """Launch the workers and return at once; they form the group in the background."""
        self.dir = tempfile.mkdtemp(prefix=f"dstest-{self.key.backend}-ws{self.key.world_size}-")
        store_path = os.path.join(self.dir, "store")
        port = _free_port()
        threads = _threads_per_rank(self.key.world_size)
        # The parent's environment as it is now, as a spawned child would get it (a forkserver child
        # would otherwise get the environment of the moment the fork server started).
        base_env = dict(os.environ)
        configs = []
        for rank in range(self.key.world_size):
            env = base_env | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.key.world_size),
                "LOCAL_WORLD_SIZE": str(self.key.world_size),
                "MASTER_ADDR": "127.0.0.1",  # for code that reads them (DeepSpeed); rendezvous uses the store
                "MASTER_PORT": str(port),
            }
            if self.key.device == "cpu":
                env["DS_ACCELERATOR"] = "cpu"
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            configs.append(
                _WorkerConfig(
                    key=self.key,
                    rank=rank,
                    world_name=self.world_name,
                    store_path=store_path,
                    log_path=os.path.join(self.dir, f"rank{rank}.log"),
                    stack_path=os.path.join(self.dir, f"rank{rank}.stack"),
                    parent_pid=os.getpid(),
                    env=env,
                )
            )
        self.started_at = time.monotonic()
        # Launching blocks while a fresh fork server imports torch; do it off the caller's thread.
        self.launcher = threading.Thread(target=self._launch, args=(configs,), name="dstest-pool-launch", daemon=True)
        self.launcher.start()
        return self

    def _launch(self, configs: list[_WorkerConfig]) -> None:
        try:
            ctx = _mp_context()
            for cfg in configs:
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                parent_check, child_check = ctx.Pipe(duplex=True)  # the cross-rank check's channel
                process = ctx.Process(
                    target=_worker_main,
                    args=(cfg, child_conn, child_check),
                    name=f"dstest-{self.world_name}-rank{cfg.rank}",
                )
                process.start()
                child_conn.close()
                child_check.close()
                self.workers.append(_Worker(cfg.rank, process, parent_conn, cfg, parent_check))
        except BaseException as exc:  # reported by wait_ready
            self.launch_error = exc

    def _join_launcher(self) -> None:
        if self.launcher is not None:
            self.launcher.join(max(0.0, self.started_at + POOL_START_TIMEOUT - time.monotonic()))

    def wait_ready(self) -> None:
        if self.ready:
            return
        self._join_launcher()
        if self.launch_error is not None or len(self.workers) < self.key.world_size:
            self.start_failed = True
            self.kill()
            raise WorkerDied(
                f"{self._label()}: could not launch the workers: {self.launch_error!r}"
            ) from self.launch_error
        deadline = self.started_at + POOL_START_TIMEOUT
        waiting = {w.conn: w for w in self.workers}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = sorted(w.rank for w in waiting.values())
                self.start_failed = True
                self.kill()
                raise WorkerDied(
                    f"{self._label()}: ranks {stuck} did not form the process group within "
                    f"{POOL_START_TIMEOUT:g} s of being spawned\n" + self._logs(stuck)
                )
            sentinels = {w.process.sentinel: w for w in self.workers}
            for obj in wait([*waiting, *sentinels], remaining):
                if obj in waiting:
                    w = waiting.pop(obj)
                    try:
                        w.conn.recv()
                    except (EOFError, OSError):
                        waiting[w.conn] = w  # it died; its sentinel reports it
                elif obj in sentinels:
                    w = sentinels[obj]
                    w.process.join(0)
                    # Described before the kill below closes the process objects.
                    message = (
                        f"{self._label()}: rank {w.rank} (pid {w.pid}) {w.describe_exit()} while starting "
                        f"(importing torch and forming the {self.key.backend} group)\n" + self._logs([w.rank])
                    )
                    self.start_failed = True
                    self.kill()
                    raise WorkerDied(message)
        self.ready = True
        self.start_seconds = time.monotonic() - self.started_at

    def stop(self) -> None:
        """Ask every worker to exit, then make sure they have (killing what does not)."""
        self._join_launcher()
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.conn.send_bytes(_STOP)
        self._reap(grace=2.0)

    def kill(self) -> None:
        """Kill every worker at once (they may be blocked in a collective that will never complete)."""
        self._join_launcher()
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
        self._reap(grace=5.0)

    def _reap(self, grace: float) -> None:
        self._join_launcher()
        end = time.monotonic() + grace
        for w in self.workers:
            w.process.join(max(0.0, end - time.monotonic()))
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
                w.process.join(5.0)
            with contextlib.suppress(Exception):
                w.conn.close()
            with contextlib.suppress(Exception):
                w.check.close()
            with contextlib.suppress(Exception):
                w.process.close()
        self.closed = True
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if not self.closed]

    # -- one run -------------------------------------------------------------------------------------------
    def run(
        self, ref: _FnRef, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float, seed: int, target: str
    ) -> list[Any]:
        """Run on every worker. On any failure that leaves the pool unusable, the pool is closed: the
        caller replaces it (``self.closed`` tells)."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks in the message, not this frame
        self.wait_ready()
        run_id = next(self.run_ids)
        try:
            blob = pickle.dumps(
                _Command(run_id, ref, tuple(args), kwargs, seed, target), protocol=pickle.HIGHEST_PROTOCOL
            )
        except Exception as exc:
            raise InvalidArgument(
                f"the process world sends args and kwargs to its workers by pickle; those of "
                f"{ref.qualname} do not pickle ({type(exc).__name__}: {exc})"
            ) from exc
        W = self.key.world_size
        log_starts = {w.rank: _file_size(w.cfg.log_path) for w in self.workers}
        try:
            replies, dead, first_failure = self._exchange(run_id, blob, timeout)
        except BaseException:
            self.kill()  # interrupted (Ctrl-C) mid-run: only a fresh pool is in a known state
            raise
        for r in sorted(replies):
            _forward_output(r, replies[r].output)

        label = self._label()
        if dead:
            for d in dead:
                d.process.join(1.0)
            others = self._collect_quietly(replies)
            names = ", ".join(f"rank {d.rank} (pid {d.pid}) {d.describe_exit()}" for d in dead)
            outputs = "".join(
                f"---- output of rank {d.rank} during the run ----\n{d.output_since(log_starts[d.rank])}\n"
                for d in dead
            )
            failed = {r: rep.traceback for r, rep in others.items() if not rep.ok}
            detail = "".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(failed.items()))
            self.kill()
            raise WorkerDied(f"{label}: {names} while running {ref.qualname}; the pool was replaced\n{outputs}{detail}")
        missing = [w for w in self.workers if w.rank not in replies]
        if missing:
            stacks = self._stacks(missing)
            for w in missing:
                out = w.output_since(log_starts[w.rank])
                if out:
                    stacks[w.rank] = stacks.get(w.rank, "(no stack)\n") + f"-- output during the run --\n{out}"
            self.kill()
            if first_failure is None:
                raise WorldTimeout(
                    f"{label} ran {ref.qualname} past its timeout of {timeout:g} s; ranks still running: "
                    f"{[w.rank for w in missing]}; the pool was replaced\n" + _format_stacks(stacks),
                    stacks,
                )
            aborted = {
                w.rank: (
                    f"rank {w.rank} did not finish within {FAILURE_GRACE:g} s of the failure (blocked in a "
                    f"collective the failed rank never joined?) and was stopped; its stack:\n"
                    + stacks.get(w.rank, "(no stack)\n")
                )
                for w in missing
            }
            raise _rank_failure(label, W, replies, aborted, pool_replaced=True)

        unhealthy = {r: rep.unhealthy for r, rep in replies.items() if rep.unhealthy}
        if unhealthy:
            self.stop()  # the caller starts a fresh pool for the next run
        if any(not rep.ok for rep in replies.values()):
            raise _rank_failure(label, W, replies, {}, pool_replaced=bool(unhealthy))
        results = []
        for r in range(W):
            try:
                results.append(pickle.loads(replies[r].result or b""))
            except Exception as exc:
                raise RankFailure(
                    f"{label}: the result of rank {r} could not be unpickled in the parent "
                    f"({type(exc).__name__}: {exc})",
                    {r: traceback.format_exc()},
                    {r: exc},
                ) from exc
        self.last_used = time.monotonic()
        return results

    def _exchange(
        self, run_id: int, blob: bytes, timeout: float
    ) -> tuple[dict[int, _Reply], list[_Worker], float | None]:
        """Send the run to every worker and gather replies until all came, one died, the run timed out, or
        the others had FAILURE_GRACE seconds after a failure."""
        deadline = time.monotonic() + timeout
        replies: dict[int, _Reply] = {}
        dead: list[_Worker] = []
        first_failure: float | None = None
        for w in self.workers:
            try:
                w.conn.send_bytes(blob)
            except (EOFError, OSError):
                dead.append(w)
        by_conn = {w.conn: w for w in self.workers}
        referee = None
        checks: dict[Any, _Worker] = {}
        if self.key.backend == "gloo":  # its workers' groups post every call to this run's referee
            referee = _Referee(run_id, len(self.workers), [w.check for w in self.workers])
            checks = {w.check: w for w in self.workers}
        while len(replies) < len(self.workers) and not dead:
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            pending = [w for w in self.workers if w.rank not in replies]
            by_sentinel = {w.process.sentinel: w for w in pending}
            ready = wait([*(w.conn for w in pending), *checks, *by_sentinel], remaining)
            for obj in ready:
                checked = checks.get(obj)
                if checked is not None and referee is not None:
                    self._referee_messages(referee, checked)
            for obj in ready:
                w = by_conn.get(obj)  # type: ignore[call-overload]
                if w is None:
                    continue  # a sentinel or a check channel: handled elsewhere
                try:
                    reply: _Reply = pickle.loads(w.conn.recv_bytes())
                except (EOFError, OSError):
                    continue
                if reply.run_id != run_id:
                    continue  # cannot happen while pools are killed on interruption; never mix runs up
                replies[w.rank] = reply
                if not reply.ok and first_failure is None:
                    first_failure = time.monotonic()
            for obj in ready:
                gone = by_sentinel.get(obj)
                if gone is not None and gone.rank not in replies:
                    dead.append(gone)
        return replies, dead, first_failure

    @staticmethod
    def _referee_messages(referee: _Referee, w: _Worker) -> None:
        """Hand the referee everything worker ``w`` has posted so far."""
        try:
            while w.check.poll(0):
                referee.handle(w.rank, w.check.recv_bytes())
        except (EOFError, OSError):
            pass  # the worker died: its sentinel reports it

    def _collect_quietly(self, replies: dict[int, _Reply]) -> dict[int, _Reply]:
        """Replies that other ranks had already sent when one died (for the report)."""
        out = dict(replies)
        for w in self.workers:
            if w.rank in out:
                continue
            with contextlib.suppress(Exception):
                if w.conn.poll(0.2):
                    out[w.rank] = pickle.loads(w.conn.recv_bytes())
        return out

    def _stacks(self, workers: list[_Worker]) -> dict[int, str]:
        """Every listed worker's Python stacks, dumped by faulthandler on SIGUSR1."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        sizes = {}
        for w in workers:
            sizes[w.rank] = _file_size(w.cfg.stack_path)
            with contextlib.suppress(OSError):
                os.kill(w.pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_WAIT_S
        stacks: dict[int, str] = {}
        last: dict[int, int] = {}
        while time.monotonic() < end and len(stacks) < len(workers):
            time.sleep(0.05)
            for w in workers:
                if w.rank in stacks:
                    continue
                size = _file_size(w.cfg.stack_path)
                if size > sizes[w.rank] and last.get(w.rank) == size:  # grew, then stayed put: dump done
                    with open(w.cfg.stack_path, "rb") as f:
                        f.seek(sizes[w.rank])
                        stacks[w.rank] = _without_watcher(f.read().decode(errors="replace"))
                last[w.rank] = size
        return stacks

    def _label(self) -> str:
        return f"{self.world_name} world of {self.key.world_size} ranks ({self.key.backend})"

    def _logs(self, ranks: list[int]) -> str:
        return "".join(f"---- output of rank {r} ----\n{self.workers[r].log_tail()}\n" for r in ranks)


def _rank_failure(
    label: str, world_size: int, replies: dict[int, _Reply], aborted: dict[int, str], *, pool_replaced: bool
) -> RankFailure:
    failed = {r: rep for r, rep in replies.items() if not rep.ok}
    exceptions: dict[int, BaseException] = {}
    for r, rep in failed.items():
        exceptions[r] = _unpickle_exception(rep)
    for r, text in aborted.items():
        exceptions[r] = WorldAborted(text.splitlines()[0])
    # The first real error first: ranks that were only aborted because of it come after it.
    order = sorted(failed, key=lambda r: (isinstance(exceptions[r], WorldAborted), r))
    head = "; ".join(f"rank {r}: {type(exceptions[r]).__name__}: {exceptions[r]}".splitlines()[0] for r in order)
    body = "\n".join(f"---- rank {r} ----\n{failed[r].traceback}" for r in order)
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{text}" for r, text in sorted(aborted.items()))
    if pool_replaced:
        tail += "\nthe worker pool was replaced"
    tracebacks = {r: rep.traceback for r, rep in failed.items()} | aborted
    return RankFailure(
        f"{len(failed)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )


def _unpickle_exception(rep: _Reply) -> BaseException:
    if rep.exception is not None:
        try:
            exc = pickle.loads(rep.exception)
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            return exc
        if isinstance(exc, tuple) and len(exc) == 3 and exc[0] == "pytest-outcome":
            from _pytest import outcomes

            cls = getattr(outcomes, exc[1])
            outcome: BaseException = cls(exc[2]) if exc[1] != "Exit" else cls(exc[2], 1)
            return outcome
    last = rep.traceback.strip().splitlines()[-1] if rep.traceback.strip() else "unknown error"
    return RemoteRankError(last)


def _forward_output(rank: int, text: str) -> None:
    """What a rank printed, to this process's stdout (pytest captures it per test, as in the threaded world)."""
    if not text:
        return
    lines = text.splitlines()
    sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in lines))


def _without_watcher(dump: str) -> str:
    """A faulthandler dump without the worker's own parent-watch thread (noise in a report)."""
    blocks = dump.split("\n\n")
    return "\n\n".join(b for b in blocks if "in _watch_parent" not in b).strip() + "\n"


def _format_stacks(stacks: dict[int, str]) -> str:
    return "\n".join(f"---- rank {r} stack ----\n{s}" for r, s in sorted(stacks.items()))


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads_per_rank(world_size: int) -> int | None:
    """Intra-op threads per worker, as torchrun does: unless the user chose, share the cores, so that W
    processes do not each start one OpenMP thread per core and spin against each other."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


_PRELOAD = ["__main__", "torch", "torch.distributed", "dstest.context", "dstest.specification", "dstest.worlds.process"]
_CONTEXT: Any = None


def _mp_context() -> Any:
    """Where workers come from: a fork server that has imported torch once, else plain spawn.

    A spawned worker imports torch itself (seconds each, and W of them share the cores); a worker forked
    from the fork server starts in milliseconds with torch already imported, yet, like a spawned one,
    carries none of this process's state (the server never ran a test, never touched CUDA or OpenMP).
    """
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            # Takes effect when the server starts (here, unless some other code started it already).
            ctx.set_forkserver_preload(_PRELOAD)
            _CONTEXT = ctx
        else:
            _CONTEXT = multiprocessing.get_context("spawn")
    return _CONTEXT


# ------------------------------------------------------------------------------------------------------
# The pools of this process
# ------------------------------------------------------------------------------------------------------

# The pools are process-wide on purpose: keeping workers warm across World objects and tests is the whole
# point. They are reached only through _pool_for / shutdown_all, under _POOLS_LOCK.
_POOLS: dict[_PoolKey, _Pool] = {}
_POOLS_LOCK = threading.Lock()
_COLD: set[_Pool] = set()  # pools of cold runs in progress (stopped by shutdown_all too)
_ATEXIT_REGISTERED = False


def _pool_for(key: _PoolKey, world_name: str) -> _Pool:
    global _ATEXIT_REGISTERED
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            _evict_for(key.world_size)
            pool = _POOLS[key] = _Pool(key, world_name).start()
        if not _ATEXIT_REGISTERED:
            atexit.register(shutdown_all)
            _ATEXIT_REGISTERED = True
        pool.last_used = time.monotonic()
        return pool


def warm_worker_cap() -> int:
    """The most worker processes kept warm across runs (all pools together).

    ``max_warm_workers`` if set, else the ``DSTEST_PROCESS_MAX_WORKERS`` environment variable, else
    ``DEFAULT_MAX_WARM_WORKERS``. Pools are kept in least-recently-used order: starting a pool closes the
    idle pools used longest ago until the kept workers fit under the cap; a world larger than the cap
    runs cold (its workers start for the run and stop after it).
    """
    value: object = max_warm_workers
    source = "dstest.worlds.process.max_warm_workers"
    if value is None:
        raw = os.environ.get(MAX_WARM_WORKERS_ENV, "").strip()
        if not raw:
            return DEFAULT_MAX_WARM_WORKERS
        source = f"the environment variable {MAX_WARM_WORKERS_ENV}"
        try:
            value = int(raw)
        except ValueError:
            value = raw
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(
            f"{source}={value!r} must be an integer >= 0: the most worker processes the process world keeps "
            f"warm across runs (0 keeps none)"
        )
    return value


def _evict_for(extra: int) -> None:
    """Close least recently used idle pools so that at most ``warm_worker_cap()`` workers stay warm."""
    cap = warm_worker_cap()
    live = sorted((p for p in _POOLS.values() if not p.closed), key=lambda p: p.last_used)
    total = sum(p.key.world_size for p in live) + extra
    for pool in live:
        if total <= cap:
            break
        if pool.lock.acquire(blocking=False):
            try:
                pool.stop()
            finally:
                pool.lock.release()
            total -= pool.key.world_size


def _replace(pool: _Pool) -> None:
    """Start a fresh pool in place of a closed one, now, so that it warms up while other tests run."""
    with _POOLS_LOCK:
        if _POOLS.get(pool.key) is pool and not pool.start_failed:
            _POOLS[pool.key] = _Pool(pool.key, pool.world_name).start()


def shutdown_all() -> None:
    """Stop every worker of every pool of this process (the plugin calls it at session end; atexit too)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values()) + list(_COLD)
        _POOLS.clear()
        _COLD.clear()
    for pool in pools:  # ask all at once, then wait: a pool's workers exit in parallel with the others'
        for w in pool.workers:
            with contextlib.suppress(Exception):
                w.conn.send_bytes(_STOP)
    for pool in pools:
        if not pool.closed:
            pool._reap(grace=2.0)
    _stop_fork_server()


def _stop_fork_server() -> None:
    """Stop the fork server the pools used, so that it is not orphaned when this process exits.

    Killed rather than asked: asked, it finalizes torch on its way out, which takes seconds on a busy
    machine (long enough for pytest-xdist to interrupt its worker's shutdown). It holds no state.
    """
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT.get_start_method() != "forkserver":
        return
    _CONTEXT = None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # CPython's singleton; private, hence the care
    pid = getattr(server, "_forkserver_pid", None)
    stop = getattr(server, "_stop", None)
    if not isinstance(pid, int) or stop is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        stop()  # closes its pipe, reaps it, removes its socket


def _run_cold(
    key: _PoolKey,
    world_name: str,
    ref: _FnRef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    seed: int,
    target: str,
) -> list[Any]:
    """One run on a pool of its own that is stopped after it (a world larger than the warm cap)."""
    __tracebackhide__ = True
    pool = _Pool(key, world_name).start()
    with _POOLS_LOCK:
        _COLD.add(pool)
    try:
        with pool.lock:
            return pool.run(ref, args, kwargs, timeout, seed, target)
    finally:
        if not pool.closed:
            pool.stop()
        with _POOLS_LOCK:
            _COLD.discard(pool)


def pool_pids() -> dict[tuple[str, int], list[int]]:
    """The worker pids of every live pool, by (backend, world size); for tests that check no process leaks."""
    with _POOLS_LOCK:
        return {(k.backend, k.world_size): p.pids() for k, p in _POOLS.items() if not p.closed}


# ------------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------------


def _check_not_bootstrapping(what: str) -> None:
    """Refuse to start workers from a script's module level while multiprocessing re-imports that script.

    Workers come from a fork server (or are spawned) that imports the main script as ``__mp_main__`` so
    that its functions can be found by name. A script that calls the process world at module level,
    without an ``if __name__ == "__main__":`` guard, would start workers again from inside that import,
    and multiprocessing fails obscurely (in the parent: "process object is closed"). Say so instead.
    """
    fix = (
        f'Move the call (dstest.run(..., world="process") or ProcessWorld().{what}(...)) under '
        f'`if __name__ == "__main__":` and keep the rank functions at module level'
    )
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            path = frame.f_globals.get("__file__")
            if name == "__mp_main__":  # inside a worker's (or the fork server's) import of the script
                raise UnguardedMain(
                    f"the process world's {what}() was called at module level of {path} while "
                    f"multiprocessing was importing that script in a worker process (as __mp_main__, to find "
                    f'its functions by name): the call has no `if __name__ == "__main__":` guard, so every '
                    f"worker would start workers of its own. {fix}"
                )
            if name == "__main__" and path and _main_reimported() and not _under_main_guard(path, frame.f_lineno):
                raise UnguardedMain(
                    f"the process world's {what}() is called at module level of {path} (line "
                    f'{frame.f_lineno}) without an `if __name__ == "__main__":` guard: its worker processes '
                    f"import that script to find the rank functions by name, and would run the call again, "
                    f"each starting workers of its own. {fix}"
                )
        frame = frame.f_back


def _main_reimported() -> bool:
    """Whether multiprocessing re-imports this ``__main__`` in worker processes (as it decides it: a script
    run by path, or ``python -m module``; never a package's ``__main__``, e.g. ``python -m dstest``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return not (isinstance(name, str) and (name == "__main__" or name.endswith(".__main__")))


def _under_main_guard(path: str, lineno: int) -> bool:
    """Whether line ``lineno`` of the script ``path`` lies in the body of an ``if __name__ == "__main__":``
    statement at its top level (True when the source cannot be read: then nothing is refused)."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if not node.lineno <= lineno <= (node.end_lineno or node.lineno):
            continue
        if not isinstance(node, ast.If) or not _is_main_test(node.test):
            return False
        return any(b.lineno <= lineno <= (b.end_lineno or b.lineno) for b in node.body)
    return True


def _is_main_test(test: Any) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _reference(fn: Callable[..., Any]) -> _FnRef:
    """How workers will find ``fn``; raises InvalidArgument when they could not."""
    from dstest.specification import spec_info

    info = spec_info(fn)
    body = info.fn if info is not None else fn
    module_name = getattr(body, "__module__", None)
    qualname = getattr(body, "__qualname__", None)
    how = (
        "the process world sends functions to its worker processes by reference (module and name); "
        "define the function at module level"
    )
    if not module_name or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise InvalidArgument(f"fn={fn!r} cannot be found by name in another process: {how}")
    module = sys.modules.get(module_name)
    if module_name == "__main__" and not getattr(module, "__file__", None):
        raise InvalidArgument(f"fn={fn!r} lives in a __main__ without a file (python -c, a REPL): {how}")
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = None
    found = spec_info(obj).fn if spec_info(obj) is not None else obj  # type: ignore[union-attr]
    if module is not None and found is not body:
        # One body under several specs (``x = dstest.spec(...)(body)``): its name is the undecorated body,
        # the rank adapter lives in a spec wrapper under another module-level name.
        for name, value in vars(module).items():
            value_info = spec_info(value)
            if value_info is not None and value_info.fn is body:
                qualname, found = name, body
                break
    if module is None or found is not body:
        raise InvalidArgument(f"fn={fn!r} is not reachable as {module_name}.{qualname}: {how}")
    path = getattr(module, "__file__", None)
    return _FnRef(module_name, qualname, os.path.abspath(path) if path else None, "@py_builtins" in vars(module))


class ProcessWorld:
    """Runs a function on every rank as warm worker processes over a real backend (gloo on CPU by default).

    ``fn(ctx, *args, **kwargs)`` runs in worker ``ctx.rank`` with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set); ``run`` returns the
    per-rank results in rank order, or raises :class:`RankFailure` (every failing rank's traceback),
    :class:`WorldTimeout` (every running rank's stack) or :class:`WorkerDied`. ``fn`` must be a
    module-level function; args, kwargs and results must pickle. Groups a run creates are destroyed after
    it; the world group, imported modules and other process state persist across runs of the same pool.
    """

    def __init__(self, *, backend: str = "gloo", device: str = "cpu", name: str = "process") -> None:
        self.name = name
        self.backend = backend
        self.device = device

    @property
    def marker(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return "torch was built without torch.distributed"
        if self.backend == "gloo" and not dist.is_gloo_available():
            return "the process world needs gloo, which this torch build lacks"
        if self.backend == "nccl" and not dist.is_nccl_available():
            return "the nccl world needs NCCL, which this torch build lacks"
        return None

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = 60.0,
        seed: int = 0,
        target: str = "impl",
    ) -> list[Any]:
        check_run_arguments(world_size, timeout)
        __tracebackhide__ = True
        _check_not_bootstrapping("run")
        ref = _reference(fn)
        key = _PoolKey(self.backend, self.device, world_size)
        if world_size > warm_worker_cap():
            return _run_cold(key, self.name, ref, tuple(args), dict(kwargs or {}), timeout, seed, target)
        pool = _pool_for(key, self.name)
        with pool.lock:
            try:
                return pool.run(ref, tuple(args), dict(kwargs or {}), timeout, seed, target)
            finally:
                if pool.closed:
                    _replace(pool)

    def prestart(self, world_sizes: Sequence[int]) -> None:
        """Start the pools of these world sizes without waiting: they warm up while other work runs."""
        _check_not_bootstrapping("prestart")
        for ws in world_sizes:
            if ws > warm_worker_cap():
                continue  # runs cold
            _pool_for(_PoolKey(self.backend, self.device, ws), self.name)

    def warm(self, world_size: int) -> float:
        """Start (if needed) and wait for the pool of ``world_size`` ranks; returns its launch-to-ready seconds."""
        _check_not_bootstrapping("warm")
        key = _PoolKey(self.backend, self.device, world_size)
        if world_size > warm_worker_cap():  # nothing is kept: measure a cold start
            cold = _Pool(key, self.name).start()
            try:
                cold.wait_ready()
            finally:
                if not cold.closed:
                    cold.stop()
            return cold.start_seconds or 0.0
        pool = _pool_for(key, self.name)
        with pool.lock:
            try:
                pool.wait_ready()
            finally:
                if pool.closed:
                    _replace(pool)
        return pool.start_seconds or 0.0
