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
:func:`register_world`, see :mod:`dstest.registry`); :func:`world_names` lists them all.
"""

from __future__ import annotations

from dstest.registry import BUILTIN_WORLD_MARKERS, BUILTIN_WORLDS, register_world, world_factory, world_names
from dstest.worlds.protocol import World

__all__ = [
    "DEFAULT_WORLDS",
    "WORLD_MARKERS",
    "WORLD_NAMES",
    "World",
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
    """A world by name (see the table above); worlds are cheap to create, state lives in ``run``."""
    world: World = world_factory(name)()
    return world
