"""One exception hierarchy for dstest.

User-facing errors also subclass the builtin that fits, so ``except ValueError`` keeps working.
Internal control flow (unwinding a rank whose world was aborted) uses a ``BaseException`` subclass so
that user code with a broad ``except Exception`` cannot swallow it.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatch",
    "Deviation",
    "DstestError",
    "FaultNotFired",
    "ForkServerSkipped",
    "InvalidArgument",
    "InvalidSpec",
    "InvalidWorldSize",
    "RankFailure",
    "ReplicasDiverge",
    "StateLeftBehind",
    "UnfinishedWork",
    "UnguardedMain",
    "UnknownFeature",
    "WorkAborted",
    "WorkerDied",
    "WorldAborted",
    "WorldTimeout",
]


class DstestError(Exception):
    """Root of every error dstest raises on purpose."""


class InvalidArgument(DstestError, ValueError):
    """An argument has a value dstest does not accept; the message names it and what is allowed."""


class InvalidWorldSize(InvalidArgument):
    """A world size that a world cannot run (``world_size=0``, more ranks than GPUs, ...)."""


class InvalidSpec(InvalidArgument):
    """A spec body dstest cannot run as written: a generator or ``async def`` function (calling it would run
    nothing), or a method that does not take ``self`` first. The message says what to write instead.
    """


class UnknownFeature(InvalidArgument):
    """A spec asked a target about a feature that is not one of ``dstest.targets.FEATURES`` (a typo in the
    spec, not a gap of the target); the message lists the allowed names."""


class CollectiveMismatch(DstestError, RuntimeError):
    """Ranks issued collectives that cannot match (op, shape, dtype, group, root or count).

    Raised on every rank involved; the message names both ranks and both calls.
    """


class RankFailure(DstestError, AssertionError):
    """One or more ranks of a world raised; carries every failing rank's traceback.

    Subclasses AssertionError so that pytest reports a failed spec as a failure, not an error.
    """

    def __init__(
        self, message: str, failures: dict[int, str], exceptions: dict[int, BaseException] | None = None
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.exceptions = exceptions or {}


class WorldTimeout(DstestError, TimeoutError):
    """A world ran past its timeout; the message holds the stack of every rank."""

    def __init__(self, message: str, stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stacks = stacks


class UnfinishedWork(CollectiveMismatch):
    """A rank finished its function with async work that no rank matched, or that it never waited."""


class UnguardedMain(DstestError, RuntimeError):
    """A script starts the process world at module level without an ``if __name__ == "__main__":`` guard.

    Worker processes import the main script to find its functions; the unguarded call would run again
    in each of them. The message says where, and to move the call under the guard.
    """


class WorkAborted(DstestError, RuntimeError):
    """What a future handed out by ``Work.get_future()`` raises when its world was aborted or timed out.

    torch futures take ``Exception`` subclasses only; the world's own report names the first real error.
    """


class WorldsDiverge(DstestError, AssertionError):
    """The same body gave different per-rank results or collective traces on two worlds (``dstest.crosscheck``)."""


class ReplicasDiverge(DstestError, AssertionError):
    """Tensors that must be identical on every rank of a group differ (G4, ``ctx.assert_replicas``).

    Raised on every rank of the group with the same message: the first tensor that differs, the ranks grouped
    by value, the largest absolute difference and where, its dtype and shape.
    """


class StateLeftBehind(UserWarning):
    """A run changed module-level state of a watched package in a warm worker (``RunRequest.watch_modules``):
    a fresh process would not have seen it in the next test. dstest put it back; the message names each
    ``module.name`` and what was done. A finding about the code under test, not a failure."""


class ForkServerSkipped(UserWarning):
    """A module the session's collection imported initialized CUDA when the process world's fork server
    imported it too (:mod:`dstest._fork_server_modules`). Workers forked from a process that initialized CUDA
    cannot use it, so the server was started again with its own preloads only, and each worker imports that
    module (and what the collection imported after it) at its first test, as before. A finding about the
    module: it asks for a device when imported, not when used."""

    def __init__(self, module: str) -> None:
        self.module = module
        super().__init__(
            f"importing {module} initialized CUDA, in the process world's fork server as in this process: workers "
            "forked from a process that initialized CUDA cannot use it, so the server was started again without "
            f"the modules the collection imported, and each worker imports {module} itself (seconds per worker "
            "for a large library). A module that asks for a device when it is imported (a device capability, a "
            "tensor on the GPU) can defer that to its first use."
        )


class FaultNotFired(DstestError, AssertionError):
    """An injected fault (contract G5, ``dstest.faults``) never fired by the end of a run that otherwise passed:
    its rank never reached the call it names, so the run did not test the recovery it was meant to test.

    The message names each such fault and the calls its rank did make of that op (and on which groups). A
    fault that is meant to fire only on some runs says so with ``optional=True``.
    """


class WorkerDied(DstestError, RuntimeError):
    """A worker process of the process world died or stopped answering."""


class Deviation(DstestError, AssertionError):
    """A third-party target behaves differently from a contract of docs/contracts.md (a finding, not a bug of dstest).

    ``contract`` is the contract number (docs/contracts.md), ``expected`` and ``got`` the evidence.
    """

    def __init__(self, contract: str, expected: object, got: object, explanation: str = "") -> None:
        self.contract = contract
        self.expected = expected
        self.got = got
        self.explanation = explanation
        msg = f"[{contract}] deviation: expected {expected!r}, got {got!r}"
        if explanation:
            msg += f" ({explanation})"
        super().__init__(msg)

    def __reduce__(self) -> tuple[type[Deviation], tuple[str, object, object, str]]:
        # Crosses process boundaries (the process world pickles rank errors); args hold only the message.
        return (type(self), (self.contract, self.expected, self.got, self.explanation))


class WorldAborted(BaseException):
    """Unwinds a rank whose world is shutting down because another rank failed or the world timed out.

    A BaseException on purpose: a spec's ``except Exception`` must not keep a dead world alive.
    """
