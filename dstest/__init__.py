"""dstest: test distributed-training code on simulated process groups, rerun the same specs on NCCL.

The public names below load on first use (PEP 562), so that ``import dstest.pytest.plugin``, which pytest does
in every project where dstest is installed, imports neither torch nor hypothesis.

PYTEST_DONT_REWRITE: a warm server (``dstest.pytest.warm``) imports dstest before pytest starts in the
session it forks; pytest would otherwise warn that it cannot rewrite the package's asserts there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dstest._lazy import lazy_names

__version__ = "0.1.0"

_EXPORTS = {
    "DEFAULT_WORLDS": "dstest.worlds",
    "WORLD_NAMES": "dstest.worlds",
    "Capabilities": "dstest.worlds",
    "World": "dstest.worlds",
    "get_world": "dstest.worlds",
    "RunRequest": "dstest.worlds.request",
    "TOPOLOGIES": "dstest.groups",
    "GroupBuilder": "dstest.groups",
    "ShardLayout": "dstest.shards",
    "padded": "dstest.shards",
    "uneven": "dstest.shards",
    "Case": "dstest.specification",
    "Settings": "dstest.specification",
    "run": "dstest.specification",
    "spec": "dstest.specification",
    "RankContext": "dstest.context",
    "CommView": "dstest.trace",
    "Recording": "dstest.trace",
    "recording": "dstest.trace",
    "CollectiveMismatch": "dstest.errors",
    "Deviation": "dstest.errors",
    "DstestError": "dstest.errors",
    "FaultNotFired": "dstest.errors",
    "InvalidArgument": "dstest.errors",
    "InvalidSpec": "dstest.errors",
    "InvalidWorldSize": "dstest.errors",
    "RankFailure": "dstest.errors",
    "ReplicasDiverge": "dstest.errors",
    "assert_replicas": "dstest.replicas",
    "WorkerDied": "dstest.errors",
    "WorldTimeout": "dstest.errors",
    "WorldsDiverge": "dstest.errors",
    "crosscheck": "dstest.crosscheck",
}

#: Public submodules that load on first attribute access (``dstest.faults.Kill``).
_SUBMODULES = ("faults",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


_exported = lazy_names("dstest", _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"dstest.{name}")
    return _exported(name)


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


if TYPE_CHECKING:
    from dstest import faults as faults
    from dstest.context import RankContext as RankContext
    from dstest.crosscheck import crosscheck as crosscheck
    from dstest.errors import (
        CollectiveMismatch as CollectiveMismatch,
    )
    from dstest.errors import (
        Deviation as Deviation,
    )
    from dstest.errors import (
        DstestError as DstestError,
    )
    from dstest.errors import (
        FaultNotFired as FaultNotFired,
    )
    from dstest.errors import (
        InvalidArgument as InvalidArgument,
    )
    from dstest.errors import (
        InvalidSpec as InvalidSpec,
    )
    from dstest.errors import (
        InvalidWorldSize as InvalidWorldSize,
    )
    from dstest.errors import (
        RankFailure as RankFailure,
    )
    from dstest.errors import (
        ReplicasDiverge as ReplicasDiverge,
    )
    from dstest.errors import (
        WorkerDied as WorkerDied,
    )
    from dstest.errors import (
        WorldsDiverge as WorldsDiverge,
    )
    from dstest.errors import (
        WorldTimeout as WorldTimeout,
    )
    from dstest.groups import TOPOLOGIES as TOPOLOGIES
    from dstest.groups import GroupBuilder as GroupBuilder
    from dstest.replicas import assert_replicas as assert_replicas
    from dstest.shards import ShardLayout as ShardLayout
    from dstest.shards import padded as padded
    from dstest.shards import uneven as uneven
    from dstest.specification import Case as Case
    from dstest.specification import Settings as Settings
    from dstest.specification import run as run
    from dstest.specification import spec as spec
    from dstest.trace import CommView as CommView
    from dstest.trace import Recording as Recording
    from dstest.trace import recording as recording
    from dstest.worlds import DEFAULT_WORLDS as DEFAULT_WORLDS
    from dstest.worlds import WORLD_NAMES as WORLD_NAMES
    from dstest.worlds import Capabilities as Capabilities
    from dstest.worlds import World as World
    from dstest.worlds import get_world as get_world
