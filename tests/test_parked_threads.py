"""Parked threads (issue 44, the start of large cold worlds): a thread that served a rank in one cold run serves
a rank of the next as a new thread would. Nothing a rank left on its thread in run N (``threading.local``
values, context variables, rank hooks, its generator's draws, its groups, grad mode, a torch mode left
entered) is seen by the rank that thread serves in run N+1."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dstest.worlds import torch_internals
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld, parked

pytestmark = pytest.mark.cpu

W = parked.PARK_FROM

_LOCAL = threading.local()
_VAR: contextvars.ContextVar[int | None] = contextvars.ContextVar("dstest_parked_test", default=None)


@pytest.fixture(autouse=True)
def _parking(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parked threads are opt-in; each test ends them."""
    monkeypatch.setenv("DSTEST_PARKED_THREADS", "16384")
    yield
    parked.shutdown_parked()


def cold(body: Any) -> list[Any]:
    return ThreadedWorld(warm=False).run(RunRequest(body, W, timeout=120))


def _leave_state(ctx: Any) -> int:
    """Run N: leave behind every kind of state a rank keeps on its thread."""
    _LOCAL.rank = ctx.rank
    _VAR.set(ctx.rank)
    torch.nn.modules.module.register_module_forward_hook(lambda *args: None)  # a rank hook never removed
    torch.manual_seed(1000 + ctx.rank)
    torch.randn(5)
    dist.new_group(list(range(ctx.world_size)))
    torch.set_grad_enabled(False)
    return threading.current_thread()


def _probe(ctx: Any) -> dict[str, Any]:
    """Run N+1: what the rank finds on its thread."""
    linear = torch.nn.Linear(2, 2)
    return {
        "thread": threading.current_thread(),
        "local": getattr(_LOCAL, "rank", None),
        "var": _VAR.get(),
        "hooks": len(torch.nn.modules.module._global_forward_hooks),
        "draw": torch.randn(5),
        "init": linear.weight.detach().clone(),
        "groups": sorted(c10d._world.pg_names.values()),
        "group_count": c10d._world.group_count,
        "grad": torch.is_grad_enabled(),
        "state": torch_internals.thread_state(),
    }


def _fresh_probe(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What a rank finds on a new thread: the probe run with no thread parked or reused."""
    parked.shutdown_parked()
    with monkeypatch.context() as m:
        m.setenv("DSTEST_PARKED_THREADS", "0")
        found = cold(_probe)
    assert parked.parked_threads() == 0
    return found


def _same(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    differ = []
    for key, value in want.items():
        if key == "thread":
            continue
        other = got[key]
        equal = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
        if not equal:
            differ.append(f"{key}: {other!r} (a new thread: {value!r})")
    return differ


def test_a_reused_thread_starts_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _fresh_probe(monkeypatch)
    threads = set(cold(_leave_state))
    assert parked.parked_threads() >= W  # run N's threads are parked ...
    found = cold(_probe)
    assert {f["thread"] for f in found} <= threads  # ... and run N+1 ran on them
    problems = {r: _same(got, want) for r, (got, want) in enumerate(zip(found, fresh))}
    assert {r: p for r, p in problems.items() if p} == {}
    assert [t.name for t in threading.enumerate() if t.name.startswith("dstest-rank")] == []


def test_a_dirty_reuse_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe sees what a thread reused without being cleaned keeps: run N's values in run N+1 (so the
    test above fails on a dirty reuse)."""
    fresh = _fresh_probe(monkeypatch)
    monkeypatch.setattr(parked, "_as_new_thread", lambda task: task())
    monkeypatch.setattr(torch_internals, "clear_thread_locals", lambda: None)
    cold(_leave_state)
    found = cold(_probe)
    problems = [p.split(":")[0] for got, want in zip(found, fresh) for p in _same(got, want)]
    assert {"local", "var"} <= set(problems)
    assert [f["local"] for f in found] != [None] * W


def test_a_thread_left_in_a_torch_mode_is_not_reused() -> None:
    """What cannot be put back (a torch-function mode a body entered and never left) ends the thread."""

    def leave_mode(ctx: Any) -> int:
        if ctx.rank == 0:
            torch.overrides.TorchFunctionMode().__enter__()
        return threading.current_thread()

    threads = cold(leave_mode)
    found = cold(_probe)
    assert threads[0] not in {f["thread"] for f in found}
    assert {f["thread"] for f in found} >= set(threads[1:])  # the others were reused
    threads[0].join(5)
    assert not threads[0].is_alive()
    assert all(f["state"] == found[1]["state"] for f in found)


def test_parked_threads_are_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSTEST_PARKED_THREADS")
    threads = cold(lambda ctx: threading.current_thread())
    assert parked.parked_threads() == 0
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_parked_thread_cap_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSTEST_PARKED_THREADS", "many")
    with pytest.raises(Exception, match="DSTEST_PARKED_THREADS='many' must be an int >= 0"):
        parked.parked_thread_cap()
