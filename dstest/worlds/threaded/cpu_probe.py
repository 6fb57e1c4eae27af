"""What the machine says about where threads run: the CPUs a thread may use, the CPU it runs on now, whether the
CPUs run under a hypervisor, and what a GIL hand-off between threads on different CPUs costs against one on the
same CPU. Read by :mod:`.cpus`, which decides where rank threads run; standard library only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

__all__ = ["current_cpu", "handoff_ratio", "on_a_virtual_machine", "os_affinity", "real_affinity"]

#: ``os.sched_getaffinity`` as the operating system gives it (None where it does not exist), taken before
#: :mod:`.cpus` may wrap it for rank code.
os_affinity: Callable[[int], set[int]] | None = getattr(os, "sched_getaffinity", None)


def real_affinity(pid: int) -> set[int]:
    """The CPUs thread ``pid`` may run on, as the operating system says (rank code may be shown others:
    :func:`.cpus._affinity_as_a_process_sees_it`); only where ``os.sched_getaffinity`` exists."""
    assert os_affinity is not None
    return os_affinity(pid)


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (Linux: the 39th field of its ``stat``), or None."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return int(fields[36])  # field 39 of the whole line; the first two (pid, comm) are cut
    except (IndexError, ValueError):
        return None


def on_a_virtual_machine() -> bool:
    """Whether the CPUs say they run under a hypervisor (x86's ``hypervisor`` flag in ``/proc/cpuinfo``).

    There, a thread woken on an idle CPU waits for the hypervisor to run that CPU again: measured on a 2-CPU
    VM, a GIL hand-off between threads on two CPUs took 9-14x one on the same CPU when the machine was quiet.
    The hand-off measure itself is not used there: while any thread of the machine keeps a CPU busy (torch's
    OpenMP threads spin for a while after a parallel operation, another pytest-xdist worker), both ways cost
    the same (measured 1.0x), so a process's decision would depend on what ran just before it."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return b" hypervisor" in line
    except OSError:
        pass
    return False


def handoff_ratio(trips: int = 100, rounds: int = 2) -> float:
    """Median time of a GIL hand-off between two threads that may run on any CPU, over the same between two
    threads held on the caller's CPU: a ping-pong of ``trips`` round trips per round through two locks, the
    two ways alternating for ``rounds`` rounds (about 10-30 ms in all). The caller's own CPUs are given back."""
    import _thread
    import time

    mine = real_affinity(0)
    here = current_cpu()
    here = here if here in mine else min(mine)
    ping, pong = _thread.allocate_lock(), _thread.allocate_lock()
    ping.acquire()
    pong.acquire()
    place: list[set[int]] = [mine]
    stop = False

    def partner() -> None:
        while True:
            ping.acquire()
            if stop:
                return
            with contextlib.suppress(OSError):
                if real_affinity(0) != place[0]:
                    os.sched_setaffinity(0, place[0])
            pong.release()

    thread = threading.Thread(target=partner, name="dstest-cpu-probe", daemon=True)
    thread.start()
    times: dict[str, list[int]] = {"any": [], "one": []}
    try:
        for _ in range(rounds):
            for way in ("any", "one"):
                place[0] = mine if way == "any" else {here}
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, place[0])
                for trip in range(trips + 10):
                    start = time.perf_counter_ns()
                    ping.release()
                    pong.acquire()
                    if trip >= 10:  # the first trips move the partner
                        times[way].append(time.perf_counter_ns() - start)
    finally:
        stop = True
        ping.release()
        thread.join(1.0)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mine)
    times["any"].sort()
    times["one"].sort()
    one = times["one"][len(times["one"]) // 2]
    return times["any"][len(times["any"]) // 2] / max(one, 1)
