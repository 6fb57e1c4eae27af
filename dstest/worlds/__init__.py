"""Worlds run a function on every rank of a simulated or real process group (see ``protocol.World``).

| world          | ranks are                    | collectives                        |
|----------------|------------------------------|------------------------------------|
| threaded       | threads in this process      | real data, dstest's c10d backend   |
| threaded-cuda  | threads, CUDA tensors        | same, on the GPU                   |
| fake           | this process plays rank r    | shape-checked, no data exchange    |
| process        | warm OS processes            | gloo                               |
| nccl           | one process per GPU          | NCCL                               |
| launched       | the launcher's processes     | NCCL on GPUs, gloo on CPU          |

Plug-ins add worlds (a pytest hook, an entry point in the group ``dstest.worlds`` or
:func:`register_world`, see :mod:`dstest.registry`); :func:`world_names` lists them all. Each world declares
what it can do beyond running ranks (:class:`Capabilities`) and is closed through ``close()`` when the test
session ends (:mod:`dstest.worlds.lifecycle`).
"""

from __future__ import annotations

from typing import Any

from dstest.registry import BUILTIN_WORLD_MARKERS, BUILTIN_WORLDS, register_world, world_factory, world_names
from dstest.worlds import lifecycle
from dstest.worlds.protocol import Capabilities, World, capabilities_of

__all__ = [
    "DEFAULT_WORLDS",
    "WORLD_MARKERS",
    "WORLD_NAMES",
    "Capabilities",
    "World",
    "capabilities_of",
    "get_world",
    "register_world",
    "world_names",
]

#: The built-in world names (plug-ins: :func:`world_names`).
WORLD_NAMES = tuple(BUILTIN_WORLDS)
#: The pytest marker of each built-in world's items (known without importing torch); plug-in worlds:
#: :func:`dstest.registry.world_marker`.
WORLD_MARKERS = dict(BUILTIN_WORLD_MARKERS)
#: Where a spec runs unless it or ``--dstest-worlds`` says otherwise: CPU threads and real GPUs.
DEFAULT_WORLDS = ("threaded", "nccl")


def get_world(name: str) -> World:
    """The open world of this name (see the table above): made on first use, the same one until the session's
    end closes it (:func:`dstest.worlds.lifecycle.close_all`); a plug-in registered again under the name gets
    a world of its own."""
    factory = world_factory(name)
    key: Any = name if name in BUILTIN_WORLDS else (name, factory)
    world: World = lifecycle.open_world(key, factory)
    return world
