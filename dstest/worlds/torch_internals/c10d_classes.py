"""torch's C++ c10d classes that dstest builds itself: stores, the options of each collective, gloo's group.

They live in the private module ``torch._C._distributed_c10d`` (where they are typed; ``torch.distributed``
re-exports most of them under the same objects, but not every options class: ``AllgatherOptions`` is missing
there in torch 2.11-2.15). Each function below builds one, for the threaded, process and launched worlds.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

from torch._C import _distributed_c10d as c10d_c

__all__ = [
    "c10d_options",
    "file_store",
    "gloo_backend_type",
    "gloo_group",
    "prefix_store",
    "tcp_client_store",
]


def prefix_store(prefix: str, store: Any) -> c10d_c.PrefixStore:
    """``store`` seen under ``prefix`` (every key prefixed): ``PrefixStore`` (torch 2.11-2.15)."""
    return c10d_c.PrefixStore(prefix, store)


def file_store(path: str, world_size: int) -> c10d_c.FileStore:
    """A store in a file that ``world_size`` processes share: ``FileStore`` (torch 2.11-2.15)."""
    return c10d_c.FileStore(path, world_size)


def tcp_client_store(host: str, port: int, timeout: datetime.timedelta) -> c10d_c.TCPStore:
    """A client of the TCP store another process hosts at ``host:port``: ``TCPStore`` (torch 2.11-2.15)."""
    return c10d_c.TCPStore(host, port, is_master=False, timeout=timeout)


def c10d_options(name: str) -> Any:
    """A fresh options object of the class ``name`` (``AllreduceOptions``, ``AllgatherOptions``...), as torch
    passes a group's method when its caller gave none (torch 2.11-2.15 keep them all in the C++ module)."""
    return getattr(c10d_c, name)()


def gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta, *, numbered: bool = False) -> Any:
    """gloo's own process group (``ProcessGroupGloo``) of ``size`` ranks over ``store``.

    ``numbered``: also give it the sequence number torch gives the gloo groups it creates
    (``_set_sequence_number_for_group``, torch 2.11-2.14; 2.15 made it a no-op that warns "deprecated"; a
    failure to is ignored, as a group works without).
    """
    inner = c10d_c.ProcessGroupGloo(store, rank, size, timeout)
    if numbered:
        with contextlib.suppress(Exception):  # the number only labels the group's calls in torch's logs
            inner._set_sequence_number_for_group()
    return inner


def gloo_backend_type() -> Any:
    """``ProcessGroup.BackendType.GLOO``: the key under which a group registers a gloo backend for C++ code
    that asks a group for its backend by type (DDP's logger; torch 2.11-2.15)."""
    return c10d_c.ProcessGroup.BackendType.GLOO
