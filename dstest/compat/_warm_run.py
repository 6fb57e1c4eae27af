"""One warm run of a foreign test, the same for every compat plugin (:mod:`dstest.compat.deepspeed`,
:mod:`dstest.compat.torch`).

A plugin turns one test of another project's harness into a function each rank runs; :func:`run_warm` runs
it on dstest's warm process world (reached only through its API for compat plugins,
:mod:`dstest.worlds.process.byref`) and notes, with why, when the run left its pool replaced, for the
plugin's terminal summary. :class:`WarmState` is what each plugin keeps for a pytest session: the classes
it patched (put back by :func:`restore`), the tests that ran on the harness's own processes and those after
which a pool was replaced (one record type, :class:`Elsewhere`), and the count of warm runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Elsewhere", "PoolSeen", "WarmState", "patch", "restore", "run_warm"]


@dataclass
class Elsewhere:
    """A test that did not run warm as is, or after which its pool was replaced: a line of the summary."""

    nodeid: str
    why: str
    world_size: int | None = None


@dataclass
class WarmState:
    """What a compat plugin keeps for one pytest session."""

    patched: dict[type, dict[str, Any]] = field(default_factory=dict)  # class -> its own attributes replaced
    own: list[Elsewhere] = field(default_factory=list)  # ran on the harness's own processes
    replaced: list[Elsewhere] = field(default_factory=list)  # their pool was replaced after them
    warm_runs: int = 0
    strict_shapes: bool = False  # --dstest-strict-shapes: shape-only differences are mismatches too
    checked: bool = True  # the gloo groups a test forms are dstest's checked groups (--dstest-unchecked: torch's)


def patch(state: WarmState, cls: type, replacements: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
    """Set ``replacements`` on ``cls``, remembering the class's own attributes of those names (and of
    ``keep``, which the plugin calls but leaves in place) for :func:`restore`."""
    state.patched[cls] = {name: cls.__dict__.get(name) for name in (*replacements, *keep)}
    for name, value in replacements.items():
        setattr(cls, name, value)


def restore(state: WarmState) -> None:
    """Put every patched class's own attributes back (one it did not have is removed again)."""
    for cls, originals in state.patched.items():
        for name, original in originals.items():
            if original is not None:
                setattr(cls, name, original)
            elif name in cls.__dict__:
                delattr(cls, name)
    state.patched.clear()


@dataclass(frozen=True)
class PoolSeen:
    """The warm pool of one world size as seen at one moment: its identity and its workers (none: no pool)."""

    token: int | None
    pids: tuple[int, ...]

    @classmethod
    def now(cls, world_size: int) -> PoolSeen:
        from dstest.worlds.process.byref import pool_pids, pool_token

        return cls(pool_token(world_size), pool_pids(world_size))

    def replaced(self, later: PoolSeen) -> bool:
        """Whether ``later`` is not this pool: another one, or none with its workers up (this one, or the one a
        run started after it, was killed, and any successor is still starting). Only the identity tells two
        live pools apart: a pool's workers, and so their pids, come up a while after the pool is made."""
        return not later.pids or (self.token is not None and later.token != self.token)


def _replaced_why(failure: BaseException | None, before: PoolSeen, world_size: int) -> str | None:
    """Why the run's pool was replaced, or None where it was not. The process world replaces it after a hang,
    a dead worker and ranks stopped after another's failure, and says so in the error."""
    from dstest.errors import RankFailure, WorkerDied, WorldTimeout

    if isinstance(failure, WorldTimeout):
        return "a rank hung"
    if isinstance(failure, WorkerDied):
        return "a worker died"
    if isinstance(failure, RankFailure) and "pool was replaced" in str(failure):
        return "a rank failed while its peers were blocked"
    if before.replaced(PoolSeen.now(world_size)):
        return "the test left its workers unusable"
    return None


def run_warm(
    state: WarmState,
    nodeid: str,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    *,
    timeout: float,
    watch: str,
    fresh_after: bool = False,
) -> list[Any]:
    """Each rank's result of ``fn(ctx, *args)`` on the warm workers of ``world_size`` ranks; what the run
    raises (``RankFailure``, ``WorldTimeout``, ``WorkerDied``...) reaches the caller, which judges it as its
    harness does. What a test leaves in the module ``watch`` (and below) is put back and named. A pool the
    run left replaced is noted in ``state.replaced``, unless ``fresh_after`` says the test always gets fresh
    workers after it (it formed a world of its own)."""
    __tracebackhide__ = True
    from dstest.worlds.process import ProcessWorld
    from dstest.worlds.request import RunRequest

    before = PoolSeen.now(world_size)
    state.warm_runs += 1
    failure: BaseException | None = None
    try:
        request = RunRequest(
            fn, world_size, args=args, timeout=timeout, strict_shapes=state.strict_shapes, watch_modules=(watch,)
        )
        return ProcessWorld().run(request)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        why = None if fresh_after else _replaced_why(failure, before, world_size)
        if why is not None:
            state.replaced.append(Elsewhere(nodeid, why, world_size))
