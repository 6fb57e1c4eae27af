"""The process world's parent round trips (issue 44 item 4): what a rank's end of a run waits for.

A rank that ends a run tells the referee ("done") so that peers waiting for it are answered. It waits for
the referee's acknowledgement only while something it posted still waits for a verdict (the verdicts the
referee sends before the acknowledgement decide what the rank reports as unfinished); when everything it
posted was answered, no later message can change its end, and the round trip through the parent is saved.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time

import pytest

from dstest.worlds.process import checker as checker_module
from dstest.worlds.process.checker import Checker

pytestmark = pytest.mark.cpu


def _posted_and_answered(ck: Checker, parent: object) -> None:
    """One call posted by the rank, answered "ok" by a stand-in referee, and waited for."""
    rec = ck.post(("post", "0", (0, 1), 1, "call"), "all_reduce(...) on group world (seq 1)", lambda: None)
    msg = pickle.loads(parent.recv_bytes())  # type: ignore[attr-defined]
    assert msg[:3] == ("post", 1, rec.post_id)
    parent.send_bytes(pickle.dumps(("ok", 1, rec.post_id)))  # type: ignore[attr-defined]
    ck.wait_verdict(rec)


def test_a_rank_whose_calls_were_all_answered_ends_without_waiting_for_the_parent(monkeypatch):
    monkeypatch.setattr(checker_module, "_CHECK_ACK_S", 3.0)
    parent, child = multiprocessing.Pipe(duplex=True)
    ck = Checker(child, rank=0, world_size=2)
    ck.begin(1)
    _posted_and_answered(ck, parent)
    start = time.monotonic()
    error, unhealthy = ck.end(None)  # the stand-in referee never acknowledges
    took = time.monotonic() - start
    assert (error, unhealthy) == (None, None)
    assert took < 1.0, f"the end of the run waited {took:.2f} s for the parent"
    assert pickle.loads(parent.recv_bytes())[:3] == ("done", 1, True)  # the referee still hears of the end
    parent.close()


def test_a_rank_with_an_unanswered_call_still_waits_for_the_acknowledgement(monkeypatch):
    monkeypatch.setattr(checker_module, "_CHECK_ACK_S", 3.0)
    parent, child = multiprocessing.Pipe(duplex=True)
    ck = Checker(child, rank=0, world_size=2)
    ck.begin(1)
    rec = ck.post(("post", "0", (0, 1), 1, "call"), "all_reduce(...) on group world (seq 1)", lambda: None)
    pickle.loads(parent.recv_bytes())  # the post

    def referee() -> None:  # answers the post with an error, then acknowledges the end
        assert pickle.loads(parent.recv_bytes())[0] == "done"
        time.sleep(0.3)
        parent.send_bytes(pickle.dumps(("err", 1, rec.post_id, "mismatch", "rank 1 finished")))
        parent.send_bytes(pickle.dumps(("ack", 1)))

    import threading

    t = threading.Thread(target=referee)
    t.start()
    error, unhealthy = ck.end(None)
    t.join()
    assert unhealthy is None
    assert error is not None and "failed and was never waited: rank 1 finished" in str(error)
    parent.close()


def test_the_referee_acknowledges_an_end_only_when_the_rank_waits_for_it():
    from dstest.worlds.process.referee import Referee

    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    referee = Referee(1, 2, [worker_side for worker_side, _ in pipes])
    referee.handle(0, pickle.dumps(("done", 1, True, "", False)))  # nothing left to answer: no ack wanted
    referee.handle(1, pickle.dumps(("done", 1, True, "", True)))
    assert not pipes[0][1].poll(0.2), "an acknowledgement nobody waits for was sent (a write and a wake-up per rank)"
    assert pickle.loads(pipes[1][1].recv_bytes()) == ("ack", 1)


def test_the_end_message_says_whether_the_rank_waits_for_the_acknowledgement(monkeypatch):
    monkeypatch.setattr(checker_module, "_CHECK_ACK_S", 0.2)
    parent, child = multiprocessing.Pipe(duplex=True)
    ck = Checker(child, rank=0, world_size=2)
    ck.begin(1)
    _posted_and_answered(ck, parent)
    ck.end(None)
    assert pickle.loads(parent.recv_bytes()) == ("done", 1, True, "", False)
    ck.begin(2)
    ck.post(("post", "0", (0, 1), 1, "call"), "all_reduce(...) on group world (seq 1)", lambda: None)
    pickle.loads(parent.recv_bytes())
    ck.end(None)  # unanswered: waits for the acknowledgement
    assert pickle.loads(parent.recv_bytes()) == ("done", 2, True, "", True)
    parent.close()


def test_a_runs_torch_seed_formats_no_stack_where_no_accelerator_can_come_up(monkeypatch):
    """torch.manual_seed queues a seed for each accelerator module not yet initialised, formatting the
    caller's stack for each (cuda, xpu, mtia: 0.3-0.7 ms a run on every rank, most of an empty spec's CPU);
    where no accelerator is available those seeds could never be applied. The CPU generator is seeded as
    torch.manual_seed seeds it."""
    import traceback

    import torch

    from dstest.worlds.process.worker import seed_torch

    if torch.accelerator.is_available():
        pytest.skip("an accelerator is available: torch.manual_seed is called as it is")
    formatted = []
    original = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: formatted.append(1) or original(*a, **k))
    seed_torch(1234)
    assert formatted == [], f"the seed formatted the stack {len(formatted)} times"
    assert torch.initial_seed() == 1234
    assert torch.equal(torch.randn(5), torch.randn(5, generator=torch.Generator().manual_seed(1234)))
