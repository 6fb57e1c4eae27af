"""The checked gloo group of the process world (``CheckedGroup``) and its work handles.

torch-internal (through :mod:`dstest.worlds.torch_internals`): subclasses torch's work handle base
(``WorkBase``) and ``dist.ProcessGroup`` and registers gloo as the group's C++ backend. This module imports
torch, so :mod:`dstest.worlds.process.checked` imports it only when the class is first needed, in a worker (the
parent never does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dstest.errors import InvalidArgument
from dstest.worlds import collectives as C
from dstest.worlds import torch_internals
from dstest.worlds.core import c10d, matching
from dstest.worlds.core.faults import Delay, Fail, Fault, Kill, failed_text
from dstest.worlds.process.checker import Checker, check_error
from dstest.worlds.process.messages import Dev, Meta
from dstest.worlds.process.posted import PostedCall
from dstest.worlds.torch_internals.dispatched import DispatchedGroup, DispatchedWork

__all__ = ["CheckedGroup", "CheckedWork", "DoneWork"]


class CheckedWork(DispatchedWork):
    """The handle of a checked call: waits for the verdict, then for the gloo work issued on it."""

    def __init__(self, checker: Checker, rec: PostedCall) -> None:
        super().__init__()
        self._checker = checker
        self._rec = rec

    def wait(self, timeout: Any = None) -> bool:
        rec = self._rec
        try:
            self._checker.wait_verdict(rec)
            if rec.inner is None:
                return True
            return bool(rec.inner.wait() if timeout is None else rec.inner.wait(timeout))
        finally:
            if rec.record is not None:
                rec.record.waited()

    def is_completed(self) -> bool:
        rec = self._rec
        done = rec.event.is_set() and (rec.inner is None or bool(rec.inner.is_completed()))
        if done:
            rec.waited = True
        return done

    def exception(self) -> BaseException | None:
        rec = self._rec
        if rec.error is not None:
            return check_error(*rec.error)
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
        fut, handed_out = torch_internals.linked_future()  # failed in C++ too when the call fails (DDP's reducer)

        def resolve(now: bool = False) -> None:
            if rec.error is not None:
                fut.set_exception(check_error(*rec.error))
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

                try:
                    inner_fut = rec.inner.get_future()
                except Exception as exc:  # gloo's reduce-scatter work has no future ("not implemented")
                    if now:
                        raise  # from get_future(), as gloo raises it
                    fut.set_exception(exc)  # issued after get_future(): the waiter gets the error
                    return
                inner_fut.add_done_callback(forward)

        with self._checker.lock:
            if not rec.event.is_set():
                rec.callbacks.append(resolve)
                return handed_out
        resolve(now=True)
        return handed_out


class DoneWork(DispatchedWork):
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


def _as_caller(issue: Callable[[], Any]) -> Callable[[], Any]:
    """``issue``, to run on the checker's listener thread in the autograd mode of the thread that calls now.

    gloo runs its work under the calling thread's thread-local state (grad mode, inference mode), and its
    C++ copies into outputs go through autograd: under ``no_grad`` a split view of a parameter takes an
    all-gather's result, with grad mode on autograd refuses it. The listener thread that issues a matched
    call has grad mode on, so without this gloo failed correct code there (DeepSpeed's bf16 optimizer
    all-gathering a partition into its flat group, issue 40). What gloo does later in the waiting thread
    (its ``reduce_scatter_tensor`` copies its result inside ``wait()``) stays in that thread's mode."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def as_caller() -> Any:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return issue()

    return as_caller


class _Metas(torch_internals.OptionsReader):
    """The process world hands a ``Call`` its tensors' metadata (what the referee compares; it pickles in
    microseconds), see :class:`dstest.worlds.core.c10d.Buffers`."""

    @staticmethod
    def tensor(t: Any) -> Meta:
        return Meta.of(t)

    @staticmethod
    def one(tensors: Sequence[Any], what: str) -> Meta:
        return Meta.of(c10d.one_tensor(tensors, what))

    @staticmethod
    def each(tensors: Sequence[Any]) -> list[Meta]:
        return [Meta.of(t) for t in tensors]

    @staticmethod
    def flat(tensors: Sequence[Any]) -> Meta:
        dtype = tensors[0].dtype if tensors else torch.float32
        return Meta(dtype, (sum(t.numel() for t in tensors),), Dev("cpu"))


_METAS = _Metas()


