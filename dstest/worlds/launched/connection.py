"""This rank's connection to its launch: the launcher's store (one connection watched by the rank's own thread,
one for the process groups of runs), the run keys, and the ranks known lost; one per process."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dstest.errors import InvalidWorldSize
from dstest.worlds import lifecycle
from dstest.worlds.launched.environment import LaunchEnvironment, backend_name, launch_environment

__all__ = ["CONNECT_TIMEOUT_S", "Launch", "connect", "current_launch", "shutdown"]

#: Seconds to connect to the launcher's store at start.
CONNECT_TIMEOUT_S = 120.0


@dataclass
class Launch:
    """This rank's connection to a launch: the store, the run counter, the ranks known lost.

    One per process (a process is one rank of one launch); :func:`connect` makes it.
    """

    env: LaunchEnvironment
    backend: str
    store: Any  # the launcher's store, used by this rank's own thread only
    pg_store: Any  # a second connection, for the process groups of runs
    device: Any
    prefix: str
    item: tuple[int, str] = (-1, "")
    runs_in_item: int = 0
    lost: dict[int, str] = field(default_factory=dict)
    broken: str | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def begin_item(self, index: int, nodeid: str) -> None:
        """The pytest item now running on every rank (run keys are per item, so a rank that skipped a
        run, a failed setup say, never pairs its next run with a peer's earlier one)."""
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:12]
        self.item = (index, digest)
        self.runs_in_item = 0

    def next_run_key(self) -> str:
        index, digest = self.item
        self.runs_in_item += 1
        return self.key("run", f"{index}-{digest}", self.runs_in_item) + "/"

    # -- short store calls ---------------------------------------------------------------------------
    def post(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def get(self, key: str) -> bytes:
        value: bytes = self.store.get(key)
        return value

    def count(self, key: str, add: int = 0) -> int:
        value: int = self.store.add(key, add)
        return value

    def wait_for(self, keys: Sequence[str], deadline: float, stop: Callable[[], bool] | None = None) -> list[str]:
        """Poll until every key exists or ``deadline`` (monotonic) passes; returns the keys still missing."""
        pending = list(keys)
        pause = 0.001
        while pending and not self.store.check(pending):
            if time.monotonic() >= deadline or (stop is not None and stop()):
                return [k for k in pending if not self.has(k)]
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return []


_LOCK = threading.Lock()
_LAUNCH: list[Launch] = []


def current_launch() -> Launch | None:
    """The launch this process is connected to, if :func:`connect` ran."""
    return _LAUNCH[0] if _LAUNCH else None


def connect(timeout: float = CONNECT_TIMEOUT_S) -> Launch:
    """Join the launcher's rendezvous store (once per process); raises if no launcher started this process."""
    with _LOCK:
        if _LAUNCH:
            return _LAUNCH[0]
        env = launch_environment()
        if env is None:
            raise InvalidWorldSize(
                "the launched world needs a launcher: start pytest under torchrun "
                "(torchrun --nproc-per-node 2 -m pytest ...), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        import datetime

        import torch
        from torch.distributed.rendezvous import rendezvous

        from dstest.worlds.torch_internals import tcp_client_store

        backend = backend_name(env.local_world_size)
        if backend == "nccl":
            device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        wait = datetime.timedelta(seconds=timeout)
        # env:// makes rank 0 host the store unless the torch elastic agent already does; the second
        # connection is a plain client of whichever it is.
        store, _, _ = next(rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=wait))
        pg_store = tcp_client_store(env.master_addr, env.master_port, wait)
        launch = Launch(
            env=env, backend=backend, store=store, pg_store=pg_store, device=device, prefix=f"dstest/{env.tag}/"
        )
        _LAUNCH.append(launch)
        lifecycle.keep("launch", shutdown)
        return launch


def shutdown() -> None:
    """Forget the launch (the store connections close with their objects)."""
    with _LOCK:
        _LAUNCH.clear()
