"""What each participant of a run posts (:class:`Outcome`), and what every rank makes of all of them: the
results, or the one error every rank raises alike (built from the posted outcomes only)."""

from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any

from dstest.errors import RankFailure, WorldAborted, WorldTimeout
from dstest.worlds.launched.connection import Launch

__all__ = ["FORM_TIMEOUT_S", "REPORT_GRACE_S", "Outcome", "combine", "failure", "form_limit"]

#: Seconds a rank waits past a run's timeout for a peer's outcome before naming it silent.
REPORT_GRACE_S = 10.0

#: Seconds a run's group may take to form (every participant reaches the spec and connects) at the least; the
#: run's timeout, which bounds its body, starts once it has formed.
FORM_TIMEOUT_S = 60.0


def form_limit(timeout: float) -> float:
    """How long a run's group may take to form: :data:`FORM_TIMEOUT_S`, or the run's timeout plus
    :data:`REPORT_GRACE_S` where that is longer."""
    return max(FORM_TIMEOUT_S, timeout + REPORT_GRACE_S)


@dataclass(frozen=True, repr=False)
class Outcome:
    """What a participant posts for a run: ``ok`` with its pickled result, or its traceback and exception."""

    rank: int
    ok: bool
    result: bytes | None = None
    traceback: str = ""
    exception: bytes | None = None
    kind: str = "failed"  # failed | timeout | aborted

    def __repr__(self) -> str:
        return f"<rank {self.rank}: {'ok' if self.ok else self.kind}>"


def failure(rank: int, exc: BaseException, kind: str, note: str = "") -> Outcome:
    from dstest.worlds.process.messages import pickle_exception

    text = note + "".join(traceback.format_exception(exc))
    return Outcome(rank, False, traceback=text, exception=pickle_exception(exc), kind=kind)


def _exception_of(outcome: Outcome) -> BaseException:
    from dstest.worlds.process.messages import Reply, unpickle_exception

    if outcome.kind != "failed":
        return WorldAborted(outcome.traceback.splitlines()[0] if outcome.traceback else outcome.kind)
    reply = Reply(0, outcome.rank, False, None, outcome.traceback, outcome.exception, "", None)
    return unpickle_exception(reply)


def combine(launch: Launch, key: str, world_size: int, timeout: float, label: str, *, took_part: bool) -> list[Any]:
    """Every participant's outcome of the run (waited for on every rank): the results, or one error.

    The error is built from the posted outcomes only, so every rank raises the same one (and pytest, which
    hides these frames, shows the same report on every rank). A participant asks once its own run ended,
    after the group formed on every participant alike, so the others' bodies end within the timeout; a rank
    outside the run (``took_part`` False) asks from the run's start, so it also waits out the group's
    forming (:func:`form_limit`).
    """
    __tracebackhide__ = True
    limit = timeout + REPORT_GRACE_S + (0.0 if took_part else form_limit(timeout))
    deadline = time.monotonic() + limit
    keys = [key + f"out/{r}" for r in range(world_size)]
    missing = launch.wait_for(keys, deadline)
    outcomes: dict[int, Outcome] = {}
    for r in range(world_size):
        if keys[r] in missing:
            continue
        outcome = pickle.loads(launch.get(keys[r]))
        outcomes[r] = outcome
    silent = {
        r: (
            f"rank {r} posted no outcome within {limit:g} s (the run's timeout plus {REPORT_GRACE_S:g} s"
            f"{'' if took_part else ', after its group had time to form'}): its process is stuck outside "
            "Python or gone; no stack"
        )
        for r in range(world_size)
        if keys[r] in missing
    }
    for r in silent:
        launch.lost[r] = f"rank {r} went silent in a run"
    return _results_or_error(outcomes, silent, world_size, timeout, label)


def _results_or_error(
    outcomes: dict[int, Outcome], silent: dict[int, str], world_size: int, timeout: float, label: str
) -> list[Any]:
    __tracebackhide__ = True
    bad = {r: o for r, o in outcomes.items() if not o.ok}
    if not bad and not silent:
        return [pickle.loads(outcomes[r].result or b"") for r in range(world_size)]
    failed = {r: o for r, o in bad.items() if o.kind == "failed"}
    hung = {r: o.traceback for r, o in bad.items() if o.kind == "timeout"} | silent
    if not failed and hung:
        stacks = {r: text for r, text in sorted(hung.items())}
        raise WorldTimeout(
            f"{label} ran past its timeout of {timeout:g} s; ranks still running: {sorted(hung)}\n"
            + "\n".join(f"---- rank {r} ----\n{text}" for r, text in stacks.items()),
            stacks,
        )
    exceptions = {r: _exception_of(o) for r, o in bad.items()} | {r: WorldAborted(t) for r, t in silent.items()}
    primary = sorted(failed) or sorted(exceptions)
    consequences = sorted(set(exceptions) - set(primary))
    tracebacks = {r: o.traceback for r, o in bad.items()} | silent
    head = "; ".join(f"rank {r}: {type(exceptions[r]).__name__}: {exceptions[r]}".splitlines()[0] for r in primary)
    body = "\n".join(f"---- rank {r} ----\n{tracebacks[r]}" for r in primary)
    tail = "".join(f"\n---- rank {r} (stopped) ----\n{tracebacks[r]}" for r in consequences)
    raise RankFailure(
        f"{len(primary)} of {world_size} ranks failed in the {label}: {head}\n{body}{tail}",
        dict(sorted(tracebacks.items())),
        dict(sorted(exceptions.items())),
    )
