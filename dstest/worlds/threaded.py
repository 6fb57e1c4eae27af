"""The threaded world: N ranks as threads of this process, real data movement, dstest's own c10d backend.

Every collective call is matched across ranks by (group, sequence number). A call that cannot match the
first one that arrived raises at once on every rank involved; when every rank still running is waiting
and none of the waits can complete, the world reports the deadlock with each rank's pending call instead
of hanging. All rendezvous state lives on one ``_Session`` per run; nothing outlives it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dstest.context import RankContext
from dstest.errors import (
    CollectiveMismatch,
    InvalidArgument,
    RankFailure,
    WorldAborted,
    WorldTimeout,
)
from dstest.worlds import _collectives as C
from dstest.worlds import _compat
from dstest.worlds.protocol import check_run_arguments

__all__ = ["BACKEND_NAME", "ThreadedWorld"]

BACKEND_NAME = "dstest"
_THREAD_PREFIX = "dstest-rank"
_WARM_PREFIX = "dstest-warm-rank"
_binding = threading.local()  # .session and .rank of the rank running on this thread
_register_lock = threading.Lock()


def _register_backend() -> None:
    """Register the c10d backend once per process; idempotent, never an import side effect."""
    with _register_lock:
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=devices)


def _create_group(opts: Any, pg_options: Any) -> dist.ProcessGroup:
    session: _Session | None = getattr(_binding, "session", None)
    if session is None:
        raise RuntimeError(
            f"the {BACKEND_NAME!r} backend only works inside a dstest threaded world "
            "(dstest.ThreadedWorld().run(...) or a @dstest.spec)"
        )
    ranks = list(opts.global_ranks_in_group) or list(range(session.world_size))
    return _Group(session, opts.group_rank, opts.group_size, ranks, str(opts.group_id))


class _Waitable:
    """Something a rank can wait on: one side of a collective or of a point-to-point transfer."""

    def __init__(self, session: _Session, global_rank: int, where: str) -> None:
        self.session = session
        self.global_rank = global_rank
        self.where = where
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.futures: list[torch.futures.Future[Any]] = []
        self._finished = False
        self._finish_lock = threading.Lock()

    def describe(self) -> str:
        raise NotImplementedError

    def waiting_for(self) -> list[int]:
        """Global ranks whose action this wait needs."""
        raise NotImplementedError

    def outputs(self) -> list[torch.Tensor]:
        return []

    def _finish(self) -> None:
        pass

    def finish_once(self) -> None:
        with self._finish_lock:
            if not self._finished:
                self._finished = True
                self._finish()

    def complete(self, error: BaseException | None = None) -> None:
        """Mark done (by whichever thread completed it) and resolve futures handed out by get_future()."""
        self.error = self.error or error
        self.event.set()
        for fut in self.futures:
            self._resolve(fut)

    def _resolve(self, fut: torch.futures.Future[Any]) -> None:
        if self.error is not None:
            fut.set_exception(self.error)
            return
        try:
            self.finish_once()
        except Exception as exc:  # a copy that fails (device, dtype) surfaces through the future
            fut.set_exception(exc)
            return
        fut.set_result(self.outputs())


class _CollectiveWait(_Waitable):
    def __init__(self, session: _Session, global_rank: int, call: C.Call, exchange: _Exchange) -> None:
        super().__init__(session, global_rank, exchange.where)
        self.call = call
        self.exchange = exchange

    def describe(self) -> str:
        return f"{self.call.describe()} on {self.where}"

    def waiting_for(self) -> list[int]:
        return [g for g, c in zip(self.exchange.global_ranks, self.exchange.calls) if c is None]

    def outputs(self) -> list[torch.Tensor]:
        return self.call.outputs()

    def _finish(self) -> None:
        sources = self.exchange.sources
        assert sources is not None
        self.call.finish(sources[self.call.group_rank])


class _Exchange:
    """All ranks' sides of one collective on one group."""

    def __init__(self, group: _Group, seq: int) -> None:
        self.global_ranks = group.global_ranks
        self.where = f"group {group.label} (seq {seq})"
        self.calls: list[C.Call | None] = [None] * group.size_
        self.missing = group.size_
        self.waits: list[_CollectiveWait] = []
        self.first: C.Call | None = None
        self.sources: list[Any] | None = None
        self.error: BaseException | None = None


