"""The fault trigger's details that mutation testing showed no fast test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/worlds/core/faults.py`` runs mutmut over :mod:`dstest.worlds.core.faults` with
the trigger's properties (tests/test_checker_properties_faults.py), the pure tests of tests/test_faults.py and
this file. Each test here states what contract G5 promises a user reads or gets (a fault quoted as it was
written, the call it fires at, the text of a fault that never fired, the bounds of a setting) and fails for at
least one mutant that survived them. Pure: the counter and the texts are driven directly; the worlds use the
same functions (tests/test_faults.py runs them end to end).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from dstest.errors import InvalidArgument
from dstest.worlds.core.faults import (
    Delay,
    Fail,
    Kill,
    Killed,
    RankFaults,
    check_faults,
    failed_text,
    killed_phrase,
    not_fired_error,
    not_fired_note,
    plan_for,
)

pytestmark = pytest.mark.cpu


# -- faults as written, and the call they name -----------------------------------------------------------------
def test_a_fault_is_quoted_as_written_without_the_defaults_left_out() -> None:
    assert repr(Kill(1)) == "Kill(rank=1, op='all_reduce', nth=1)"
    assert repr(Fail(0, op="broadcast", nth=2, group=[2, 0], optional=True)) == (
        "Fail(rank=0, op='broadcast', nth=2, group=[0, 2], optional=True)"
    )
    assert repr(Delay(1, group="world", seconds=0.5)) == "Delay(rank=1, op='all_reduce', nth=1, group='world', seconds=0.5)"
    assert repr(Killed(1, "all_reduce #3 on group world")) == "Killed(rank=1, at='all_reduce #3 on group world')"


def test_the_call_a_fault_names_is_described_with_its_group() -> None:
    assert Kill(1, nth=3, group="world").at() == "all_reduce #3 on group world"
    assert Fail(0, group=[1, 0]).at() == "all_reduce #1 on group [0, 1]"
    assert Kill(1).describe() == "Kill(rank 1 at its all_reduce #1 on any group)"
    assert Delay(0, seconds=2).describe() == "Delay(2 s, rank 0 at its all_reduce #1 on any group)"
    assert killed_phrase(Kill(1, nth=2)) == "was killed by an injected fault (dstest Kill at its all_reduce #2 on any group)"
    assert failed_text(Fail(0, op="broadcast", group="world"), "group world") == (
        "injected fault: rank 0's broadcast on group world failed (dstest Fail at its broadcast #1 on group world), "
        "as a backend reports a collective whose peer is gone"
    )


# -- settings: their bounds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", [0, 0.0, 3600, 3600.0, 1e-9])
def test_a_delay_of_0_to_3600_seconds_is_taken(seconds: float) -> None:
    assert Delay(0, seconds=seconds).seconds == seconds


@pytest.mark.parametrize("seconds", [-1e-9, 3600.5, math.inf, math.nan, True, "1"])
def test_a_delay_outside_0_to_3600_seconds_is_refused_naming_the_value(seconds: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        Delay(0, seconds=seconds)
    assert str(info.value) == f"Delay(seconds={seconds!r}): seconds must be a finite number between 0 and 3600"


def test_faults_on_the_last_rank_of_the_world_are_taken_and_beyond_it_refused() -> None:
    assert check_faults([Kill(2), Fail(2, group=[0, 2])], 3) == (Kill(2), Fail(2, group=[0, 2]))
    with pytest.raises(InvalidArgument) as info:
        check_faults([Kill(0, group=[0, 3])], 3)
    assert str(info.value) == (
        "Kill(rank=0, op='all_reduce', nth=1, group=[0, 3]): group [0, 3] must hold rank 0 and only ranks of a "
        "world of 3"
    )
    with pytest.raises(InvalidArgument) as info:
        check_faults([Kill(3)], 3)
    assert str(info.value) == "Kill(rank=3, op='all_reduce', nth=1): rank 3 is not a rank of a world of 3 (0..2)"


def test_one_fault_alone_is_a_list_of_one_and_the_world_size_may_be_left_out() -> None:
    assert check_faults(Kill(0)) == (Kill(0),)
    assert check_faults([Kill(7)]) == (Kill(7),)  # no world size: any rank
    with pytest.raises(InvalidArgument) as info:
        check_faults([Kill(0), Fail(0)])
    assert str(info.value) == (
        "faults: Kill(rank=0, op='all_reduce', nth=1) and Fail(rank=0, op='all_reduce', nth=1) fire at the same "
        "call; give one fault per call"
    )


# -- the counter -------------------------------------------------------------------------------------------------
def test_a_rank_no_fault_names_has_no_counter() -> None:
    assert plan_for([Kill(1)], 0) is None
    tally = plan_for([Kill(1), Fail(0, op="broadcast")], 1)
    assert tally is not None and tally.rank == 1 and tally.faults == [Kill(1)]


def test_a_fault_on_a_group_counts_only_the_calls_on_exactly_its_ranks() -> None:
    tally = RankFaults([Fail(0, nth=2, group=[0, 2])], 0)
    assert tally.hit("all_reduce", False, [0, 1, 2]) is None  # another group
    assert tally.hit("all_reduce", False, [2, 0]) is None  # its 1st
    assert tally.hit("all_reduce", True, [0, 1]) is None  # the default group
    assert tally.hit("all_reduce", False, [0, 2]) == Fail(0, nth=2, group=[0, 2])


# -- faults that never fired: the texts ----------------------------------------------------------------------------
def test_never_fired_names_the_calls_the_rank_made_of_that_op_and_of_the_others() -> None:
    tally = RankFaults([Kill(0, op="broadcast"), Fail(0, nth=3, group="world")], 0)
    tally.hit("all_reduce", True, [0, 1, 2])
    tally.hit("all_reduce", False, [1, 0])
    tally.hit("barrier", True, [0, 1, 2])
    lines = [
        "Kill(rank=0, op='broadcast', nth=1) never fired: rank 0 made no broadcast call "
        "(its collectives: all_reduce x2, barrier x1)",
        "Fail(rank=0, op='all_reduce', nth=3, group='world') never fired: rank 0 made 1 all_reduce call on group "
        "world (2 on any group)",
    ]
    assert tally.not_fired() == lines
    error = not_fired_error([tally, None])
    assert error is not None and str(error) == (
        "2 injected faults never fired, so the run did not test what it injects:\n  "
        + "\n  ".join(lines)
        + "\nName a call the code makes (op, nth, group), or give the fault optional=True if it is meant to fire "
        "only in some runs."
    )
    assert not_fired_note([None, tally]) == "\ninjected faults that never fired: " + "; ".join(lines)


def test_never_fired_counts_calls_in_the_plural_only_when_not_one() -> None:
    tally = RankFaults([Fail(1, nth=5)], 1)
    for _ in range(2):
        tally.hit("all_reduce", True, [0, 1])
    assert tally.not_fired() == ["Fail(rank=1, op='all_reduce', nth=5) never fired: rank 1 made 2 all_reduce calls on any group"]
    once = RankFaults([Fail(1, nth=5)], 1)
    once.hit("all_reduce", True, [0, 1])
    assert once.not_fired() == ["Fail(rank=1, op='all_reduce', nth=5) never fired: rank 1 made 1 all_reduce call on any group"]


def test_one_fault_never_fired_is_named_alone_and_a_rank_with_no_call_says_so() -> None:
    error = not_fired_error([RankFaults([Kill(1, nth=2)], 1)])
    assert error is not None and str(error).startswith(
        "an injected fault never fired, so the run did not test what it injects:\n"
        "  Kill(rank=1, op='all_reduce', nth=2) never fired: rank 1 made no all_reduce call (nor any other collective)\n"
    )
    assert not_fired_error([None]) is None and not_fired_note([None]) == ""


def test_never_fired_lists_the_ranks_in_order_and_leaves_optional_faults_out() -> None:
    late, early = RankFaults([Kill(2, op="broadcast")], 2), RankFaults([Kill(0, op="broadcast", optional=True)], 0)
    assert early.not_fired() == []
    first = RankFaults([Fail(1, op="barrier")], 1)
    error = not_fired_error([late, first, early])
    assert error is not None
    text = str(error)
    assert text.startswith("2 injected faults never fired")
    assert text.index("Fail(rank=1") < text.index("Kill(rank=2") and "Kill(rank=0" not in text


def test_a_fault_after_the_kill_of_its_rank_names_the_kill() -> None:
    tally = RankFaults([Kill(0, nth=1), Fail(0, op="broadcast")], 0)
    assert tally.hit("all_reduce", True, [0, 1]) == Kill(0)
    assert tally.not_fired() == [
        "Fail(rank=0, op='broadcast', nth=1) never fired: rank 0 was killed first, by "
        "Kill(rank=0, op='all_reduce', nth=1) at its all_reduce #1 on any group"
    ]


def test_a_fault_on_a_group_the_rank_never_called_on_counts_0_calls_there() -> None:
    tally = RankFaults([Fail(0, group="world")], 0)
    tally.hit("all_reduce", False, [0, 1])  # on a subgroup only
    assert tally.not_fired() == [
        "Fail(rank=0, op='all_reduce', nth=1, group='world') never fired: rank 0 made 0 all_reduce calls on group "
        "world (1 on any group)"
    ]


# -- a fault's settings: each refusal in full (G5: a bad fault is refused naming the setting, the value and what is
# allowed, before anything starts)
_GROUP_HELP = "group must be None (any group), 'world' (the default group) or a list of the group's global ranks"
_RANKS_HELP = "a group is given by its global ranks, ints >= 0, at least one"


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"rank": -1}, "Kill(rank=-1): rank must be an int >= 0 (a global rank of the world)"),
        ({"rank": True}, "Kill(rank=True): rank must be an int >= 0 (a global rank of the world)"),
        ({"rank": 1.0}, "Kill(rank=1.0): rank must be an int >= 0 (a global rank of the world)"),
        ({"rank": 0, "nth": 0}, "Kill(nth=0): nth must be an int >= 1 (the rank's 1st, 2nd... call of op)"),
        ({"rank": 0, "nth": True}, "Kill(nth=True): nth must be an int >= 1 (the rank's 1st, 2nd... call of op)"),
        ({"rank": 0, "nth": 1.5}, "Kill(nth=1.5): nth must be an int >= 1 (the rank's 1st, 2nd... call of op)"),
        ({"rank": 0, "nth": "2"}, "Kill(nth='2'): nth must be an int >= 1 (the rank's 1st, 2nd... call of op)"),
        ({"rank": 0, "group": "tp"}, f"Kill(group='tp'): {_GROUP_HELP}"),
        ({"rank": 0, "group": b"\x00"}, f"Kill(group=b'\\x00'): {_GROUP_HELP}"),
        ({"rank": 0, "group": 0}, f"Kill(group=0): {_GROUP_HELP}"),
        ({"rank": 0, "group": {0, 1}}, f"Kill(group={{0, 1}}): {_GROUP_HELP}"),
        ({"rank": 0, "group": []}, f"Kill(group=[]): {_RANKS_HELP}"),
        ({"rank": 0, "group": [0, -1]}, f"Kill(group=[0, -1]): {_RANKS_HELP}"),
        ({"rank": 0, "group": [0, True]}, f"Kill(group=[0, True]): {_RANKS_HELP}"),
        ({"rank": 0, "group": [0, 1.0]}, f"Kill(group=[0, 1.0]): {_RANKS_HELP}"),
        (
            {"rank": 0, "optional": 1},
            "Kill(optional=1): optional must be True or False (True: the fault may not "
            "fire in a run, and the run passes all the same)",
        ),
    ],
)
def test_a_bad_setting_of_a_fault_is_refused_naming_it_the_value_and_what_is_allowed(
    kwargs: dict[str, Any], text: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        Kill(**kwargs)
    assert str(info.value) == text


def test_a_fault_takes_ints_from_its_bounds_and_a_group_as_any_sequence_of_ranks() -> None:
    assert Kill(0, nth=1).nth == 1
    assert Fail(0, group=(2, 0)).group == (0, 2)
    assert Fail(0, group=range(2)).group == (0, 1)
    assert Delay(0, group="world").group == "world"
    assert Kill(0, optional=True).optional is True
