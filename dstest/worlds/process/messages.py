"""What travels between the parent and its workers: commands, replies, worker configurations, the tensor
metadata of the cross-rank check, and exceptions (pickled by the worker, rebuilt by the parent).

Everything here is pickled by reference across processes, so these names must stay importable from this
module (``dstest.worlds.process.messages``) in both the parent and the workers.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

STOP = b"stop"


# ------------------------------------------------------------------------------------------------------
# Messages between parent and workers
# ------------------------------------------------------------------------------------------------------


class FnRef(NamedTuple):
    """How a worker finds the function: ``module.qualname``, loaded from ``path`` if needed."""

    module: str
    qualname: str
    path: str | None
    rewrite_asserts: bool  # the parent's module was assertion-rewritten by pytest: do the same


class Command(NamedTuple):
    run_id: int
    ref: FnRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int
    setup: Any  # a picklable setup(ctx) to run on each rank before the function (RunRequest.setup), or None
    resets: tuple[str, ...] = ()  # dstest.resets references to call before the run, in order
    watch: tuple[str, ...] = ()  # module prefixes whose module-level state is put back after the run
    faults: tuple[Any, ...] = ()  # the run's injected faults (RunRequest.faults, contract G5)
    strict_shapes: bool = False  # shapes must be equal, not only element counts (part of a call's board digest)


class Reply(NamedTuple):
    run_id: int
    rank: int
    ok: bool
    result: bytes | None  # pickled return value (ok)
    traceback: str  # formatted traceback (not ok)
    exception: bytes | None  # pickled exception, if it pickles (not ok)
    output: str  # what the rank printed during the run (stdout and stderr, interleaved)
    unhealthy: str | None  # why this worker cannot serve another run (it destroyed the world group, ...)
    trace: Any = None  # the rank's collective records and totals (_trace.Recorder.export), gloo pools
    left_behind: tuple[str, ...] = ()  # module-level state the run changed in watched modules, put back
    faults: Any = None  # the rank's injected-fault counters at the end of the run (RankFaults), contract G5


@dataclass(frozen=True)
class PoolKey:
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    world_size: int


@dataclass(frozen=True)
class WorkerConfig:
    key: PoolKey
    rank: int
    world_name: str
    store_path: str
    log_path: str
    stack_path: str
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)
    board_path: str = ""  # the pool's check board (gloo pools where the machine has one), else ""


class RemoteRankError(Exception):
    """Stands in for an exception of a worker that did not survive pickling; the message keeps its type."""


class Dev(NamedTuple):
    type: str


class Meta(NamedTuple):
    """What the check needs of a tensor (dtype, shape, device type); pickles in microseconds."""

    dtype: Any
    shape: tuple[int, ...]
    device: Dev

    @classmethod
    def of(cls, t: Any) -> Meta:
        return cls(t.dtype, tuple(t.shape), Dev(t.device.type))

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dim(self) -> int:
        return len(self.shape)


def pickle_exception(exc: BaseException) -> bytes | None:
    outcome = _pytest_outcome(exc)
    try:
        return pickle.dumps(outcome or exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _pytest_outcome(exc: BaseException) -> tuple[str, str, str] | None:
    """pytest.skip/fail/xfail raise classes that claim to live in ``builtins`` and so do not pickle."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is None:
        return None
    for kind in ("Skipped", "XFailed", "Failed", "Exit"):
        cls = getattr(outcomes, kind, None)
        if cls is not None and isinstance(exc, cls):
            return ("pytest-outcome", kind, str(getattr(exc, "msg", None) or exc))
    return None


def unpickle_exception(rep: Reply) -> BaseException:
    if rep.exception is not None:
        try:
            exc = pickle.loads(rep.exception)
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            return exc
        if isinstance(exc, tuple) and len(exc) == 3 and exc[0] == "pytest-outcome":
            from _pytest import outcomes

            cls = getattr(outcomes, exc[1])
            outcome: BaseException = cls(exc[2]) if exc[1] != "Exit" else cls(exc[2], 1)
            return outcome
    last = rep.traceback.strip().splitlines()[-1] if rep.traceback.strip() else "unknown error"
    return RemoteRankError(last)
