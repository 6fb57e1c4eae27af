"""The checking core (``dstest.worlds.core``): one place for the rules both simulated worlds enforce.

The threaded world's rendezvous and the process world's referee both drive :mod:`dstest.worlds.core.matching`
and :mod:`dstest.worlds.core.rank_states`, and both worlds' process groups are made from the c10d table of :mod:`dstest.worlds.core.c10d`, so the same
wrong program must fail with the same error, word for word, in both worlds. These tests run each program
in both and compare every failing rank's error; and they import the core with torch blocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import CollectiveMismatch, InvalidArgument, RankFailure
from dstest.worlds.core import c10d, matching, rank_states
from dstest.worlds.core.faults import Kill, killed_phrase

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]


# -- programs that are wrong in every world --------------------------------------------------------------
def gather_into_wrong_size(ctx: Any) -> None:
    """all_gather_into_tensor whose output on rank 1 is not group size x input (the size check)."""
    inp = torch.ones(3)
    out = torch.empty(6 if ctx.rank == 0 else 5)
    dist.all_gather_into_tensor(out, inp)


def gather_different_inputs(ctx: Any) -> None:
    """all_gather_into_tensor whose ranks bring inputs of different sizes (the cross-rank signature)."""
    if ctx.rank == 1:
        time.sleep(0.3)  # rank 0's call is the first: the message names it first in both worlds
    n = 2 + ctx.rank
    dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(n))


def skips_a_collective(ctx: Any) -> None:
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2))


def receive_from_each_other(ctx: Any) -> None:
    dist.recv(torch.empty(2), src=1 - ctx.rank)


def send_other_size(ctx: Any) -> None:
    if ctx.rank == 0:
        dist.send(torch.ones(2), dst=1)
    else:
        dist.recv(torch.empty(3), src=0)


def _errors(fn: Any, world: str) -> dict[int, tuple[str, str]]:
    with pytest.raises(RankFailure) as info:
        dstest.run(fn, 2, world=world, timeout=30.0)
    return {r: (type(e).__name__, str(e)) for r, e in sorted(info.value.exceptions.items())}


@pytest.mark.parametrize(
    ("fn", "kind", "words"),
    [
        (gather_into_wrong_size, InvalidArgument, "output has 5 elements, expected group size 2 x input 3"),
        (gather_different_inputs, CollectiveMismatch, "collective mismatch on group world (seq 1): rank 0 called"),
        (skips_a_collective, CollectiveMismatch, "rank 1 finished its function without joining all_reduce"),
        (receive_from_each_other, CollectiveMismatch, "deadlock: every rank still running waits"),
        (send_other_size, CollectiveMismatch, "point-to-point mismatch on group world: rank 0 called send("),
    ],
)
def test_the_same_wrong_program_fails_with_the_same_text_in_both_worlds(fn: Any, kind: type, words: str) -> None:
    threaded, process = _errors(fn, "threaded"), _errors(fn, "process")
    if fn is gather_into_wrong_size:  # rank 0 is left waiting for a rank that failed: the worlds word it apart
        threaded, process = {1: threaded[1]}, {1: process[1]}
    assert threaded == process
    assert all(name == kind.__name__ for name, _ in threaded.values()), threaded
    assert any(words in text for _, text in threaded.values()), threaded


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_the_size_check_of_all_gather_into_tensor_holds_in_each_world(world: str) -> None:
    """The check lives once (``SingleTensorCall._check_scaled``); each world must apply it."""
    name, text = _errors(gather_into_wrong_size, world)[1]
    assert name == "InvalidArgument"
    assert text == "all_gather_into_tensor: output has 5 elements, expected group size 2 x input 3 = 6"


def test_the_core_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import dstest.worlds.core\n"
        "from dstest.worlds.core import c10d, matching, rank_states\n"
        "assert not [m for m, v in sys.modules.items() if m.startswith('torch') and v], 'torch was imported'\n"
        "print(len(c10d.METHODS), matching.FINISHED)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "finished its function" in done.stdout


# -- the core alone, with stand-ins for Calls (no torch, no world) ----------------------------------------
class _Call:
    def __init__(self, group_rank: int, n: int) -> None:
        self.group_rank, self.n = group_rank, n

    def describe(self) -> str:
        return f"op(n={self.n})"

    def key(self) -> tuple[Any, ...]:
        return ("op", self.n)

    def check_peer(self, first: Any) -> str | None:
        return None if first.n == self.n else "different n"

    def check_all(self, calls: Any) -> str | None:
        return None


def test_an_exchange_matches_by_the_first_call_and_names_both() -> None:
    ex = matching.Exchange((0, 2), "1 [0, 2]", 4)
    assert ex.join(_Call(1, 3)) is None
    why = ex.join(_Call(0, 5))
    assert why == (
        "collective mismatch on group 1 [0, 2] (seq 4): rank 2 called op(n=3) but rank 0 called op(n=5) (different n)"
    )
    assert ex.waiting_for() == [0] and ex.left({0}) == 0
    assert ex.left_text(0).startswith("rank 0 finished its function without joining op(n=3) on group 1 [0, 2]")


def test_rank_states_name_how_each_rank_left() -> None:
    """A call that needs a gone rank fails by how it left: a mismatch (finished), an abort (failed), or a
    backend error (killed, from the moment the fault fires, before the rank has unwound)."""
    states = rank_states.RankStates(4)
    assert states.leave(0) == (rank_states.LEFT, matching.FINISHED)
    assert states.leave(1, ok=False, summary="ValueError: boom") == (rank_states.FAILED, "failed (ValueError: boom)")
    kill = Kill(2, "all_reduce", 3)
    states.kill(2, kill)
    assert states.how(2) == (rank_states.KILLED, killed_phrase(kill)) and 2 not in states.left
    assert states.leave(2, ok=False) == (rank_states.KILLED, killed_phrase(kill))
    assert states.left == {0: matching.FINISHED, 1: "failed (ValueError: boom)", 2: killed_phrase(kill)}


def test_rank_states_name_a_killed_member_as_the_cause() -> None:
    """Of the members of a collective that left without joining it, a killed one is named first."""
    states = rank_states.RankStates(3)
    ex = matching.Exchange((0, 1, 2), "world", 1)
    ex.join(_Call(2, 1))
    assert states.gone_from(ex) is None
    states.leave(0)
    assert states.gone_from(ex) == 0
    states.kill(1, Kill(1))
    assert states.gone_from(ex) == 1


def test_rank_states_see_a_deadlock_only_when_no_rank_runs() -> None:
    states = rank_states.RankStates(3)
    states.wait(0, "post 7")
    states.leave(1)
    assert not states.everyone_waits()  # rank 2 still runs and may post what rank 0 waits for
    states.wait(2, "post 9")
    assert states.everyone_waits()
    text = states.deadlock_text(lambda rank, what: (f"{what} of rank {rank}", [1] if rank == 0 else [0]))
    assert text == matching.deadlock_text(
        {0: ("post 7 of rank 0", [1]), 2: ("post 9 of rank 2", [0])}, {1: matching.FINISHED}
    )
    states.stop_waiting(2, "post 8")  # not what rank 2 waits in: it still waits
    assert states.everyone_waits()
    states.stop_waiting(2, "post 9")
    assert not states.everyone_waits()


def test_every_c10d_method_of_the_table_is_on_both_groups() -> None:
    from dstest.worlds.process.checked_group import CheckedGroup
    from dstest.worlds.threaded.group import Group

    names = [m.name for m in c10d.METHODS] + list(c10d.ALIASES)
    for cls in (Group, CheckedGroup):
        assert all(getattr(cls, n).__name__ in names for n in names), cls
    assert Group.recv_anysource is CheckedGroup.recv_anysource  # one refusal, one text
