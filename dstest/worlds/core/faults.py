"""Declarative faults (contract G5): a rank dies, a collective raises, or a rank is slow, at its k-th call.

Fault-tolerant training code (elastic restarts, torchft-style quorum, checkpoint recovery) has to be tested
against what a real backend does when a peer is gone: the peers' collectives raise a backend error soon
after, they never hang. On CPU, without real machines to unplug, the only way to get there is to make the
world itself misbehave, at a point named in the test: ``Kill(rank=1, op="all_reduce", nth=3)``.

This module is the torch-free half, shared by both simulated worlds: the fault classes (checked when they
are made), :class:`Killed` (what a killed rank "returns"), and :class:`RankFaults`, the per-rank counter
that decides which call a fault fires at. Counting is per rank and per (op, group): ``group=None`` counts
the rank's calls of ``op`` on every group together, ``group="world"`` only those on the default group, and
``group=[0, 2]`` only those on the group whose global ranks are exactly 0 and 2. A fault that never fired by
the end of a run fails it (:class:`~dstest.errors.FaultNotFired`, unless ``optional=True``): a recovery test
whose fault names a call the code never makes tests nothing. Each world hands the ranks' counters to
:func:`not_fired_error` and :func:`not_fired_note`, so the texts are the same in both. What a fault *does* is
the world's: the threaded world unwinds the rank's thread, the process world's worker kills itself; both tell
their peers through the checking core's "a rank left the run" path (:mod:`dstest.worlds.core.matching`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dstest.errors import FaultNotFired, InvalidArgument
from dstest.worlds.core.c10d import COLLECTIVES

__all__ = [
    "FAULT_OPS",
    "Delay",
    "Fail",
    "Fault",
    "Kill",
    "Killed",
    "RankFaults",
    "check_faults",
    "describe_group",
    "not_fired_error",
    "not_fired_note",
]

#: The collectives a fault can name: every op dstest records for a c10d collective method.
FAULT_OPS: frozenset[str] = frozenset(COLLECTIVES)


def _check_common(kind: str, rank: object, op: object, nth: object, group: object) -> Any:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise InvalidArgument(f"{kind}(rank={rank!r}): rank must be an int >= 0 (a global rank of the world)")
    if op not in FAULT_OPS:
        raise InvalidArgument(
            f"{kind}(op={op!r}): op must be the name of a collective dstest records, one of {sorted(FAULT_OPS)}"
        )
    if not isinstance(nth, int) or isinstance(nth, bool) or nth < 1:
        raise InvalidArgument(f"{kind}(nth={nth!r}): nth must be an int >= 1 (the rank's 1st, 2nd... call of op)")
    if group is None or group == "world":
        return group
    if isinstance(group, str | bytes) or not isinstance(group, Sequence):
        raise InvalidArgument(
            f"{kind}(group={group!r}): group must be None (any group), 'world' (the default group) or a list "
            "of the group's global ranks"
        )
    ranks = tuple(group)
    if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise InvalidArgument(f"{kind}(group={group!r}): a group is given by its global ranks, ints >= 0, at least one")
    return tuple(sorted(ranks))


@dataclass(frozen=True, repr=False)
class Fault:
    """What every fault has: the global ``rank`` it happens on, at its ``nth`` call of ``op`` on ``group``.

    ``optional=True``: the fault may not fire (its call depends on the run), and the run passes all the same;
    without it a fault that never fired fails the run (:class:`~dstest.errors.FaultNotFired`).
    """

    rank: int
    op: str = "all_reduce"
    nth: int = 1
    group: Any = None
    optional: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        kind = type(self).__name__
        object.__setattr__(self, "group", _check_common(kind, self.rank, self.op, self.nth, self.group))
        if not isinstance(self.optional, bool):
            raise InvalidArgument(
                f"{kind}(optional={self.optional!r}): optional must be True or False (True: the fault may not "
                "fire in a run, and the run passes all the same)"
            )

    def __repr__(self) -> str:
        # As written in a test, without the defaults a reader did not write: the texts of faults that never
        # fired quote it. group is shown as given (a list), not as the sorted tuple kept for matching.
        parts = [f"rank={self.rank}", f"op={self.op!r}", f"nth={self.nth}"]
        if self.group is not None:
            parts.append(f"group={self.group!r}" if self.group == "world" else f"group={list(self.group)}")
        parts += self._extra()
        if self.optional:
            parts.append("optional=True")
        return f"{type(self).__name__}({', '.join(parts)})"

    def _extra(self) -> list[str]:
        return []

    def at(self) -> str:
        """``all_reduce #3 on group world`` (any group: ``on any group``)."""
        return f"{self.op} #{self.nth} on {describe_group(self.group)}"

    def describe(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} at its {self.at()})"


