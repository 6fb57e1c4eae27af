"""The launched world itself: :class:`LaunchedWorld` runs a function on the first ``world_size`` ranks of the
launch this process belongs to."""

from __future__ import annotations

from typing import Any

from dstest.errors import DstestError, InvalidWorldSize
from dstest.worlds.launched.connection import connect, shutdown
from dstest.worlds.launched.environment import backend_name, launch_environment
from dstest.worlds.launched.outcomes import combine
from dstest.worlds.launched.rank_run import RankRun
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest

__all__ = ["LaunchBroken", "LaunchedWorld"]


class LaunchedWorld:
    """Runs a function on the first ``world_size`` ranks of the launch this process belongs to."""

    name = "launched"
    #: The launcher's processes run the backend as it is: dstest checks, poisons and injects nothing there.
    capabilities = Capabilities()

    @property
    def marker(self) -> str:
        env = launch_environment()
        return "gpu" if backend_name(env.local_world_size if env else 1) == "nccl" else "cpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        env = launch_environment()
        if env is None:
            return (
                "the launched world needs a launcher: run pytest under torchrun "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set)"
            )
        if world_size > env.world_size:
            return f"needs {world_size} launched ranks, the launcher started {env.world_size}"
        return None

    def close(self) -> None:
        """Forget the launch this process belongs to (its store connections close with it)."""
        shutdown()

    def run(self, request: RunRequest) -> list[Any]:
        self.capabilities.refuse(request, self.name)
        world_size, timeout = request.world_size, request.timeout
        launch = connect()
        if world_size > launch.world_size:
            raise InvalidWorldSize(
                f"world_size={world_size!r}: the launcher started {launch.world_size} ranks; run with "
                f"--nproc-per-node (times nodes) >= {world_size}"
            )
        key = launch.next_run_key()
        if launch.broken is not None:
            raise LaunchBroken(f"launched world on rank {launch.rank}: {launch.broken}")
        lost = sorted(r for r in launch.lost if r < world_size)
        if lost:
            raise LaunchBroken(f"launched world: ranks {lost} stopped answering earlier ({launch.lost[lost[0]]})")
        label = f"launched world of {world_size} of {launch.world_size} ranks ({launch.backend})"
        __tracebackhide__ = True
        took_part = launch.rank < world_size
        if took_part:
            RankRun(launch, key, request).execute()
        return combine(launch, key, world_size, timeout, label, took_part=took_part)


class LaunchBroken(DstestError, RuntimeError):
    """The launched world cannot run more: a rank stopped answering, or a run's group could not be torn down."""