class _P2PWait(_Waitable):
    def __init__(
        self, session: _Session, global_rank: int, kind: str, tensor: torch.Tensor, peer: int, where: str, tag: int
    ) -> None:
        super().__init__(session, global_rank, where)
        self.kind = kind
        self.tensor = tensor
        self.peer = peer
        self.tag = tag

    def describe(self) -> str:
        arrow = "to" if self.kind == "send" else "from"
        return f"{self.kind}({C.describe_tensor(self.tensor)} {arrow} rank {self.peer}, tag={self.tag}) on {self.where}"

    def waiting_for(self) -> list[int]:
        return [self.peer]

    def outputs(self) -> list[torch.Tensor]:
        return [self.tensor]


class _Session:
    """Rendezvous state, abort flag and bookkeeping of one world run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.store = torch._C._distributed_c10d.HashStore()
        self.exchanges: dict[tuple[Any, ...], _Exchange] = {}
        self.p2p: dict[tuple[Any, ...], tuple[deque[_P2PWait], deque[_P2PWait]]] = {}
        self.pending: dict[int, _Waitable] = {}  # global rank -> what it is blocked on
        self.done: set[int] = set()
        self.aborted: BaseException | None = None

    def reset(self) -> None:
        """Start a new run on a warm session (called while no rank is inside a run)."""
        with self.lock:
            self.done.clear()
            self.pending.clear()
            self.aborted = None

    def leftovers(self) -> bool:
        """Whether a run left a collective or a transfer half done (then the session cannot be reused)."""
        with self.lock:
            return bool(self.exchanges) or any(s or r for s, r in self.p2p.values())

    # -- collectives ---------------------------------------------------------------------------------
    def arrive(self, group: _Group, call: C.Call) -> _CollectiveWait:
        call.check_local()
        seq = group.next_seq()
        key = (group.key, seq)
        with self.lock:
            self._check_alive()
            ex = self.exchanges.get(key)
            if ex is None:
                ex = self.exchanges[key] = _Exchange(group, seq)
            wait = _CollectiveWait(self, group.global_ranks[call.group_rank], call, ex)
            if ex.error is not None:
                raise _copy_error(ex.error)
            if ex.first is None:
                ex.first = call
            else:
                why = call.check_peer(ex.first)
                if why is not None:
                    first_rank = ex.global_ranks[ex.first.group_rank]
                    err = C.mismatch(
                        f"collective mismatch on {ex.where}", first_rank, ex.first, wait.global_rank, call, why
                    )
                    self._fail_exchange(ex, err)
                    raise _copy_error(err)
            ex.calls[call.group_rank] = call
            ex.missing -= 1
            ex.waits.append(wait)
            if ex.missing:
                return wait
            del self.exchanges[key]
        self._complete(ex)
        return wait

    def _complete(self, ex: _Exchange) -> None:
        calls = [c for c in ex.calls if c is not None]
        first = calls[0]
        error: BaseException | None = None
        try:
            why = first.check_all(calls)
            if why is not None:
                error = CollectiveMismatch(
                    f"collective mismatch on {ex.where}: {why}; calls: "
                    + "; ".join(f"rank {g} called {c.describe()}" for g, c in zip(ex.global_ranks, calls))
                )
            else:
                ex.sources = first.combine(calls)
        except Exception as exc:
            error = exc
        with self.lock:
            ex.error = error
            for w in ex.waits:
                w.complete(error)

    def _fail_exchange(self, ex: _Exchange, err: BaseException) -> None:
        ex.error = err
        for w in ex.waits:
            w.complete(err)

    # -- point to point --------------------------------------------------------------------------------
    def post_p2p(self, group: _Group, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> _P2PWait:
        if not 0 <= peer < group.size_:
            raise InvalidArgument(f"{kind}: peer rank {peer} is not in {group.label} (size {group.size_})")
        me = group.rank_
        src, dst = (me, peer) if kind == "send" else (peer, me)
        where = f"group {group.label}"
        wait = _P2PWait(self, group.global_ranks[me], kind, tensor, group.global_ranks[peer], where, tag)
        with self.lock:
            self._check_alive()
            sends, recvs = self.p2p.setdefault((group.key, src, dst, tag), (deque(), deque()))
            mine, theirs = (sends, recvs) if kind == "send" else (recvs, sends)
            if not theirs:
                mine.append(wait)
                return wait
            other = theirs.popleft()
        send, recv = (wait, other) if kind == "send" else (other, wait)
        error: BaseException | None = None
        if C._sig(send.tensor) != C._sig(recv.tensor):
            error = CollectiveMismatch(
                f"point-to-point mismatch on {where}: rank {send.global_rank} called {send.describe()} but "
                f"rank {recv.global_rank} called {recv.describe()}"
            )
        else:
            recv.tensor.copy_(send.tensor)
        with self.lock:
            send.complete(error)
            recv.complete(error)
        return wait

    # -- waiting, deadlocks, abort -------------------------------------------------------------------
    def wait(self, waitable: _Waitable) -> None:
        rank = waitable.global_rank
        if not waitable.event.is_set():
            with self.lock:
                self._check_alive()
                self.pending[rank] = waitable
                self._detect_deadlock()
            waitable.event.wait()
            with self.lock:
                self.pending.pop(rank, None)
        if waitable.error is not None:
            raise _copy_error(waitable.error)
        waitable.finish_once()

    def rank_done(self, rank: int) -> None:
        with self.lock:
            self.done.add(rank)
            self._detect_deadlock()

    def _detect_deadlock(self) -> None:
        """Called under the lock: fail every wait when no running rank is left to complete any of them."""
        if self.aborted is not None or not self.pending:
            return
        if len(self.pending) + len(self.done) < self.world_size:
            return  # someone is still running and may yet arrive
        if any(w.event.is_set() for w in self.pending.values()):
            return
        lines = []
        for rank in sorted(self.pending):
            w = self.pending[rank]
            needs = ", ".join(
                f"rank {r} ({'finished its function' if r in self.done else 'waiting in ' + self.pending[r].describe() if r in self.pending else 'running'})"
                for r in w.waiting_for()
            )
            lines.append(f"  rank {rank} waits in {w.describe()} for {needs}")
        err = CollectiveMismatch(
            "deadlock: every rank still running waits for a collective that cannot complete "
            "(mismatched collectives, groups or peers):\n" + "\n".join(lines)
        )
        for w in list(self.pending.values()):
            w.complete(err)

    def _check_alive(self) -> None:
        if self.aborted is not None:
            raise WorldAborted(str(self.aborted))

    def abort(self, reason: BaseException) -> None:
        """Fail every pending wait so that every rank unwinds (E3)."""
        with self.lock:
            if self.aborted is not None:
                return
            self.aborted = reason
            waits: list[_Waitable] = [w for ex in self.exchanges.values() for w in ex.waits]
            for sends, recvs in self.p2p.values():
                waits.extend(sends)
                waits.extend(recvs)
            waits.extend(self.pending.values())
            for w in waits:
                if not w.event.is_set():
                    w.complete(WorldAborted(str(reason)))


def _copy_error(err: BaseException) -> BaseException:
    """A fresh instance per raising rank: one exception object raised in several threads shares __traceback__."""
    try:
        return type(err)(*err.args)
    except Exception:
        return err


class _Work(dist._Work):  # type: ignore[misc, name-defined]
    """The handle a collective returns; ``wait()`` joins the rendezvous and copies this rank's result."""

    def __init__(self, waitable: _Waitable) -> None:
        super().__init__()
        self._waitable = waitable

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._waitable.session.wait(self._waitable)
        return True

    def is_completed(self) -> bool:
        return self._waitable.event.is_set()

    def is_success(self) -> bool:
        return self._waitable.event.is_set() and self._waitable.error is None

    def exception(self) -> BaseException | None:
        return self._waitable.error

    def result(self) -> list[torch.Tensor]:
        return self._waitable.outputs()

    def source_rank(self) -> int:
        w = self._waitable
        return w.peer if isinstance(w, _P2PWait) else -1

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        w = self._waitable
        with w.session.lock:
            if not w.event.is_set():
                w.futures.append(fut)
                return fut
        w._resolve(fut)
        return fut