@dataclass(frozen=True, repr=False)
class Kill(Fault):
    """The rank dies at that call: its process exits as if killed (process world), its thread ends as a
    crash would (threaded world). Its peers' collectives that need it raise a backend error."""


@dataclass(frozen=True, repr=False)
class Fail(Fault):
    """That call raises on the rank the error a real backend raises when a peer is gone
    (``torch.distributed.DistBackendError``); the peers' sides of the same collective raise it too."""


@dataclass(frozen=True, repr=False)
class Delay(Fault):
    """The rank sleeps ``seconds`` before that call, then makes it as usual."""

    seconds: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 <= s <= 3600:
            raise InvalidArgument(f"Delay(seconds={s!r}): seconds must be a finite number between 0 and 3600")

    def _extra(self) -> list[str]:
        return [f"seconds={self.seconds!r}"]

    def describe(self) -> str:
        return f"Delay({self.seconds:g} s, rank {self.rank} at its {self.at()})"


@dataclass(frozen=True)
class Killed:
    """The result of a rank that a :class:`Kill` fault ended: ``at`` names the call (``all_reduce #3 on
    group world``). Compares equal to another marker of the same rank and call."""

    rank: int
    at: str

    def __repr__(self) -> str:
        return f"Killed(rank={self.rank}, at={self.at!r})"


def describe_group(group: Any) -> str:
    if group is None:
        return "any group"
    return "group world" if group == "world" else f"group {list(group)}"


def check_faults(faults: Iterable[Any] | None, world_size: int | None = None) -> tuple[Fault, ...]:
    """``faults`` as a tuple, each a :class:`Kill`, :class:`Fail` or :class:`Delay` whose rank (and
    group ranks) lie in a world of ``world_size`` (not checked when None); at most one fault per call."""
    if faults is None:
        return ()
    if isinstance(faults, Fault):
        faults = [faults]
    if isinstance(faults, str | bytes) or not isinstance(faults, Iterable):
        raise InvalidArgument(f"faults={faults!r}: must be a list of dstest.faults.Kill, Fail or Delay")
    out = tuple(faults)
    seen: dict[tuple[Any, ...], Fault] = {}
    for f in out:
        if not isinstance(f, Kill | Fail | Delay):
            raise InvalidArgument(f"faults: {f!r} is not a dstest.faults.Kill, Fail or Delay")
        if world_size is not None:
            if f.rank >= world_size:
                raise InvalidArgument(f"{f!r}: rank {f.rank} is not a rank of a world of {world_size} (0..{world_size - 1})")
            if isinstance(f.group, tuple) and (max(f.group) >= world_size or f.rank not in f.group):
                raise InvalidArgument(
                    f"{f!r}: group {list(f.group)} must hold rank {f.rank} and only ranks of a world of {world_size}"
                )
        where = (f.rank, f.op, f.nth, f.group)
        if where in seen:
            raise InvalidArgument(f"faults: {seen[where]!r} and {f!r} fire at the same call; give one fault per call")
        seen[where] = f
    return out


