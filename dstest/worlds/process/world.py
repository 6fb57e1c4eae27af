"""The process world: :class:`ProcessWorld`, which runs on the pools of :mod:`~.pool_cache` (or a cold
pool, for a world larger than the warm cap), and the refusal to start workers from an unguarded script.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import dstest.trace as _trace
from dstest.errors import (
    UnguardedMain,
)
from dstest.worlds.process.messages import PoolKey
from dstest.worlds.process.pool import Pool
from dstest.worlds.process.pool_cache import pool_for, replace_closed, run_cold, shutdown_all, warm_worker_cap
from dstest.worlds.process.refs import function_ref
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest

# ------------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------------


def _check_not_bootstrapping(what: str) -> None:
    """Refuse to start workers from a script's module level while multiprocessing re-imports that script.

    Workers come from a fork server (or are spawned) that imports the main script as ``__mp_main__`` so
    that its functions can be found by name. A script that calls the process world at module level,
    without an ``if __name__ == "__main__":`` guard, would start workers again from inside that import,
    and multiprocessing fails obscurely (in the parent: "process object is closed"). Say so instead.
    """
    fix = (
        f'Move the call (dstest.run(..., world="process") or ProcessWorld().{what}(...)) under '
        f'`if __name__ == "__main__":` and keep the rank functions at module level'
    )
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            path = frame.f_globals.get("__file__")
            if name == "__mp_main__":  # inside a worker's (or the fork server's) import of the script
                raise UnguardedMain(
                    f"the process world's {what}() was called at module level of {path} while "
                    f"multiprocessing was importing that script in a worker process (as __mp_main__, to find "
                    f'its functions by name): the call has no `if __name__ == "__main__":` guard, so every '
                    f"worker would start workers of its own. {fix}"
                )
            if name == "__main__" and path and _main_reimported() and not _under_main_guard(path, frame.f_lineno):
                raise UnguardedMain(
                    f"the process world's {what}() is called at module level of {path} (line "
                    f'{frame.f_lineno}) without an `if __name__ == "__main__":` guard: its worker processes '
                    f"import that script to find the rank functions by name, and would run the call again, "
                    f"each starting workers of its own. {fix}"
                )
        frame = frame.f_back


def _main_reimported() -> bool:
    """Whether multiprocessing re-imports this ``__main__`` in worker processes (as it decides it: a script
    run by path, or ``python -m module``; never a package's ``__main__``, e.g. ``python -m dstest``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return not (isinstance(name, str) and (name == "__main__" or name.endswith(".__main__")))


def _under_main_guard(path: str, lineno: int) -> bool:
    """Whether line ``lineno`` of the script ``path`` lies in the body of an ``if __name__ == "__main__":``
    statement at its top level (True when the source cannot be read: then nothing is refused)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    statements = _top_level_statements(path, stamp)
    if statements is None:
        return True
    for start, end, guarded in statements:
        if start <= lineno <= end:
            return any(first <= lineno <= last for first, last in guarded)
    return True


@functools.lru_cache(maxsize=8)
def _top_level_statements(path: str, stamp: tuple[int, int, int]) -> tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] | None:
    """The script's top-level statements as (first line, last line, the line spans of the body when the
    statement is an ``if __name__ == "__main__":``), parsed once per version of the file (``stamp``: its
    mtime, size and inode; every run from a script's main block asks again)."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    statements = []
    for node in tree.body:
        guarded: tuple[tuple[int, int], ...] = ()
        if isinstance(node, ast.If) and _is_main_test(node.test):
            guarded = tuple((b.lineno, b.end_lineno or b.lineno) for b in node.body)
        statements.append((node.lineno, node.end_lineno or node.lineno, guarded))
    return tuple(statements)


def _is_main_test(test: Any) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


class ProcessWorld:
    """Runs a function on every rank as warm worker processes over a real backend (gloo on CPU by default).

    ``fn(ctx, *args, **kwargs)`` runs in worker ``ctx.rank`` with ``torch.distributed`` initialised
    (``dist.get_rank() == ctx.rank``, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set); ``run`` returns the
    per-rank results in rank order, or raises :class:`RankFailure` (every failing rank's traceback),
    :class:`WorldTimeout` (every running rank's stack) or :class:`WorkerDied`. ``fn`` must be a
    module-level function; args, kwargs and results must pickle. Groups a run creates are destroyed after
    it; the world group, imported modules and other process state persist across runs of the same pool.
    """

    def __init__(
        self, *, backend: str = "gloo", device: str = "cpu", name: str = "process", max_warm_workers: int | None = None
    ) -> None:
        self.name = name
        self.backend = backend
        self.device = device
        if max_warm_workers is not None:
            warm_worker_cap(max_warm_workers)  # checked now, not at the first run
        #: The most worker processes kept warm across runs, all pools together (None: the environment
        #: variable ``DSTEST_PROCESS_MAX_WORKERS``, else the default; see :func:`warm_worker_cap`).
        self.max_warm_workers = max_warm_workers

    @property
    def marker(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    @property
    def capabilities(self) -> Capabilities:
        """Every worker watches module state; gloo pools are checked across ranks (strict shapes) and inject
        faults; nothing poisons outputs (gloo and NCCL write them themselves)."""
        checked = self.backend == "gloo"
        return Capabilities(faults=checked, module_watch=True, strict_shapes=checked)

    def close(self) -> None:
        """Stop every worker pool of this process (gloo's and NCCL's: they share one cache and one cap)."""
        shutdown_all()

    def unavailable_reason(self, world_size: int) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return "torch was built without torch.distributed"
        if self.backend == "gloo" and not dist.is_gloo_available():
            return "the process world needs gloo, which this torch build lacks"
        if self.backend == "nccl" and not dist.is_nccl_available():
            return "the nccl world needs NCCL, which this torch build lacks"
        return None

    def run(self, request: RunRequest) -> list[Any]:
        __tracebackhide__ = True
        _check_not_bootstrapping("run")
        self.capabilities.refuse(request, self.name)
        # The function travels by reference; the request's setup (the spec layer's binding of the system
        # under test) by pickle, and the worker runs it before the function.
        ref = function_ref(request.fn)
        world_size = request.world_size
        key = PoolKey(self.backend, self.device, world_size)
        with _trace.world_run(self.name, world_size, request.recorder) as recorder:
            cap = warm_worker_cap(self.max_warm_workers)
            if world_size > cap:
                return run_cold(key, self.name, ref, request, recorder)
            pool = pool_for(key, self.name, cap)
            with pool.lock:
                try:
                    return pool.run(ref, request, recorder)
                finally:
                    if pool.closed:
                        replace_closed(pool)

    def prestart(self, world_sizes: Sequence[int]) -> None:
        """Start the pools of these world sizes without waiting: they warm up while other work runs."""
        _check_not_bootstrapping("prestart")
        for ws in world_sizes:
            cap = warm_worker_cap(self.max_warm_workers)
            if ws > cap:
                continue  # runs cold
            pool_for(PoolKey(self.backend, self.device, ws), self.name, cap)

    def warm(self, world_size: int) -> float:
        """Start (if needed) and wait for the pool of ``world_size`` ranks; returns its launch-to-ready seconds."""
        _check_not_bootstrapping("warm")
        key = PoolKey(self.backend, self.device, world_size)
        cap = warm_worker_cap(self.max_warm_workers)
        if world_size > cap:  # nothing is kept: measure a cold start
            cold = Pool(key, self.name).start()
            try:
                cold.wait_ready()
            finally:
                if not cold.closed:
                    cold.stop()
            return cold.start_seconds or 0.0
        pool = pool_for(key, self.name, cap)
        with pool.lock:
            try:
                pool.wait_ready()
            finally:
                if pool.closed:
                    replace_closed(pool)
        return pool.start_seconds or 0.0