class _Group(dist.ProcessGroup):
    """One rank's handle on one group of a threaded world; every method forwards to the session."""

    def __init__(self, session: _Session, rank: int, size: int, global_ranks: list[int], name: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload has no stub
        self.session = session
        self.rank_ = rank
        self.size_ = size
        self.global_ranks = global_ranks
        self.key = (name, tuple(global_ranks))
        self.label = "world" if len(global_ranks) == session.world_size and name == "0" else f"{name} {global_ranks}"
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _get_backend(self, device: Any) -> _Group:  # type: ignore[override]
        """The group is its own backend for every device; it has no ``supports_coalescing``, so
        batch_isend_irecv posts each transfer on its own (torch 2.14 asks; our groups register no
        C++ backend, and the default answer is "No backend type associated with device type cpu")."""
        return self

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _post(self, call: C.Call) -> _Work:
        return _Work(self.session.arrive(self, call))

    def _reduce_op(self, opts: Any) -> str:
        return _compat.reduce_op_name(opts.reduceOp)

    # -- collectives (signatures as c10d calls them) -----------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:  # type: ignore[override]
        op = self._reduce_op(opts) if opts is not None else "sum"
        t = C._one(tensors, "all_reduce")
        return self._post(C.AllReduce(self.rank_, self.size_, t, op))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = self._reduce_op(opts) if opts is not None else "sum"
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        work = self._post(C.AllReduce(self.rank_, self.size_, flat, op))
        work.wait()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return _Work(_Done(self.session, self.global_ranks[self.rank_], tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:  # type: ignore[override]
        t = C._one(tensors, "broadcast")
        return self._post(C.Broadcast(self.rank_, self.size_, t, int(opts.rootRank)))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:  # type: ignore[override]
        t = C._one(tensors, "reduce")
        return self._post(C.Reduce(self.rank_, self.size_, t, self._reduce_op(opts), int(opts.rootRank)))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Work:  # type: ignore[override]
        t = C._one(inputs, "all_gather")
        return self._post(C.AllGather(self.rank_, self.size_, outputs[0], t))

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Work:
        return self._post(C.AllGatherIntoTensor(self.rank_, self.size_, output, inp))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> _Work:  # type: ignore[override]
        out = C._one(outputs, "reduce_scatter")
        return self._post(C.ReduceScatter(self.rank_, self.size_, out, inputs[0], self._reduce_op(opts)))

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Work:
        return self._post(C.ReduceScatterTensor(self.rank_, self.size_, output, inp, self._reduce_op(opts)))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._post(C.AllToAll(self.rank_, self.size_, outputs, inputs))

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Work:
        return self._post(C.AllToAllSingle(self.rank_, self.size_, output, inp, output_split_sizes, input_split_sizes))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:  # type: ignore[override]
        t = C._one(inputs, "gather")
        outs = outputs[0] if outputs else []
        return self._post(C.Gather(self.rank_, self.size_, outs, t, int(opts.rootRank)))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> _Work:  # type: ignore[override]
        out = C._one(outputs, "scatter")
        ins = inputs[0] if inputs else []
        return self._post(C.Scatter(self.rank_, self.size_, out, ins, int(opts.rootRank)))

    # torch renamed the single-tensor entry points (2.13 calls these; older releases the _base names).
    all_gather_single = _allgather_base  # type: ignore[assignment]
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def _coalesced(self, posts: list[_Work], tensors: list[torch.Tensor]) -> _Work:
        """Coalesced forms run as consecutive collectives on the group, in list order, on every rank."""
        for work in posts:
            work.wait()
        return _Work(_Done(self.session, self.global_ranks[self.rank_], tensors))

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self._coalesced([self._allgather_base(o, i) for o, i in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> _Work:
        return self._coalesced([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> _Work:
        return self._post(C.Barrier(self.rank_, self.size_))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        t = C._one(tensors, "send")
        return _Work(self.session.post_p2p(self, "send", t, int(dst), int(tag)))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        t = C._one(tensors, "recv")
        return _Work(self.session.post_p2p(self, "recv", t, int(src), int(tag)))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise InvalidArgument("recv without src (any source) is not supported by the threaded world; pass src")

    def shutdown(self) -> None:
        pass


class _Done(_Waitable):
    def __init__(self, session: _Session, rank: int, tensors: list[torch.Tensor]) -> None:
        super().__init__(session, rank, "")
        self._tensors = tensors
        self.event.set()

    def describe(self) -> str:
        return "completed"

    def waiting_for(self) -> list[int]:
        return []

    def outputs(self) -> list[torch.Tensor]:
        return self._tensors


def _async_raise(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise ``exc`` inside a rank thread stuck in Python code (the only way to stop a hung thread)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


def _call_rank(
    session: _Session,
    rank: int,
    fn: Callable[..., Any],
    ctx: RankContext,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    outcome: _Outcome,
) -> None:
    """Run the spec body on one rank, recording its result or failure; a failure aborts the world."""
    token = ctx.bind()
    try:
        outcome.results[rank] = fn(ctx, *args, **kwargs)
    except BaseException as exc:  # every rank's outcome is reported, so catch all
        outcome.fail(rank, exc)
        if not isinstance(exc, WorldAborted):
            session.abort(exc)
    finally:
        RankContext.unbind(token)
        session.rank_done(rank)


class _Outcome:
    """Per-run results and failures of every rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.results: list[Any] = [None] * world_size
        self.failures: dict[int, BaseException] = {}
        self.tracebacks: dict[int, str] = {}

    def fail(self, rank: int, exc: BaseException) -> None:
        self.failures[rank] = exc
        self.tracebacks[rank] = "".join(traceback.format_exception(exc))

    def raise_failures(self) -> None:
        failures, tracebacks = self.failures, self.tracebacks
        if not failures:
            return
        primary = {r: e for r, e in failures.items() if not isinstance(e, WorldAborted)}
        shown = primary or failures
        head = "; ".join(f"rank {r}: {type(e).__name__}: {e}".splitlines()[0] for r, e in sorted(shown.items()))
        body = "\n".join(f"---- rank {r} ----\n{tracebacks[r]}" for r in sorted(shown))
        aborted = sorted(set(failures) - set(primary))
        tail = f"\nranks {aborted} were aborted because of the failure above" if aborted and primary else ""
        raise RankFailure(
            f"{len(shown)} of {self.world_size} ranks failed: {head}\n{body}{tail}",
            {r: tracebacks[r] for r in sorted(failures)},
            {r: failures[r] for r in sorted(failures)},
        )


def _timeout_error(threads: list[threading.Thread], world_size: int, timeout: float, hung: list[int]) -> WorldTimeout:
    stacks = _stacks(threads)
    return WorldTimeout(
        f"world of {world_size} ranks ran past its timeout of {timeout:g} s; "
        f"ranks still running: {hung}\n" + _format_stacks(stacks),
        stacks,
    )


def _reap(threads: list[threading.Thread], grace: float) -> list[str]:
    """After an abort: give woken ranks ``grace`` seconds, then interrupt ranks stuck in Python code.

    Returns the names of threads that could not be stopped (stuck in C code).
    """
    end = time.monotonic() + grace
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    for _ in range(50):
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            break
        for t in alive:
            _async_raise(t, WorldAborted)
        for t in alive:
            t.join(0.1)
    return [t.name for t in threads if t.is_alive()]


@contextlib.contextmanager
def _rank_process_group(
    c10d_world: Any, session: _Session, rank: int, device: torch.device, timeout: timedelta
) -> Iterator[None]:
    """On a rank thread: its own c10d state and default group for the block, both gone afterwards."""
    c10d_world.bind()
    _binding.session, _binding.rank = session, rank
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        _compat.init_rank_process_group(
            backend=BACKEND_NAME, rank=rank, world_size=session.world_size, store=session.store, timeout=timeout
        )
        yield
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            _binding.__dict__.clear()
            c10d_world.unbind()


class _Countdown:
    """Ranks report once each; the last report wakes the one waiter (the caller of ``run``) once."""

    def __init__(self, world_size: int) -> None:
        self.lock = threading.Lock()
        self.left = set(range(world_size))
        self.errors: dict[int, BaseException] = {}
        self.all_done = threading.Event()

    def done(self, rank: int, exc: BaseException | None = None) -> None:
        with self.lock:
            self.left.discard(rank)
            if exc is not None:
                self.errors[rank] = exc
            if not self.left:
                self.all_done.set()


class _WarmCrew:
    """Rank threads with their default process group already formed, serving one run after another.

    A run that succeeds leaves the crew ready (groups it created destroyed, grad mode restored); a run
    that fails, times out or leaves a transfer unmatched retires the crew, so nothing of it survives.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.session = _Session(world_size)
        self.busy = threading.Lock()
        self.broken = False  # a run left a rank without its default group: the crew cannot serve again
        self._install = _compat.thread_local_c10d_world()
        self._c10d = self._install.__enter__()
        self._tasks: list[queue.SimpleQueue[Callable[[int], None] | None]] = [
            queue.SimpleQueue() for _ in range(world_size)
        ]
        self._phase = _Countdown(world_size)  # the start, then each run
        self.threads = [
            threading.Thread(target=self._main, args=(r,), name=f"{_WARM_PREFIX}{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in self.threads:
            t.start()
        self._phase.all_done.wait()
        if self._phase.errors:
            self.close()
            raise next(iter(self._phase.errors.values()))

    def _main(self, rank: int) -> None:
        try:
            with _rank_process_group(self._c10d, self.session, rank, self.device, timedelta(days=1)):
                self._phase.done(rank)
                while (task := self._tasks[rank].get()) is not None:
                    task(rank)
                    if not dist.is_initialized():  # the run destroyed the default group itself
                        self.broken = True
                        self._phase.done(rank)
                        return
                    self._reset_rank()
                    self._phase.done(rank)
        except BaseException as exc:
            self._phase.done(rank, exc)

    def _reset_rank(self) -> None:
        """Undo what a run leaves on its rank thread: subgroups, grad mode."""
        state = c10d_state()
        for pg in [pg for pg in list(state.pg_map) if pg is not state.default_pg]:
            # Our groups are Python ProcessGroups whose C++ name torch 2.13 never sets, so
            # dist.destroy_process_group(pg) fails on pg.group_name; the state is ours, drop it here.
            name = state.pg_names.get(pg)
            for table in (state.pg_map, state.pg_names, state.pg_group_ranks, state.pg_backend_config, state.pg_to_tag):
                table.pop(pg, None)
            for pgs in state.tags_to_pg.values():
                while pg in pgs:
                    pgs.remove(pg)
            if name is not None:
                with contextlib.suppress(RuntimeError, KeyError):
                    torch._C._distributed_c10d._unregister_process_group(name)
        torch.set_grad_enabled(True)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float,
        make_ctx: Callable[[int], RankContext],
    ) -> list[Any]:
        session = self.session
        session.reset()
        outcome = _Outcome(self.world_size)

        def task(rank: int) -> None:
            _call_rank(session, rank, fn, make_ctx(rank), args, kwargs, outcome)

        phase = self._phase = _Countdown(self.world_size)
        for q in self._tasks:
            q.put(task)
        if not phase.all_done.wait(timeout):
            with phase.lock:
                hung = sorted(phase.left)
            err = _timeout_error(self.threads, self.world_size, timeout, hung)
            session.abort(err)
            self.close()
            raise err
        for rank, exc in phase.errors.items():  # a rank's loop itself broke: retire the crew
            outcome.fail(rank, exc)
        if outcome.failures or session.leftovers() or self.broken:
            self.close()
        outcome.raise_failures()
        return outcome.results

    def close(self, grace: float = 2.0) -> None:
        for q in self._tasks:
            q.put(None)
        _reap(self.threads, grace)
        self._install.__exit__(None, None, None)


class _Crews:
    """The warm crews of this process, one per (device, world size); stopped by :func:`shutdown_all`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.crews: dict[tuple[str, int], _WarmCrew] = {}

    def checkout(self, device: torch.device, world_size: int) -> _WarmCrew | None:
        """A crew that is free for one run (its ``busy`` lock held), or None when it is in use."""
        key = (str(device), world_size)
        with self.lock:
            crew = self.crews.get(key)
            if crew is None or not crew.threads[0].is_alive():
                crew = self.crews[key] = _WarmCrew(world_size, device)
        return crew if crew.busy.acquire(blocking=False) else None

    def retire(self, crew: _WarmCrew) -> None:
        with self.lock:
            for key, known in list(self.crews.items()):
                if known is crew:
                    del self.crews[key]

    def shutdown(self) -> None:
        with self.lock:
            crews, self.crews = list(self.crews.values()), {}
        for crew in crews:
            crew.close()


_CREWS = _Crews()


def shutdown_all() -> None:
    """Stop every warm crew of this process (the plugin calls this when the test session ends)."""
    _CREWS.shutdown()


atexit.register(shutdown_all)


def c10d_state() -> Any:
    """This rank thread's own c10d state (the thread-local world)."""
    return dist.distributed_c10d._world


class ThreadedWorld:
    """Runs a function on every rank, as threads, with a real c10d process group per rank.

    ``fn(ctx, *args, **kwargs)`` runs on every rank with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``); ``run`` returns the per-rank results in rank order, or raises one
    :class:`RankFailure` carrying every failing rank's traceback, or :class:`WorldTimeout` with every
    rank's stack. ``device="cuda"`` runs the same ranks with CUDA tensors (``ctx.device``).

    ``warm=True`` keeps the rank threads and their default group between runs (a run costs a rendezvous,
    not a world's start-up); a failing run retires them, and :func:`shutdown_all` stops the rest.
    With ``warm=False`` every run starts and ends its own threads.
    """

    name = "threaded"

    def __init__(self, device: str = "cpu", *, grace: float = 2.0, warm: bool = False) -> None:
        self.device = device
        self.grace = grace
        self.warm = warm

    @property
    def marker(self) -> str:
        return "gpu" if self.device.startswith("cuda") else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            return "threaded world on cuda needs a CUDA device; none is available"
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
        _register_backend()
        device = torch.device(self.device)

        def make_ctx(rank: int) -> RankContext:
            return RankContext(
                rank=rank, world_size=world_size, world=self.name, device=device, seed=seed, target_name=target
            )

        crew = _CREWS.checkout(device, world_size) if self.warm else None
        if crew is not None:
            try:
                return crew.run(fn, args, kwargs or {}, timeout, make_ctx)
            finally:
                crew.busy.release()
                if crew.broken or not crew.threads[0].is_alive() or crew.session.aborted is not None:
                    _CREWS.retire(crew)
        return self._run_cold(fn, world_size, args, kwargs or {}, timeout, make_ctx, device)

    def _run_cold(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float,
        make_ctx: Callable[[int], RankContext],
        device: torch.device,
    ) -> list[Any]:
        session = _Session(world_size)
        outcome = _Outcome(world_size)
        with _compat.thread_local_c10d_world() as c10d_world:

            def rank_main(rank: int) -> None:
                try:
                    with _rank_process_group(c10d_world, session, rank, device, timedelta(seconds=timeout)):
                        _call_rank(session, rank, fn, make_ctx(rank), args, kwargs, outcome)
                except BaseException as exc:  # init failed, or an abort landed outside the body
                    outcome.fail(rank, exc)
                    session.abort(exc)
                    session.rank_done(rank)

            threads = [
                threading.Thread(target=rank_main, args=(r,), name=f"{_THREAD_PREFIX}{r}", daemon=True)
                for r in range(world_size)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                err = _timeout_error(threads, world_size, timeout, hung)
                session.abort(err)
                left = _reap(threads, self.grace)
                if left:
                    err.args = (err.args[0] + f"\nthreads that could not be stopped: {left}",)
                raise err
        outcome.raise_failures()
        return outcome.results


def _stacks(threads: list[threading.Thread]) -> dict[int, str]:
    # CPython 3.11 (gh-106883): a garbage collection triggered inside sys._current_frames() while it holds
    # the runtime's thread-list lock can finalize a threading.local, which takes that lock again: the
    # process hangs. Keep the collector off for the call.
    enabled = gc.isenabled()
    gc.disable()
    try:
        frames = sys._current_frames()
    finally:
        if enabled:
            gc.enable()
    out = {}
    for rank, t in enumerate(threads):
        frame = frames.get(t.ident) if t.ident is not None else None
        if frame is not None:
            out[rank] = "".join(traceback.format_stack(frame))
    return out


def _format_stacks(stacks: dict[int, str]) -> str:
    return "\n".join(f"---- rank {r} stack ----\n{s}" for r, s in sorted(stacks.items()))