@c10d.install
class CheckedGroup(DispatchedGroup):
    """One rank's handle on one group of a gloo pool: every call is checked across ranks, then gloo runs it.

    Between runs (the pool's own warm-up) calls go straight to gloo. The c10d methods (``allreduce``,
    ``_allgather_base``, ``send``...) are made from the checking core's table (:mod:`dstest.worlds.core.c10d`),
    as the threaded world's groups are: each builds the same ``Call``, of its tensors' metadata, and
    :meth:`_issue_c10d` posts it to the referee, then issues the same method to gloo once every rank matched
    it. Every call passes through torch's dispatcher first, as on gloo (:mod:`.torch_internals.dispatched`).
    """

    backend_name = "gloo"

    def __init__(self, inner: Any, rank: int, size: int, members: tuple[int, ...], gid: str, checker: Checker) -> None:
        super().__init__(rank, size)
        self.inner = inner
        self.rank_ = rank
        self.size_ = size
        self.members = members
        self.gid = gid
        self.checker = checker
        self.seq = 0
        self.seq_run = 0  # the run the sequence numbers count in (the world group outlives runs)
        self.label = matching.group_label(gid, members, checker.world_size)
        # The check board keys a group by its name and how many groups of that name this rank made before:
        # a world made again in a run (a test's init_process_group after the pool's) reuses the names, and
        # its calls must not match the earlier group's entries of the same sequence numbers.
        self.board_key = checker.board_key(gid)
        # C++ code that asks the group for its gloo backend by type (DDP's logger does) finds it; the
        # collectives it issues still come through the methods below (torch calls them virtually).
        self._register_backend(torch.device("cpu"), torch_internals.gloo_backend_type(), inner)
        self._set_default_backend(torch_internals.gloo_backend_type())

    def _get_backend(self, device: Any) -> Any:
        return self

    # -- torch 2.15's dist.split_group (gloo splits without a bound device since 2.15) ---------------
    def split_group(
        self,
        ranks: list[int],
        timeout: Any = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> Any:
        """``ProcessGroup.split_group``: the caller's part of a split, a checked gloo group of its own.

        ``ranks`` are ranks in this group that include the caller (or, when no split does, the first
        split: the caller then gets None, as from gloo). Only the new group's members connect, over
        the parent's store under the new group's name, as gloo's own split does."""
        from datetime import timedelta

        if self.rank_ not in ranks:
            return None
        if group_name is None:
            raise InvalidArgument("split_group needs the new group's name (torch's dist.split_group gives one)")
        store = torch_internals.c10d_state().pg_map[self][1]
        rank, size = ranks.index(self.rank_), len(ranks)
        inner = torch_internals.gloo_group(
            torch_internals.prefix_store(f"{group_name}/", store), rank, size, timeout or timedelta(minutes=30)
        )
        members = tuple(self.members[r] for r in ranks)
        group = CheckedGroup(inner, rank, size, members, group_name, self.checker)
        group._group_name, group._group_desc = group_name, group_desc or ""
        group._split_store = torch_internals.prefix_store(f"{group_name}/", store)
        return group

    # -- checking --------------------------------------------------------------------------------------
    def _next_seq(self) -> int:
        if self.seq_run != self.checker.run_id:
            self.seq_run, self.seq = self.checker.run_id, 0
        self.seq += 1
        return self.seq

    def _post(self, call: Any, issue: Callable[[], Any], op: str = "") -> Any:
        checker = self.checker
        if not checker.active:
            return issue()
        call.check_local()
        fail = self._fault(op) if checker.faults is not None else None
        seq = self._next_seq()
        where = matching.collective_where(self.label, seq)
        what = f"{call.describe()} on {where}"
        record = checker.recorder.collective(self, call, seq, self.members[self.rank_])
        msg: tuple[Any, ...] = ("post", self.gid, self.members, seq, call)
        board = checker.board if checker.board_on else None
        if fail is not None:  # a Fail fault: the referee fails this collective on every rank that joins it
            rec = checker.post((*msg, failed_text(fail, where)), what, issue, record)
        elif board is not None:  # on the check board; the referee judges calls whose ranks may differ
            refereed = type(call).check_all is not C.Call.check_all
            rec = board.post(msg, self.board_key, call, refereed, what, issue, record)
        else:
            rec = checker.post(msg, what, issue, record)
        return CheckedWork(checker, rec)

    def _fault(self, op: str) -> Fault | None:
        """Count this call for the run's injected faults (contract G5): a Kill kills this process, a Delay
        sleeps; returns a Fail that fires here, for the caller to post."""
        plan = self.checker.faults
        fault = plan.hit(op, self.label == "world", self.members) if plan is not None else None
        if isinstance(fault, Kill):
            self.checker.kill(fault)
        if isinstance(fault, Delay):
            time.sleep(fault.seconds)
        return fault if isinstance(fault, Fail) else None

    def _p2p(self, kind: str, t: Any, peer: int, tag: int, issue: Callable[[], Any]) -> Any:
        checker = self.checker
        if not checker.active:
            return issue()
        c10d.check_peer_rank(kind, peer, self.size_, f"group {self.label}")
        what = matching.p2p_describe(kind, t, self.members[peer], tag, f"group {self.label}")
        msg = ("p2p", self.gid, self.members, kind, self.rank_, peer, tag, Meta.of(t), what)
        record = checker.recorder.p2p(self, kind, t, self.members[peer], tag, self.members[self.rank_])
        return CheckedWork(checker, checker.post(msg, what, issue, record))

    # -- collectives: every c10d method comes from the checking core's table (core.c10d.install) --------
    def _issue_c10d(self, method: c10d.Method, args: dict[str, Any]) -> Any:
        """One c10d method (``method``, with its arguments by name): checked, then issued to gloo as called."""
        if method.options and args["opts"] is None:
            args["opts"] = torch_internals.c10d_options(method.options)

        issue = _as_caller(lambda: getattr(self.inner, method.name)(*[args[p] for p in method.params]))

        if method.kind == "p2p":
            t = c10d.one_tensor(args["tensors"], method.name)
            return self._p2p(method.name, t, int(args[method.params[1]]), int(args["tag"]), issue)
        if method.kind == "coalesced":
            # Coalesced forms run as consecutive checked collectives, in list order, on every rank.
            part = getattr(self, method.part)
            for work in [part(o, i, args["opts"]) for o, i in zip(args["outputs"], args["inputs"])]:
                work.wait()
            return DoneWork(args["outputs"])
        assert method.args is not None
        return self._post(C.CALLS[method.op](self.rank_, self.size_, *method.args(_METAS, args)), issue, method.op)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()
