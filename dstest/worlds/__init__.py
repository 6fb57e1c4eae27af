"""Worlds run a function on every rank of a simulated or real process group (see ``protocol.World``).

| world          | ranks are                    | collectives                        |
|----------------|------------------------------|------------------------------------|
| threaded       | threads in this process      | real data, dstest's c10d backend   |
| threaded-cuda  | threads, CUDA tensors        | same, on the GPU                   |
| fake           | this process plays rank r    | shape-checked, no data exchange    |
| process        | warm OS processes            | gloo                               |
| nccl           | one process per GPU          | NCCL                               |
"""

from __future__ import annotations

import importlib
from typing import Any

from dstest.errors import InvalidArgument
from dstest.worlds.protocol import World

__all__ = ["DEFAULT_WORLDS", "WORLD_MARKERS", "WORLD_NAMES", "World", "get_world"]

# name -> (module, factory attribute, keyword arguments)
_FACTORIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "threaded": ("dstest.worlds.threaded", "ThreadedWorld", {"warm": True}),
    "threaded-cuda": ("dstest.worlds.threaded", "ThreadedWorld", {"device": "cuda", "warm": True}),
    "fake": ("dstest.worlds.fake", "FakeWorld", {}),
    "process": ("dstest.worlds.process", "ProcessWorld", {}),
    "nccl": ("dstest.worlds.nccl", "NcclWorld", {}),
}
WORLD_NAMES = tuple(_FACTORIES)
#: The pytest marker of each world's items (known without importing torch).
WORLD_MARKERS = {"threaded": "cpu", "threaded-cuda": "gpu", "fake": "cpu", "process": "cpu", "nccl": "gpu"}
#: Where a spec runs unless it or ``--dstest-worlds`` says otherwise: CPU threads and real GPUs.
DEFAULT_WORLDS = ("threaded", "nccl")


def get_world(name: str) -> World:
    """A world by name (see the table above); worlds are cheap to create, state lives in ``run``."""
    entry = _FACTORIES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise InvalidArgument(f"world={name!r} is unknown; allowed: {list(WORLD_NAMES)}")
    module, attr, kwargs = entry
    factory = getattr(importlib.import_module(module), attr)
    world: World = factory(**kwargs)
    return world
