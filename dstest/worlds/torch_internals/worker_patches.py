"""The process world's replacements of torch functions in a worker, each with the original it replaced.

A worker of the process world makes every gloo group a checked one (:func:`install_checked_gloo`), and a
test of another suite's harness sees a world of its own (:mod:`.hidden_world`). Every such replacement goes
through :func:`replace`, and comes back through :func:`put_back`, which keep the originals in one record,
:data:`WORKER_SAVED`: a stack per attribute, so that a replacement made over another (the hidden world's
plain gloo helper over the checked one) unwinds in order. (The threaded world's switches, installed for rank
threads, keep theirs in ``installed.INSTALL``, read by the wrappers that stand in for them.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["WORKER_SAVED", "install_checked_gloo", "put_back", "put_back_functional_linear", "replace"]


class _Saved:
    """The originals a worker's replacements hid: ``(owner, attribute) -> [original, ...]``, oldest first."""

    def __init__(self) -> None:
        self.stacks: dict[tuple[int, str], tuple[Any, list[Any]]] = {}

    def replaced(self, owner: Any, name: str) -> bool:
        return (id(owner), name) in self.stacks


WORKER_SAVED = _Saved()


def replace(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name`` to ``value``, keeping what it was for :func:`put_back`."""
    _, stack = WORKER_SAVED.stacks.setdefault((id(owner), name), (owner, []))
    stack.append(getattr(owner, name))
    setattr(owner, name, value)


def put_back(owner: Any, name: str) -> None:
    """Undo the latest :func:`replace` of ``owner.name``."""
    key = (id(owner), name)
    _, stack = WORKER_SAVED.stacks[key]
    setattr(owner, name, stack.pop())
    if not stack:
        del WORKER_SAVED.stacks[key]


def install_checked_gloo(backend: str, create: Callable[[Any, Any], Any], is_checked: Callable[[Any], bool]) -> None:
    """Make every gloo group this worker creates one of backend ``backend`` that still reports itself as gloo.

    Registers ``create`` as the c10d backend ``backend`` and wraps ``distributed_c10d._new_process_group_helper``
    (torch 2.11-2.15: the one function every group creation goes through: init_process_group, new_group,
    new_subgroups, DeviceMesh) so that a request for "gloo" builds ``backend``; a group ``is_checked`` answers
    True for then gets "gloo" back as its backend name in ``_world.pg_map`` and its gloo config in
    ``_world.pg_backend_config``, so that ``dist.get_backend()`` and code that branches on it see gloo. The
    wrapper's ``unchecked`` is the helper it wraps (benchmarks and :mod:`.hidden_world` build plain gloo
    groups with it).
    """
    dist.Backend.register_backend(backend, create, extended_api=True, devices=["cpu"])
    original = c10d._new_process_group_helper
    gloo_config = str(c10d.BackendConfig(dist.Backend("gloo")))

    def helper(group_size: int, group_rank: int, global_ranks: list[int], asked: Any, *args: Any, **kwargs: Any) -> Any:
        if str(asked) == "gloo":
            asked = backend
        pg, store = original(group_size, group_rank, global_ranks, asked, *args, **kwargs)
        if is_checked(pg):  # a checked group: still named gloo to torch and to the code
            c10d._world.pg_map[pg] = ("gloo", c10d._world.pg_map[pg][1])
            c10d._world.pg_backend_config[pg] = gloo_config
        return pg, store

    helper.unchecked = original  # type: ignore[attr-defined]
    replace(c10d, "_new_process_group_helper", helper)


def put_back_functional_linear() -> None:
    """Put torch's own ``torch.nn.functional.linear`` back (``torch._C._nn.linear``, torch 2.11-2.15) where a
    library replaced it for the rest of the process (DeepSpeed's ZeRO-3 ``Init`` does, "This will persist
    unless manually reset")."""
    if torch.nn.functional.linear is not torch._C._nn.linear:
        torch.nn.functional.linear = torch._C._nn.linear
