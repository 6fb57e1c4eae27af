"""Declarative faults (contract G5): a rank dies, a collective raises, or a rank is slow, at its k-th call.

Fault-tolerant training code (elastic restarts, torchft-style quorum, checkpoint recovery) has to be tested
against what a real backend does when a peer is gone: the peers' collectives raise a backend error soon
after, they never hang. On CPU, without real machines to unplug, the only way to get there is to make the
world itself misbehave, at a point named in the test: ``Kill(rank=1, op="all_reduce", nth=3)``.

This module is the torch-free half, shared by both simulated worlds: the fault classes (checked when they
are made), :class:`Killed` (what a killed rank "returns"), and :class:`RankFaults`, the per-rank counter
that decides which call a fault fires at. Counting is per rank and per (op, group): ``group=None`` counts
the rank's calls of ``op`` on every group together, ``group="world"`` only those on the default group, and
``group=[0, 2]`` only those on the group whose global ranks are exactly 0 and 2. What a fault *does* is the
world's: the threaded world unwinds the rank's thread, the process world's worker kills itself; both tell
their peers through the checking core's "a rank left the run" path (:mod:`dstest.worlds.core.matching`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dstest.errors import InvalidArgument
from dstest.worlds.core.c10d import METHODS

__all__ = ["FAULT_OPS", "Delay", "Fail", "Fault", "Kill", "Killed", "RankFaults", "check_faults", "describe_group"]

#: The collectives a fault can name: every op dstest records for a c10d collective method.
FAULT_OPS: frozenset[str] = frozenset(m.op for m in METHODS if m.op)


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


@dataclass(frozen=True)
class Fault:
    """What every fault has: the global ``rank`` it happens on, at its ``nth`` call of ``op`` on ``group``."""

    rank: int
    op: str = "all_reduce"
    nth: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", _check_common(type(self).__name__, self.rank, self.op, self.nth, self.group))

    def at(self) -> str:
        """``all_reduce #3 on group world`` (any group: ``on any group``)."""
        return f"{self.op} #{self.nth} on {describe_group(self.group)}"

    def describe(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} at its {self.at()})"


@dataclass(frozen=True)
class Kill(Fault):
    """The rank dies at that call: its process exits as if killed (process world), its thread ends as a
    crash would (threaded world). Its peers' collectives that need it raise a backend error."""


@dataclass(frozen=True)
class Fail(Fault):
    """That call raises on the rank the error a real backend raises when a peer is gone
    (``torch.distributed.DistBackendError``); the peers' sides of the same collective raise it too."""


@dataclass(frozen=True)
class Delay(Fault):
    """The rank sleeps ``seconds`` before that call, then makes it as usual."""

    seconds: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 <= s <= 3600:
            raise InvalidArgument(f"Delay(seconds={s!r}): seconds must be a finite number between 0 and 3600")

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

    A world asks only when the run has faults for some rank (otherwise it holds None and pays nothing).
    """

    def __init__(self, faults: Sequence[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]
        self.ops = frozenset(f.op for f in self.faults)
        self.counts: dict[tuple[str, Any], int] = {}

    def hit(self, op: str, is_world: bool, members: Sequence[int]) -> Fault | None:
        """Count this call of ``op`` on a group (the default group when ``is_world``; ``members``: its
        global ranks) and return the fault that fires at it, if any."""
        if op not in self.ops:
            return None
        keys: list[Any] = [None, tuple(sorted(members))]
        if is_world:
            keys.append("world")
        counts = self.counts
        fired = None
        for key in keys:
            n = counts[(op, key)] = counts.get((op, key), 0) + 1
            for f in self.faults:
                if f.op == op and f.group == key and f.nth == n:
                    fired = fired or f
        return fired


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
