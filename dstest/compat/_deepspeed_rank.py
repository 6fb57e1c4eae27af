"""One rank of a DeepSpeed test, in a warm worker of the process world (:mod:`dstest.compat.deepspeed`).

:func:`rank_main` is the process world's rank function for every warm launch: it imports the test's module
as pytest did, unpickles the test instance and calls the harness's own per-rank entry point
(``DistributedExec._dist_run``), after making the worker look like a fresh process of the harness's pool
(torch's RNG, py-cpuinfo's answer kept, and for a test that forms its own world, the worker's world hidden).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import traceback
from typing import TYPE_CHECKING, Any

from dstest.compat._hidden_world import world_hidden

if TYPE_CHECKING:
    from dstest.worlds.process.byref import ModuleRef

__all__ = ["RANK_ENTRY", "rank_main"]

RANK_ENTRY = "_dist_run"  # DistributedExec._dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg)


class _SkipBox:
    """Stands in for the harness's skip queue (``skip_msg.put``) of non-daemonic launches."""

    def __init__(self) -> None:
        self.message = ""

    def put(self, message: str) -> None:
        self.message = message


def _remember_cpu_info() -> None:
    """``cpuinfo.get_cpu_info()`` answered from memory after its first call in this worker.

    DeepSpeed asks py-cpuinfo about the CPU each time it builds a CPU optimizer or checks an op (every
    ``DeepSpeedCPUAdam``, on every rank), and each call starts a Python subprocess that probes the CPU: about
    1.5 s on this 2-core machine, the largest part of an offload test's time on warm workers. The answer is
    the same for every process on the machine, so a worker asks once and hands out copies; a test that
    patches ``cpuinfo.get_cpu_info`` replaces the memo for as long as its patch lasts.
    """
    try:
        import cpuinfo
    except ImportError:
        return
    ask = cpuinfo.get_cpu_info
    if getattr(ask, "_dstest_remembers", False):
        return
    answers: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if not answers:
            answers.append(ask())
        return copy.deepcopy(answers[0])

    get_cpu_info._dstest_remembers = True  # type: ignore[attr-defined]
    get_cpu_info.__wrapped__ = ask  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def _skip_location(exc: BaseException) -> tuple[str, int] | None:
    """Where the test called pytest.skip: the innermost frame outside pytest."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}_pytest{os.sep}" not in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    return frame.filename, int(frame.lineno or 0)


def rank_main(ctx: Any, payload: bytes, ref: ModuleRef, path: list[str], port: int, hide: bool = False) -> Any:
    """One rank of a warm launch: ``(skip message, where the test skipped)``, the message empty unless the
    test skipped. ``payload`` is the pickled test instance, ``ref`` its module, ``path`` the pytest
    process's ``sys.path``, ``port`` the ``MASTER_PORT`` the harness's environment gets, ``hide`` whether
    the test forms its own world."""
    from _pytest.outcomes import Skipped

    from dstest.worlds.process.byref import fresh_process_rng, import_module_ref, put_path_first

    put_path_first(path)
    _remember_cpu_info()
    import_module_ref(ref)
    fresh_process_rng()
    test = pickle.loads(payload)
    location: list[tuple[str, int] | None] = [None]
    run = test.run

    def run_noting_skips(**kwargs: Any) -> Any:
        try:
            return run(**kwargs)
        except Skipped as exc:
            location[0] = _skip_location(exc)
            raise

    test.run = run_noting_skips
    box = _SkipBox()
    # Destroying the test's groups does not close its TCPStore while DeepSpeed's objects still refer to it:
    # its port (DeepSpeed's default, 29500, when the test sees no MASTER_PORT) would stay taken, and the next
    # test that binds that port fails. A fresh process for the next test, as the harness gives every test.
    hidden = world_hidden(
        drop_dist_env=not getattr(test, "set_dist_env", True), replace_after="the test formed a world of its own"
    )
    with hidden if hide else contextlib.nullcontext():
        returned = getattr(test, RANK_ENTRY)(ctx.rank, ctx.world_size, port, None, box)
    message = returned if isinstance(returned, str) else box.message
    return (message, location[0] if message else None)
