"""dstest's c10d backend: process groups whose collectives go to a world's rendezvous instead of a network.

A ``Group`` is one rank's handle on one group, created by torch through the registered backend (so
``dist.new_group``, ``DeviceMesh``, DTensor, FSDP2 and functional collectives all build and use them as
they would gloo's). Each group answers what torch's stacks ask of a process group: ``group_name`` and
``group_desc`` (set by torch, unique and stable per group of a world), its backend for every device, and
every collective as c10d calls it. A group object that reaches another rank's thread (a module-level
cache, a default argument evaluated once) acts for the calling rank where that rank has the same group,
and raises naming both ranks where it has not.

The threaded and the fake world share this module; they differ in the rendezvous they bind (``binding``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument
from dstest.worlds import collectives as C
from dstest.worlds import torch_internals
from dstest.worlds.core import c10d
from dstest.worlds.core.faults import Delay, Fail
from dstest.worlds.threaded.waits import Done
from dstest.worlds.threaded.work import Work
from dstest.worlds.torch_internals.dispatched import DispatchedGroup

__all__ = [
    "BACKEND_NAME",
    "Group",
    "WorldTables",
    "binding",
    "calling_rank",
    "rank_process_group",
    "register_backend",
    "translate_group",
    "world_tables",
]

BACKEND_NAME = "dstest"
binding = threading.local()  # .session and .rank of the rank running on this thread
_register_lock = threading.Lock()


def register_backend() -> None:
    """Register the c10d backend once per process; idempotent, never an import side effect."""
    with _register_lock:
        if torch_internals.backend_registered(BACKEND_NAME):
            return
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=devices)
        torch_internals.declare_self_recording(BACKEND_NAME)


def _create_group(opts: Any, pg_options: Any) -> dist.ProcessGroup:
    session = getattr(binding, "session", None)
    if session is None:
        raise RuntimeError(
            f"the {BACKEND_NAME!r} backend only works inside a dstest world "
            "(dstest.run(fn, world_size, world='threaded') or a @dstest.spec)"
        )
    ranks = list(opts.global_ranks_in_group) or world_tables(session).ranks
    group = Group(session, opts.group_rank, opts.group_size, ranks, str(opts.group_id))
    register = getattr(session, "register_group", None)
    if register is not None:
        register(group)
    return group


def calling_rank() -> int | None:
    """The global rank whose thread (or helper thread) is running, if any."""
    return getattr(binding, "rank", None)


def translate_group(pg: Any) -> Any:
    """The calling rank's own copy of another rank's group ``pg`` (same name and ranks), or None when
    ``pg`` is not a foreign group; raises (naming both ranks) when the caller has no such group."""
    if not isinstance(pg, Group):
        return None
    local = pg._acting()
    return None if local is pg else local


class RanksKey(tuple):  # type: ignore[type-arg]
    """A group's global ranks in its key (``Group.key``), equal to and hashing as the plain tuple, with the
    hash computed once: every collective looks its exchange up by ``(group.key, seq)``, and hashing a tuple
    of 4096 ranks took 24 us, about three times per rank and collective (measured at W=4096)."""

    def __hash__(self) -> int:
        known: int | None = self.__dict__.get("hash")
        if known is None:
            known = self.__dict__["hash"] = tuple.__hash__(self)
        return known

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))


class WorldTables:
    """What every rank's default group of one world holds the same: its global ranks and c10d's rank table
    (global rank -> group rank), built once per world and shared by its ranks (read-only, as each process
    of a real world holds its own equal copy). Per rank, they were O(W) each: O(W^2) at a world's start."""

    def __init__(self, world_size: int) -> None:
        self.ranks = list(range(world_size))
        self.rank_table = {r: r for r in self.ranks}
        self.key = RanksKey(self.ranks)


#: Exchange ids (:func:`exchange_id`), unique in the process: ``next`` on a count is atomic in CPython.
_EXCHANGE_IDS = itertools.count()


def exchange_id(session: Any, key: Any) -> int:
    """The number every rank's group with ``key`` (name and global ranks) posts its collectives under in
    ``session``'s rendezvous: its exchanges are looked up by ``(number, seq)``, a pair of ints that hashes
    in C, where ``(key, seq)`` called ``RanksKey.__hash__`` in Python three times per rank and collective.
    Made once per key and session by the first group with it (``setdefault`` is atomic: ranks creating
    the same group at once get the same number)."""
    ids = session.__dict__.get("_exchange_ids")
    if ids is None:
        ids = session.__dict__.setdefault("_exchange_ids", {})
    found = ids.get(key)
    if found is None:
        found = ids.setdefault(key, next(_EXCHANGE_IDS))
    return found  # type: ignore[no-any-return]


def world_tables(session: Any) -> WorldTables:
    """The tables of ``session``'s world, made by the first rank that asks (``setdefault`` is atomic)."""
    tables = session.__dict__.get("_world_tables")
    if tables is None:
        tables = session.__dict__.setdefault("_world_tables", WorldTables(session.world_size))
    return tables  # type: ignore[no-any-return]


