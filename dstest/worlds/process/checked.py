"""The worker side of the cross-rank check, on torch's side: the ``CheckedGroup`` a gloo pool's groups are
(and its work handles), and its registration as the c10d backend ``dstest_gloo``.

torch-internal: this module subclasses ``dist._Work`` and ``dist.ProcessGroup``, registers a backend on the
C++ group, and wraps ``distributed_c10d._new_process_group_helper`` (see :func:`_install_checking`). It
imports torch only when the class is first built, in a worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from dstest.errors import (
    InvalidArgument,
)
from dstest.worlds.process.checker import _check_error, _Checker, _Record
from dstest.worlds.process.messages import _Dev, _Meta

_CHECKED_BACKEND = "dstest_gloo"


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
    from dstest.worlds import torch_internals as _compat

    class CheckedWork(dist._Work):  # type: ignore[misc, name-defined]
        """The handle of a checked call: waits for the verdict, then for the gloo work issued on it."""

        def __init__(self, checker: _Checker, rec: _Record) -> None:
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
            fut, handed_out = _compat.linked_future()  # failed in C++ too when the call fails (DDP's reducer)

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
                    return handed_out
            resolve()
            return handed_out

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
            self._split_store: Any = None
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

        # -- torch 2.15's dist.split_group (gloo splits without a bound device since 2.15) ---------------
        @property
        def supports_splitting(self) -> bool:
            return True

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

            from torch.distributed import distributed_c10d as c10d

            if self.rank_ not in ranks:
                return None
            if group_name is None:
                raise InvalidArgument("split_group needs the new group's name (torch's dist.split_group gives one)")
            store = c10d._world.pg_map[self][1]
            rank, size = ranks.index(self.rank_), len(ranks)
            inner = c10d_c.ProcessGroupGloo(
                c10d_c.PrefixStore(f"{group_name}/", store), rank, size, timeout or timedelta(minutes=30)
            )
            members = tuple(self.members[r] for r in ranks)
            group = CheckedGroup(inner, rank, size, members, group_name, self.checker)
            group._group_name, group._group_desc = group_name, group_desc or ""
            group._split_store = c10d_c.PrefixStore(f"{group_name}/", store)
            return group

        def get_group_store(self) -> Any:
            """The store a split group was made over (torch records it for the group)."""
            return self._split_store

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
            record = checker.recorder.collective(self, call, seq, self.members[self.rank_])
            rec = checker.post(("post", self.gid, self.members, seq, call), what, issue, record)
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
            record = checker.recorder.p2p(self, kind, t, self.members[peer], tag, self.members[self.rank_])
            return CheckedWork(checker, checker.post(msg, what, issue, record))

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