class RankFaults:
    """One rank's faults and its call counters; :meth:`hit` is asked before each of its collectives.

    A world asks only when the run has faults for some rank (otherwise it holds None and pays nothing). It
    also keeps what the end of the run needs to say which faults never fired and why: every op the rank
    called (``made``), the faults that fired, the fault a Kill ended the rank with, and faults whose call
    another fault took. Plain data: the process world's worker sends it to the parent.
    """

    def __init__(self, faults: Sequence[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]
        self.ops = frozenset(f.op for f in self.faults)
        self.counts: dict[tuple[str, Any], int] = {}
        self.made: dict[str, int] = {}  # op -> the rank's calls of it on any group
        self.fired: list[Fault] = []
        self.taken: dict[Fault, Fault] = {}  # a fault whose call another fault fired at -> that fault
        self.killed_by: Kill | None = None

    def hit(self, op: str, is_world: bool, members: Sequence[int]) -> Fault | None:
        """Count this call of ``op`` on a group (the default group when ``is_world``; ``members``: its
        global ranks) and return the fault that fires at it, if any. When several faults name this same
        call (``group=None`` and ``group="world"`` can), the first of the run's list fires and the others
        are reported as never fired."""
        made = self.made
        made[op] = made.get(op, 0) + 1
        if op not in self.ops:
            return None
        keys: list[Any] = [None, tuple(sorted(members))]
        if is_world:
            keys.append("world")
        counts = self.counts
        for key in keys:
            counts[(op, key)] = counts.get((op, key), 0) + 1
        due = [f for f in self.faults if f.op == op and f.group in keys and f.nth == counts[(op, f.group)]]
        if not due:
            return None
        fired = due[0]
        self.fired.append(fired)
        for other in due[1:]:
            self.taken[other] = fired
        if isinstance(fired, Kill):
            self.killed_by = fired
        return fired

    def not_fired(self) -> list[str]:
        """Why each of this rank's faults that did not fire never did (``optional`` ones left out)."""
        out = []
        for f in self.faults:
            if f.optional or f in self.fired:
                continue
            if f in self.taken:
                by = self.taken[f]
                why = f"{by!r} fired at the same call, its {by.at()} (give one fault per call)"
            elif self.killed_by is not None:
                why = f"rank {self.rank} was killed first, by {self.killed_by!r} at its {self.killed_by.at()}"
            else:
                why = self._calls_of(f)
            out.append(f"{f!r} never fired: {why}")
        return out

    def _calls_of(self, f: Fault) -> str:
        """``rank 0 made 2 all_reduce calls on group world (5 on any group)``, or that it made none."""
        anywhere = self.made.get(f.op, 0)
        if anywhere == 0:
            others = ", ".join(f"{op} x{n}" for op, n in sorted(self.made.items()))
            return f"rank {self.rank} made no {f.op} call " + (
                f"(its collectives: {others})" if others else "(nor any other collective)"
            )
        n = self.counts.get((f.op, f.group), 0)
        text = f"rank {self.rank} made {n} {f.op} call{'' if n == 1 else 's'} on {describe_group(f.group)}"
        return text if f.group is None else f"{text} ({anywhere} on any group)"


def _not_fired(tallies: Iterable[RankFaults | None]) -> list[str]:
    return [line for t in sorted((t for t in tallies if t is not None), key=lambda t: t.rank) for line in t.not_fired()]


def not_fired_error(tallies: Iterable[RankFaults | None]) -> FaultNotFired | None:
    """The error of a run that otherwise passed, when a fault of it never fired: every such fault, each
    with the calls its rank made (``tallies``: the ranks' counters at the end of the run, None for a rank
    no fault names)."""
    lines = _not_fired(tallies)
    if not lines:
        return None
    head = "an injected fault never fired" if len(lines) == 1 else f"{len(lines)} injected faults never fired"
    return FaultNotFired(
        f"{head}, so the run did not test what it injects:\n  "
        + "\n  ".join(lines)
        + "\nName a call the code makes (op, nth, group), or give the fault optional=True if it is meant to fire "
        "only in some runs."
    )


def not_fired_note(tallies: Iterable[RankFaults | None]) -> str:
    """For the report of a run that failed anyway: the faults that never fired, or ``""``."""
    lines = _not_fired(tallies)
    return "\ninjected faults that never fired: " + "; ".join(lines) if lines else ""


def plan_for(faults: Sequence[Fault], rank: int) -> RankFaults | None:
    """The rank's :class:`RankFaults`, or None when no fault names it (its collectives then skip the count)."""
    mine = [f for f in faults if f.rank == rank]
    return RankFaults(mine, rank) if mine else None


def killed_phrase(fault: Fault) -> str:
    """How texts name a rank that a Kill ended (the checking core's ``phrase`` of a rank that left)."""
    return f"was killed by an injected fault (dstest Kill at its {fault.at()})"


def failed_text(fault: Fault, where: str) -> str:
    """The error of every side of a collective a Fail fault broke."""
    return (
        f"injected fault: rank {fault.rank}'s {fault.op} on {where} failed (dstest Fail at its {fault.at()}), "
        "as a backend reports a collective whose peer is gone"
    )
