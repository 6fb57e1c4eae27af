"""Checking the checkers: the fault trigger (contract G5), as properties.

Which call a fault fires at is decided by one torch-free counter, :class:`dstest.worlds.core.faults.RankFaults`,
that both simulated worlds ask before each collective of a rank, and whose state at the end of the run says
which faults never fired (:class:`dstest.errors.FaultNotFired`). These properties drive it directly with
random faults (kind, op, nth, group selector, optional) and random sequences of calls (op, the default group
or a subgroup), against a model written here from the contract's words:

- a fault's matching calls are the rank's calls of its op on any group (``group=None``), on the default group
  (``"world"``) or on the group of exactly its ranks; it is due at its nth matching call;
- at each call, the first fault of the list that is due there fires, and only there; a fault due at the same
  call as another is reported as taken by it; after a Kill fires the rank makes no more calls;
- "never fired" is reported for a fault iff it is not optional and did not fire: because fewer than nth
  matching calls were made (the text gives that count), because a Kill ended the rank first, or because
  another fault took its call.

A few fixed cases then run through ``dstest.run`` on the threaded and the process world. See
docs/checking-the-checkers.md.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st

import dstest
from dstest.errors import InvalidArgument
from dstest.worlds.core.faults import (
    Delay,
    Fail,
    Fault,
    Kill,
    RankFaults,
    check_faults,
    describe_group,
    not_fired_error,
)

pytestmark = pytest.mark.cpu

OPS = ["all_reduce", "broadcast", "barrier"]  # few ops, so that faults and calls often meet


@st.composite
def scenarios(draw: Any) -> tuple[int, list[tuple[int, ...]], list[Fault], list[tuple[str, int]]]:
    """(rank, groups the rank belongs to (groups[0] is the default group), faults of the rank, calls as
    (op, index into groups))."""
    world_size = draw(st.integers(2, 4))
    rank = draw(st.integers(0, world_size - 1))
    everyone = tuple(range(world_size))
    others = [r for r in everyone if r != rank]
    subgroups = draw(
        st.lists(st.lists(st.sampled_from(others), unique=True, max_size=len(others)), max_size=3).map(
            lambda gs: [tuple(sorted([rank, *g])) for g in gs]
        )
    )
    groups = [everyone, *subgroups]  # a subgroup may hold every rank: it is still not the default group
    selectors = st.one_of(st.none(), st.just("world"), st.sampled_from(groups).map(list))
    fault = st.builds(
        lambda kind, op, nth, group, optional: kind(rank, op, nth, group, optional=optional),
        st.sampled_from([Kill, Fail, Delay]),
        st.sampled_from(OPS),
        st.integers(1, 6),
        selectors,
        st.booleans(),
    )
    faults = draw(st.lists(fault, max_size=5))
    try:
        check_faults(faults, world_size)
    except InvalidArgument:  # two faults on the same (op, nth, group): refused before any run
        assume(False)
    calls = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, len(groups) - 1)), max_size=25))
    return rank, groups, faults, calls


def _matches(fault: Fault, op: str, group_index: int, members: tuple[int, ...]) -> bool:
    if fault.op != op:
        return False
    if fault.group is None:
        return True
    if fault.group == "world":
        return group_index == 0
    return tuple(fault.group) == members


def _model(
    faults: list[Fault], groups: list[tuple[int, ...]], calls: list[tuple[str, int]]
) -> tuple[list[Fault | None], dict[Fault, int], dict[Fault, Fault], Fault | None]:
    """What should happen: the fault fired at each call made, each fault's count of matching calls made,
    the faults whose call another took, and the Kill that ended the rank (no calls after it)."""
    seen = dict.fromkeys(faults, 0)
    fired_at: list[Fault | None] = []
    taken: dict[Fault, Fault] = {}
    for op, g in calls:
        due = []
        for f in faults:
            if _matches(f, op, g, groups[g]):
                seen[f] += 1
                if seen[f] == f.nth:
                    due.append(f)
        fired_at.append(due[0] if due else None)
        for other in due[1:]:
            taken[other] = due[0]
        if due and isinstance(due[0], Kill):
            return fired_at, seen, taken, due[0]
    return fired_at, seen, taken, None


def _play(tally: RankFaults, groups: list[tuple[int, ...]], calls: list[tuple[str, int]]) -> list[Fault | None]:
    """Feed the calls to the counter as a world does (stopping when a Kill fires: the rank is gone)."""
    out: list[Fault | None] = []
    for op, g in calls:
        members = list(reversed(groups[g]))  # the order a group lists its ranks in does not matter
        out.append(tally.hit(op, g == 0, members))
        if isinstance(out[-1], Kill):
            break
    return out


@given(scenarios())
def test_a_fault_fires_exactly_at_its_nth_matching_call(scenario: Any) -> None:
    rank, groups, faults, calls = scenario
    tally = RankFaults(faults, rank)
    got = _play(tally, groups, calls)
    fired_at, _, taken, killed_by = _model(faults, groups, calls)
    assert got == fired_at
    assert tally.fired == [f for f in fired_at if f is not None]
    assert len(set(tally.fired)) == len(tally.fired)  # no fault fires twice
    assert tally.taken == taken
    assert tally.killed_by == killed_by


@given(scenarios())
def test_never_fired_is_reported_iff_the_fault_did_not_fire(scenario: Any) -> None:
    rank, groups, faults, calls = scenario
    tally = RankFaults(faults, rank)
    _play(tally, groups, calls)
    fired_at, seen, taken, killed_by = _model(faults, groups, calls)
    fired = {f for f in fired_at if f is not None}
    expected = [f for f in faults if not f.optional and f not in fired]
    lines = tally.not_fired()
    assert [line.split(" never fired: ")[0] for line in lines] == [repr(f) for f in expected]
    for f, line in zip(expected, lines):
        why = line.split(" never fired: ", 1)[1]
        if f in taken:
            assert why.startswith(f"{taken[f]!r} fired at the same call"), line
        elif killed_by is not None:
            assert why.startswith(f"rank {rank} was killed first, by {killed_by!r}"), line
        else:
            assert seen[f] < f.nth  # never fired: fewer than nth matching calls came
            anywhere = sum(1 for op, _ in calls if op == f.op)
            if anywhere == 0:
                assert why.startswith(f"rank {rank} made no {f.op} call"), line
            else:
                made = re.match(rf"rank {rank} made (\d+) {f.op} calls? on (.+?)(?: \((\d+) on any group\))?$", why)
                assert made is not None, line
                assert int(made.group(1)) == seen[f]
                assert made.group(2) == describe_group(f.group)
                assert made.group(3) is None if f.group is None else int(made.group(3)) == anywhere
    error = not_fired_error([tally])
    assert (error is None) == (not expected)
    if error is not None:
        assert all(line in str(error) for line in lines)


@given(scenarios())
def test_a_fault_whose_nth_call_came_is_never_reported_unless_another_took_it(scenario: Any) -> None:
    """The other side of "iff": enough matching calls and no Kill before and no other fault at the call:
    it fired, and no text names it."""
    rank, groups, faults, calls = scenario
    tally = RankFaults(faults, rank)
    _play(tally, groups, calls)
    fired_at, seen, taken, _ = _model(faults, groups, calls)
    texts = tally.not_fired()
    for f in faults:
        if f in fired_at:
            assert seen[f] >= f.nth and f not in taken
            assert not any(t.startswith(f"{f!r} never fired") for t in texts)


# -- through the worlds ----------------------------------------------------------------------------------------
def play(ctx: Any, calls: list[tuple[str, list[int] | None]]) -> str:
    """Every rank makes ``calls`` in order: (op, None for the default group or a subgroup's ranks), only the
    members of a subgroup calling on it. Module level: the process world finds it by reference."""
    subgroups = {tuple(m): dist.new_group(m) for m in sorted({tuple(m) for _, m in calls if m is not None})}
    for op, members in calls:
        group = None if members is None else subgroups[tuple(members)]
        if members is not None and ctx.rank not in members:
            continue
        if op == "all_reduce":
            dist.all_reduce(torch.ones(2), group=group)
        elif op == "broadcast":
            dist.broadcast(torch.ones(2), src=0 if members is None else members[0], group=group)
        else:
            dist.barrier(group=group)
    return "done"


CALLS: list[tuple[str, list[int] | None]] = [
    ("all_reduce", None),
    ("broadcast", [0, 1]),
    ("all_reduce", [0, 1]),
    ("barrier", None),
    ("all_reduce", None),
    ("all_reduce", [1, 2]),
]


@pytest.mark.parametrize("world", ["threaded", "process"])
@pytest.mark.parametrize(
    ("fault", "made"),
    [
        (Delay(1, nth=4, seconds=0), "rank 1 made 4 all_reduce calls on any group"),  # fires at its last call
        (Delay(1, nth=5, seconds=0), "rank 1 made 4 all_reduce calls on any group"),
        (Delay(1, nth=2, group="world", seconds=0), "rank 1 made 2 all_reduce calls on group world (4 on any"),
        (Delay(1, nth=3, group="world", seconds=0), "rank 1 made 2 all_reduce calls on group world (4 on any"),
        (Delay(0, op="broadcast", nth=1, group=[0, 1], seconds=0), "rank 0 made 1 broadcast call on group [0, 1]"),
        (Delay(2, op="broadcast", seconds=0), "rank 2 made no broadcast call (its collectives: all_reduce x3, barr"),
        (Delay(2, op="barrier", nth=2, seconds=0), "rank 2 made 1 barrier call on any group"),
    ],
)
def test_the_worlds_count_as_the_counter_does(world: str, fault: Fault, made: str) -> None:
    """Each world fires the fault when its nth call comes, and reports the counter's count otherwise."""
    groups = [(0, 1, 2), (0, 1), (1, 2)]
    calls = [(op, 0 if m is None else groups.index(tuple(m))) for op, m in CALLS]
    mine = [(op, g) for op, g in calls if fault.rank in groups[g]]
    tally = RankFaults([fault], fault.rank)
    _play(tally, groups, mine)
    if tally.fired:
        assert dstest.run(play, 3, world=world, args=(CALLS,), faults=[fault], timeout=60.0) == ["done"] * 3
        return
    with pytest.raises(dstest.FaultNotFired) as info:
        dstest.run(play, 3, world=world, args=(CALLS,), faults=[fault], timeout=60.0)
    assert f"{fault!r} never fired: {made}" in str(info.value)
    assert tally.not_fired()[0] in str(info.value)  # the world's text is the counter's
