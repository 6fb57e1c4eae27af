"""The scope of one test of another harness in a warm worker, as that harness's fresh process would run it
(:func:`fresh_process`, for the compat plugin of torch's test bases): what the test changed is put back when
it ends, and named with the run's :class:`~dstest.worlds.process.state_watch.ModuleStateWatch`.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from dstest.worlds.process.state_watch.module_globals import WATCHES, SavedGlobals, add_pending
from dstest.worlds.process.state_watch.process_wide import (
    ProcessState,
    drop_users_modules,
    imported_since,
    is_users_module,
    restore_process_state,
    take_process_state,
)


def fresh_process_rng() -> None:
    """torch's global RNG as a new process has it (the seed of a fresh ``torch.Generator``, on the CPU and
    on the CUDA devices once CUDA is up), Python's and numpy's from fresh entropy, as a new process seeds
    them. The CPU generator is seeded by itself: ``torch.manual_seed`` asks every device (0.15 ms a call).
    torch's bases then seed all three as upstream (``common_utils.set_rng_seed``)."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        seed = torch.Generator().initial_seed()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
    random.seed()
    np: Any = sys.modules.get("numpy")
    if np is not None:  # a seed drawn from the fresh entropy: 40 times cheaper than numpy drawing all its state
        np.random.seed(random.getrandbits(32))


class FreshProcess:
    """One test's stay in a warm worker (see :func:`fresh_process`)."""

    def __init__(self, key: str | None, quiet_env: Callable[[str], bool]) -> None:
        self.key = key
        self.quiet_env = quiet_env
        self.newest = next(reversed(sys.modules))  # what the test imports comes after it
        self.state: ProcessState | None = None

    def started(self, *own: ModuleType) -> None:
        """The rank now looks like the process the harness would have started (its ``sys.path``,
        environment and working directory set, the test's module ``own`` imported): what a fresh process
        has now, the test must leave. The modules of the user's own that came with the import are kept as
        their import left them; so are ``own``, unless kept already. A later test of a held scope starts
        from where the first one did."""
        if self.state is not None:
            return
        modules = list(own)
        new = imported_since(self.newest)
        imported = set(new)
        modules += [sys.modules[n] for n in new if is_users_module(n, sys.modules[n], imported)]
        for module in modules:
            kept = _AS_IMPORTED.get(module.__name__)
            if kept is None or kept.module is not module:
                _AS_IMPORTED[module.__name__] = SavedGlobals(module)
        if new:
            for watch in WATCHES:
                watch.add_new_modules()  # a watched library the test module imported: as its import left it
        fresh_process_rng()
        self.state = take_process_state(environ=self.key is None)

    def close(self) -> tuple[list[str], str | None]:
        """Put back what the test changed; what it was, and why the worker is unusable, if it is."""
        found: list[str] = []
        unusable: list[str] = []
        try:
            if self.state is None:  # a test that never started (its module failed to import): its imports
                found.extend(drop_users_modules(imported_since(self.newest)))
            else:
                more, why = restore_process_state(self.state, quiet_env=self.quiet_env)
                found.extend(more)
                if why:
                    unusable.append(why)
        except Exception as exc:
            unusable.append(f"could not put back the process's state ({type(exc).__name__}: {exc})")
        for name, kept in _AS_IMPORTED.items():
            if kept.unchanged():
                continue
            try:
                found.extend(kept.restore())
            except Exception as exc:
                unusable.append(f"could not put back the globals of {name} ({type(exc).__name__}: {exc})")
        return found, "; ".join(unusable) or None


@contextlib.contextmanager
def fresh_process(
    key: str | None = None, quiet_env: Callable[[str], bool] = lambda name: False
) -> Iterator[FreshProcess]:
    """The scope of one test of another harness, in a warm worker, as that harness's fresh process would
    run it: call :meth:`FreshProcess.started` once the rank looks like that process; at the end, what the
    test changed is put back, and named in the run's ``StateLeftBehind`` warning; what cannot be put back
    has the worker replaced after the run. Both reach the parent through the run's
    :class:`ModuleStateWatch`: a run using this names ``watch_modules``.

    ``key``: the tests of one harness process that serves several (torch's continuous bases: a process
    per class) share a scope: it is held from one test to the next of the same key and put back when a
    test of another key (or none) begins in this worker, or by :func:`close_held_scope`. The environment and
    working directory, which dstest's reset gives every run anew, are not compared in a held scope.
    ``quiet_env``: environment variables put back unnamed (what the harness itself sets in every rank).
    """
    global _held
    if _held is not None and _held.key != key:
        close_held_scope()
    scope = _held if _held is not None else FreshProcess(key, quiet_env)
    _held = None
    try:
        yield scope
    finally:
        if key is None:
            _finish(scope)
        else:
            _held = scope


def close_held_scope() -> None:
    """Put back what the tests of the held scope changed (nothing when none is held)."""
    global _held
    scope, _held = _held, None
    if scope is not None:
        _finish(scope)


def _finish(scope: FreshProcess) -> None:
    add_pending(*scope.close())


#: The modules a scope kept as their import left them (test modules and the user's modules they import).
_AS_IMPORTED: dict[str, SavedGlobals] = {}
_held: FreshProcess | None = None