@contextlib.contextmanager
def rank_process_group(
    c10d_world: Any, session: Any, rank: int, device: torch.device, timeout: timedelta
) -> Iterator[None]:
    """On a rank thread: its own c10d state and default group on ``session`` for the block, both gone
    afterwards (the threaded and the fake world start every rank thread this way)."""
    torch_internals.create_thread_caches()
    c10d_world.bind()
    binding.session, binding.rank, binding.device = session, rank, device
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        torch_internals.form_default_group(
            backend=BACKEND_NAME,
            rank=rank,
            world_size=session.world_size,
            store=session.store,
            timeout=timeout,
            rank_table=world_tables(session).rank_table,
        )
        yield
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            binding.__dict__.clear()
            c10d_world.unbind()
            torch_internals.release_thread_caches()


class _Tensors(torch_internals.OptionsReader):
    """The threaded world hands a ``Call`` the rank's own tensors (see :class:`dstest.worlds.core.c10d.Buffers`)."""

    one = staticmethod(c10d.one_tensor)

    @staticmethod
    def tensor(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def each(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    @staticmethod
    def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)


_TENSORS = _Tensors()


@c10d.install
class Group(DispatchedGroup):
    """One rank's handle on one group of a world; every method forwards to the session.

    The c10d methods (``allreduce``, ``_allgather_base``, ``send``...) are made from the checking core's
    table (:mod:`dstest.worlds.core.c10d`), as the process world's checked gloo groups are: each builds
    the same ``Call`` from the same arguments, and :meth:`_issue_c10d` posts it to this world's session. While
    something watches torch's dispatcher (a dispatch mode such as ``CommDebugMode``, the profiler, a tensor
    subclass) a call takes the dispatcher's road first, as on gloo (contract E16).
    """

    backend_name = BACKEND_NAME
    always_dispatched = False

    def __init__(self, session: Any, rank: int, size: int, global_ranks: list[int], name: str) -> None:
        super().__init__(rank, size)
        self.session = session
        self.rank_ = rank
        self.size_ = size
        self.global_ranks = global_ranks
        self.owner = global_ranks[rank]
        tables = session.__dict__.get("_world_tables")
        same = tables is not None and global_ranks is tables.ranks
        self.key = (name, tables.key if same else RanksKey(global_ranks))
        self.xid = exchange_id(session, self.key)
        self.label = "world" if len(global_ranks) == session.world_size and name == "0" else f"{name} {global_ranks}"
        self._seq = 0
        self._group_name = name
        self._group_desc = "undefined"
        self.device: torch.device = getattr(binding, "device", None) or torch.device("cpu")

    # -- what torch's stacks ask of a process group (names and backend: DispatchedGroup) -------------
    def rank(self) -> int:
        """The calling rank's rank in this group (c10d's ``get_rank``/``get_world_size`` ask the object:
        a group object that crossed to another rank, or from an earlier world, answers for the caller)."""
        return self._acting().rank_

    def size(self) -> int:
        return self._acting().size_

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _get_backend(self, device: Any) -> Group:  # type: ignore[override]
        """The group is its own backend for every device; it has no ``supports_coalescing``, so
        batch_isend_irecv posts each transfer on its own (torch 2.14 asks; our groups register no
        C++ backend, and the default answer is "No backend type associated with device type cpu")."""
        return self

    # -- torch 2.15's dist.split_group (gloo splits without a bound device since 2.15) ------------------
    @property
    def _device_types(self) -> list[torch.device]:
        """The device the group moves tensors on, as gloo's or NCCL's group reports its backend's device
        (a Python group registers no C++ backend, so torch's own answer would be none)."""
        return [self.device]

    def split_group(
        self,
        ranks: list[int],
        timeout: timedelta | None = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> Group | None:
        """``ProcessGroup.split_group``: the caller's part of a split of this group, a group of this world.

        ``ranks`` are ranks in this group (torch passes the split that holds the caller, or the first one
        when none does: the caller is then no member and gets None, as from gloo and NCCL)."""
        me = self._acting()
        if me.rank_ not in ranks:
            return None
        if group_name is None:
            raise InvalidArgument("split_group needs the new group's name (torch's dist.split_group gives one)")
        global_ranks = [me.global_ranks[r] for r in ranks]
        group = Group(me.session, ranks.index(me.rank_), len(ranks), global_ranks, group_name)
        group._group_desc = group_desc or "undefined"
        me.session.register_group(group)
        return group

    def get_group_store(self) -> Any:
        """The world's rendezvous store under this group's name (what torch records for a split group)."""
        return torch_internals.prefix_store(f"{self._group_name}/", self.session.store)

    def __repr__(self) -> str:
        return f"<dstest group {self.label} of rank {self.owner}>"

    # -- which rank is calling -----------------------------------------------------------------------
    def _acting(self) -> Group:
        """The group of the calling rank: this one, or the caller's own copy of it (same name and ranks).

        In a world of processes every rank holds its own group objects. A group object that crossed to
        another rank's thread acts for that rank where it has the same group; otherwise the call is wrong
        in any world, and raises here, before anything is posted.
        """
        bound = binding.__dict__  # this thread's binding (one lookup for both names)
        caller = bound.get("rank")
        current = bound.get("session")
        if caller is not None and current is not None and current is not self.session:
            return self._from_earlier_world(current, caller)
        if caller is None or caller == self.owner:
            return self
        mine = self.session.group_of(self.key, caller)
        if mine is not None:
            return mine  # type: ignore[no-any-return]
        raise InvalidArgument(
            f"group {self.label} belongs to rank {self.owner} but was used by rank {caller}, which "
            f"{'is not a member of it' if caller not in self.global_ranks else 'never created it'}. In a world "
            "of processes every rank has its own group objects: create groups on every rank (dist.new_group "
            "on each) and keep them per rank, not in one object shared by all ranks; for code that keeps "
            "process groups in module globals use world='process'"
        )

    def _from_earlier_world(self, current: Any, caller: int) -> Group:
        """A group object kept from an earlier world: a default argument evaluated at import (as
        ``torch.distributed.nn.functional``'s ``group=group.WORLD``) or a module-level cache.

        Such code, imported in each process of a world of processes, holds that process's world group;
        the earlier world's world group therefore acts as the caller's world group of this world. Any
        other group ended with its world: raise, naming it, rather than report the earlier world's fate.
        """
        if self.label == "world":
            mine = current.group_of(("0", tuple(range(current.world_size))), caller)
            if mine is not None:
                return mine  # type: ignore[no-any-return]
        raise InvalidArgument(
            f"group {self.label} of rank {self.owner} was created by an earlier world (now finished) and used "
            f"by rank {caller} of this one: process groups do not outlive their world. Create groups inside "
            "the rank function on every rank, not at import or in a module-level cache kept across worlds"
        )

    def _post(self, call: C.Call) -> Work:
        return Work(self.session.arrive(self, call))

    def _post_with_faults(self, op: str, call: C.Call) -> Work:
        """Post ``call`` in a run with injected faults: a Delay sleeps first, a Kill unwinds this rank, a
        Fail fails the collective on every rank that joins it (see :mod:`dstest.worlds.core.faults`)."""
        session = self.session
        plan = session.faults[self.owner]
        fault = plan.hit(op, self.label == "world", self.global_ranks) if plan is not None else None
        if fault is None:
            return self._post(call)
        session.inject(self.owner, fault)  # raises for a Kill
        if isinstance(fault, Delay):
            time.sleep(fault.seconds)
        return Work(session.arrive(self, call, fail=fault if isinstance(fault, Fail) else None))

    # -- collectives: every c10d method comes from the checking core's table (core.c10d.install) --------
    def _issue_c10d(self, method: c10d.Method, args: dict[str, Any]) -> Work:
        """One c10d method (``method``, with its arguments by name), for the calling rank's group."""
        g = self._acting()
        kind = method.kind
        if kind == "p2p":
            t = c10d.one_tensor(args["tensors"], method.name)
            peer = args[method.params[1]]
            return Work(g.session.post_p2p(g, method.name, t, int(peer), int(args["tag"])))
        if args["opts"] is None:
            args["opts"] = torch_internals.c10d_options(method.options)
        if kind == "coalesced":
            # Coalesced forms run as consecutive collectives on the group, in list order, on every rank.
            part = getattr(g, method.part)
            for work in [part(o, i, args["opts"]) for o, i in zip(args["outputs"], args["inputs"])]:
                work.wait()
            return Work(Done(g.session, g.owner, args["outputs"]))
        assert method.args is not None
        call_args = method.args(_TENSORS, args)
        session = g.session
        if session.faults is not None:  # a run with injected faults (contract G5): count, maybe fire
            work = g._post_with_faults(method.op, C.CALLS[method.op](g.rank_, g.size_, *call_args))
        else:  # g._post, inline
            work = Work(session.arrive(g, C.CALLS[method.op](g.rank_, g.size_, *call_args)))
        if kind != "flat":
            return work
        work.wait()  # the flat buffer is a copy: its result goes back into the caller's tensors
        flat, offset = call_args[0], 0
        with C.raw_writes():
            for t in args["tensors"]:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        C.bump_versions(args["tensors"], 1)  # gloo's copy back into each tensor changes its version once
        return Work(Done(g.session, g.owner, args["tensors"]))

    def monitoredBarrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        raise InvalidArgument(
            "dist.monitored_barrier is implemented by torch for the gloo backend only (torch's own limit); "
            "use dist.barrier() in the threaded world, or world='process' (gloo) for monitored_barrier"
        )
