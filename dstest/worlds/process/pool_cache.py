"""The warm pools of this process, kept as a cache: one per (backend, device, world size), capped in
least-recently-used order (:func:`warm_worker_cap`), replaced when they break, and all stopped by
:func:`shutdown_all`; and the pools of cold runs (a world larger than the cap), which it stops too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import dstest.trace as _trace
from dstest.errors import InvalidArgument
from dstest.worlds import lifecycle
from dstest.worlds.process.launch import stop_fork_server
from dstest.worlds.process.messages import STOP, FnRef, PoolKey
from dstest.worlds.process.pool import Pool
from dstest.worlds.request import RunRequest

#: The environment variable that caps the worker processes kept warm, all pools of this process together:
#: an integer >= 0 (0 keeps none: every world runs cold). Read at each run.
MAX_WARM_WORKERS_ENV = "DSTEST_PROCESS_MAX_WORKERS"
#: The cap when neither is set.
DEFAULT_MAX_WARM_WORKERS = max(32, 4 * (os.cpu_count() or 1))


# ------------------------------------------------------------------------------------------------------
# The pools of this process
# ------------------------------------------------------------------------------------------------------

# The pools are process-wide on purpose: keeping workers warm across World objects and tests is the whole
# point. They are reached only through the functions of this module, under _POOLS_LOCK.
_POOLS: dict[PoolKey, Pool] = {}
_POOLS_LOCK = threading.Lock()
_COLD: set[Pool] = set()  # pools of cold runs in progress (stopped by shutdown_all too)


def pool_for(key: PoolKey, world_name: str, cap: int) -> Pool:
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            _evict_for(key.world_size, cap)
            pool = _POOLS[key] = Pool(key, world_name).start()
        lifecycle.keep("process pools", shutdown_all)  # stopped at the session's end, whoever made it
        pool.last_used = time.monotonic()
        return pool


def warm_worker_cap(setting: int | None = None) -> int:
    """The most worker processes kept warm across runs (all pools together).

    ``setting`` (a :class:`~dstest.worlds.process.world.ProcessWorld`'s ``max_warm_workers``) if not None,
    else the ``DSTEST_PROCESS_MAX_WORKERS`` environment variable, else ``DEFAULT_MAX_WARM_WORKERS``. Pools are kept in least-recently-used order: starting a pool closes the
    idle pools used longest ago until the kept workers fit under the cap; a world larger than the cap
    runs cold (its workers start for the run and stop after it).
    """
    value: object = setting
    source = "max_warm_workers"
    if value is None:
        raw = os.environ.get(MAX_WARM_WORKERS_ENV, "").strip()
        if not raw:
            return DEFAULT_MAX_WARM_WORKERS
        source = f"the environment variable {MAX_WARM_WORKERS_ENV}"
        try:
            value = int(raw)
        except ValueError:
            value = raw
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(
            f"{source}={value!r} must be an integer >= 0: the most worker processes the process world keeps "
            f"warm across runs (0 keeps none)"
        )
    return value


def _evict_for(extra: int, cap: int) -> None:
    """Close least recently used idle pools so that at most ``cap`` workers stay warm."""
    live = sorted((p for p in _POOLS.values() if not p.closed), key=lambda p: p.last_used)
    total = sum(p.key.world_size for p in live) + extra
    for pool in live:
        if total <= cap:
            break
        if pool.lock.acquire(blocking=False):
            try:
                pool.stop()
            finally:
                pool.lock.release()
            total -= pool.key.world_size


def replace_closed(pool: Pool) -> None:
    """Start a fresh pool in place of a closed one, now, so that it warms up while other tests run."""
    with _POOLS_LOCK:
        if _POOLS.get(pool.key) is pool and not pool.start_failed:
            _POOLS[pool.key] = Pool(pool.key, pool.world_name).start()


def run_cold(key: PoolKey, world_name: str, ref: FnRef, request: RunRequest, recorder: _trace.Recorder) -> list[Any]:
    """One run on a pool of its own that is stopped after it (a world larger than the warm cap)."""
    __tracebackhide__ = True
    pool = Pool(key, world_name).start()
    with _POOLS_LOCK:
        _COLD.add(pool)
    try:
        with pool.lock:
            return pool.run(ref, request, recorder)
    finally:
        if not pool.closed:
            pool.stop()
        with _POOLS_LOCK:
            _COLD.discard(pool)


def shutdown_all() -> None:
    """Stop every worker of every pool of this process (``ProcessWorld.close()``;
    the session's end and interpreter exit, through :func:`dstest.worlds.lifecycle.close_all`)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values()) + list(_COLD)
        _POOLS.clear()
        _COLD.clear()
    for pool in pools:  # ask all at once, then wait: a pool's workers exit in parallel with the others'
        for w in pool.workers:
            with contextlib.suppress(Exception):
                w.conn.send_bytes(STOP)
    for pool in pools:
        if not pool.closed:
            pool.reap(grace=2.0)
    stop_fork_server()


def pool_token(backend: str, world_size: int) -> int | None:
    """An identity of the live pool of ``world_size`` ranks on ``backend`` (None: none); it changes when
    the pool is replaced, and is None once it is killed."""
    with _POOLS_LOCK:
        for key, pool in _POOLS.items():
            if (key.backend, key.world_size) == (backend, world_size) and not pool.closed:
                return id(pool)
    return None


def pool_pids() -> dict[tuple[str, int], list[int]]:
    """The worker pids of every live pool, by (backend, world size); for tests that check no process leaks."""
    with _POOLS_LOCK:
        return {(k.backend, k.world_size): p.pids() for k, p in _POOLS.items() if not p.closed}
