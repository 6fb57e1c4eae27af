"""Baseline: torch's own threaded process group, driven the way MultiThreadedTestCase drives it.

Private torch API (``torch.testing._internal``), used only as a yardstick in benchmarks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def run_torch_threaded(fn: Callable[[int, int], Any], world_size: int) -> list[Any]:
    """Run ``fn(rank, world_size)`` on ``world_size`` threads over torch's "threaded" backend."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtp

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtp._install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size)
        except BaseException as exc:
            errors.append(exc)
            mtp.ProcessLocalGroup.exception_handle(exc)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        mtp.ProcessLocalGroup.reset()
        mtp._uninstall_threaded_pg()
        # Thread isolation stays on: dstest's warm crews in this process rely on it (torch has no getter
        # to restore the previous mode exactly).
    if errors:
        raise errors[0]
    return results
