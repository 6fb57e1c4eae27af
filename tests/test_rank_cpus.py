"""``DSTEST_RANK_CPUS``: a threaded world's rank threads on any CPU (default) or all on one (issue 44).

Contracts: E1 (the threaded world's values are gloo's, whichever CPUs its threads run on), E4 (nothing of a run
outlives it: the caller's own CPUs are given back, parked threads serve later runs on theirs) and the project's
rule that a bad setting is refused with what is allowed, before any rank runs.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import InvalidArgument
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld, cpus

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="threads cannot be pinned here (not Linux)"),
]

OWN = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _where(ctx: Any) -> tuple[frozenset[int], frozenset[int], list[float]]:
    """This rank's CPUs, those of a thread it starts, and what a few collectives give."""
    seen: list[frozenset[int]] = []
    helper = threading.Thread(target=lambda: seen.append(frozenset(cpus._real_affinity(0))))
    helper.start()
    helper.join()
    t = torch.arange(4, dtype=torch.float32) * (ctx.rank + 1)
    for step in range(3):
        dist.all_reduce(t)
        t = t / (step + 2)
    out = torch.empty(4 * ctx.world_size)
    dist.all_gather_into_tensor(out, t)
    return frozenset(cpus._real_affinity(0)), seen[0], out.tolist()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_one_cpu_holds_every_rank_and_its_threads_on_one_cpu_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch, warm: bool
) -> None:
    world = ThreadedWorld(warm=warm)
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "any")
    spread = world.run(RunRequest(_where, 4))
    assert all(mine == set(OWN) and helper == set(OWN) for mine, helper, _ in spread)

    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    before = cpus._real_affinity(0)
    held = world.run(RunRequest(_where, 4))
    assert cpus._real_affinity(0) == before  # the caller's own CPUs, given back
    (cpu,) = held[0][0]
    assert cpu in OWN
    assert all(mine == {cpu} and helper == {cpu} for mine, helper, _ in held)
    assert [v for *_, v in held] == [v for *_, v in spread]

    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "any")  # a crew made under "one" is not reused under "any"
    again = world.run(RunRequest(_where, 4))
    assert all(mine == set(OWN) for mine, _, _ in again)


def _native_threads_on(cpu: int) -> list[str]:
    """The threads of this process that Python did not start (torch's intra-op threads) held on ``cpu`` alone,
    by id and name.

    Not autograd's device threads (``pt_autograd_<n>``, one per device of CUDA builds): torch starts them once
    per process, from whichever thread first needs them; started by a rank thread held on one CPU (an earlier
    test's FSDP or DDP step, under ``one``), they stay there. They run the backward of accelerator tensors,
    which a rank thread runs on itself (dstest turns autograd's multithreading off on rank threads)."""
    python = {t.native_id for t in threading.enumerate()}
    held = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            if tid not in python and not comm.startswith("pt_autograd_") and cpus._real_affinity(tid) == {cpu}:
                held.append(f"{tid} {comm}")
        except OSError:  # ended meanwhile
            pass
    return held


def _parallel_work(ctx: Any) -> tuple[int, list[str], float]:
    """A rank's large elementwise operation (split over torch's intra-op threads), then where those threads run."""
    t = torch.full((1 << 20,), float(ctx.rank + 1)).mul_(3.0).div_(3.0)  # exact: small integers
    total = t.sum().reshape(1)
    dist.all_reduce(total)
    (cpu,) = cpus._real_affinity(0)
    return cpu, _native_threads_on(cpu), total.item()


@pytest.mark.skipif(len(OWN) < 2 or torch.get_num_threads() < 2, reason="needs 2 CPUs and 2 torch threads")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_on_one_cpu_the_ranks_intra_op_threads_keep_every_cpu(monkeypatch: pytest.MonkeyPatch, warm: bool) -> None:
    """Under ``one`` the rank threads are held on one CPU, and the threads torch splits a large operation over
    are not: they were started before the pin, on the caller's CPUs (a rank's large matmul ran 2x slower when
    they were held too). No thread of the process but Python's is held on the ranks' CPU."""
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    out = ThreadedWorld(warm=warm).run(RunRequest(_parallel_work, 3))
    assert len({cpu for cpu, _, _ in out}) == 1
    assert [held for _, held, _ in out] == [[], [], []]
    assert [v for *_, v in out] == [(1 + 2 + 3) * float(1 << 20)] * 3


def _cpus_seen(ctx: Any, move: bool) -> dict[str, Any]:
    """What a rank's code reads of its CPUs (by pid 0 and by its thread id), where it really runs, and whether
    a DataLoader with a worker per CPU of the process warns that the rank has too few (warnings as errors)."""
    import torch.utils.data as data

    loader = data.DataLoader(list(range(8)), num_workers=len(OWN))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.check_worker_number_rationality()  # warns where num_workers exceeds the CPUs it reads
    seen = {
        "pid 0": sorted(os.sched_getaffinity(0)),
        "own tid": sorted(os.sched_getaffinity(threading.get_native_id())),
        "pid": sorted(os.sched_getaffinity(os.getpid())),
        "real": sorted(cpus._real_affinity(0)),
    }
    import subprocess

    def helper() -> None:  # a thread the rank starts, and a process that thread starts
        seen["helper"] = sorted(os.sched_getaffinity(0))
        child = subprocess.run([sys.executable, "-c", _CHILD_CPUS], capture_output=True, text=True, check=True)
        seen["helper's process"] = eval(child.stdout)

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    if move:  # the code moves its own thread (core binding): it sees where it put itself
        really = cpus._real_affinity(0)
        target = {max(OWN)} if really != {max(OWN)} else {min(OWN)}
        os.sched_setaffinity(0, target)
        try:
            seen["moved"] = (sorted(os.sched_getaffinity(0)), sorted(target))
        finally:
            os.sched_setaffinity(0, really)
    return seen


@pytest.mark.skipif(len(OWN) < 2, reason="needs two CPUs to tell one CPU from all")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_on_one_cpu_a_ranks_code_reads_the_cpus_a_rank_process_has(monkeypatch: pytest.MonkeyPatch, warm: bool) -> None:
    """Threads as processes: under ``one`` the rank threads run on one CPU, but the code they run reads the CPUs
    of the process, as each rank process of the process world reads them (a DataLoader sized to them gives no
    warning); the rank is still held on its one CPU, and code that moves its own thread reads where it is."""
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    threaded = ThreadedWorld(warm=warm).run(RunRequest(_cpus_seen, 3, args=(True,)))
    process = dstest.run(_cpus_seen, 3, world="process", args=(False,))
    for seen in threaded:
        assert seen["pid 0"] == seen["own tid"] == seen["pid"] == sorted(OWN), seen
        assert seen["helper"] == seen["helper's process"] == sorted(OWN), seen
        assert len(seen["real"]) == 1 and seen["real"][0] in OWN, seen
        assert seen["moved"][0] == seen["moved"][1], seen
    shown = ("pid 0", "own tid", "pid", "helper", "helper's process")
    assert [{k: s[k] for k in shown} for s in process] == [{k: s[k] for k in shown} for s in threaded]
    assert cpus._real_affinity(0) == OWN and os.sched_getaffinity(0) == OWN  # the caller, after the run


def test_the_values_are_gloos_on_one_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    threaded = dstest.run(_where, 2, world="threaded")
    process = dstest.run(_where, 2, world="process")
    assert [v for *_, v in threaded] == [v for *_, v in process]


def test_a_bad_setting_is_refused_before_any_rank_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "single")
    for warm in (True, False):
        with pytest.raises(InvalidArgument) as info:
            ThreadedWorld(warm=warm).run(RunRequest(lambda ctx: ran.append(ctx.rank), 2))
        assert "DSTEST_RANK_CPUS='single': expected 'auto' (the default" in str(info.value)
        assert "'any' (rank threads run on any CPU) or 'one'" in str(info.value)
    assert ran == []


def test_the_chosen_cpu_is_one_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    assert cpus.choose() in OWN
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "any")
    assert cpus.mode() == "any" and cpus.choose() is None
    if sys.platform.startswith("linux"):
        assert cpus._current_cpu() in OWN


def _own_cpus(ctx: Any) -> frozenset[int]:
    return frozenset(cpus._real_affinity(0))


def test_parked_threads_of_a_run_on_one_cpu_serve_later_runs_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """E4: a cold run's threads are made while its caller is held on the one CPU, so they start held too; those
    parked for later runs get the caller's own CPUs back, not the CPU of the run that made them."""
    from dstest.worlds.threaded import parked

    monkeypatch.setenv("DSTEST_PARKED_THREADS", str(parked.PARK_FROM))
    world = ThreadedWorld(warm=False)
    try:
        monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
        held = world.run(RunRequest(_own_cpus, parked.PARK_FROM))
        assert len(set(held)) == 1 and len(held[0]) == 1
        monkeypatch.setenv(cpus.ENV_RANK_CPUS, "any")
        later = world.run(RunRequest(_own_cpus, parked.PARK_FROM))
        assert set(later) == {frozenset(OWN)}
    finally:
        parked.shutdown_parked()


_HOLDS_A_CPU = """
import json, os, sys
os.environ["DSTEST_RANK_CPUS"] = "one"
from dstest.worlds.request import RunRequest
from dstest.worlds.threaded import ThreadedWorld, cpus

cpus._current_cpu = lambda: min(os.sched_getaffinity(0))  # both callers on the same CPU: the case claims settle

def where(ctx):
    return sorted(cpus._real_affinity(0))

print(json.dumps(ThreadedWorld(warm=True).run(RunRequest(where, 2))), flush=True)
sys.stdin.readline()  # keeps its claim until told to end
"""


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only: every process's ranks share it")
def test_two_processes_on_one_cpu_each_get_their_own(tmp_path: Any) -> None:
    """pytest-xdist's workers each run their rank threads on one CPU: on a CPU of their own while there are
    CPUs enough (each process claims one for its life), not all on the CPU their callers happened to share."""
    import json
    import subprocess

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])}
    procs = []
    seen = []
    try:
        for _ in range(2):
            p = subprocess.Popen(
                [sys.executable, "-c", _HOLDS_A_CPU], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            procs.append(p)
            assert p.stdout is not None
            seen.append(json.loads(p.stdout.readline()))
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    (a,), (b,) = ({tuple(r) for r in s} for s in seen)  # each process: one CPU for all its ranks
    assert len(a) == 1 and len(b) == 1 and a != b


# -- the parts, in this process (mutation testing found them untested: the two-process test runs them elsewhere)
@pytest.fixture
def no_claim(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """cpus without this process's claim, its claims under ``tmp_path``; whatever the test claims is let go."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cpus, "_claimed", None)
    handles: list[Any] = []
    yield handles
    for h in handles:
        h.close()
    if cpus._claimed is not None:
        cpus._claimed[1].close()


def test_the_setting_unset_empty_or_cased_reads_as_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpus.ENV_RANK_CPUS, raising=False)
    assert cpus.setting() == "auto" and cpus.mode() == cpus.auto_decision().mode
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "")
    assert cpus.setting() == "auto"
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, " One ")
    assert cpus.mode() == "one"
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "ANY")
    assert cpus.mode() == "any"
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "two")
    with pytest.raises(InvalidArgument) as info:
        cpus.mode()
    assert str(info.value) == (
        "DSTEST_RANK_CPUS='two': expected 'auto' (the default: 'one' where a hand-off between threads on two CPUs "
        "costs this machine much more than on one), 'any' (rank threads run on any CPU) or 'one' (every rank "
        "thread of a world on one CPU)"
    )


@pytest.fixture
def undecided(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``auto`` not yet decided in this process; the process's own decision put back afterwards."""
    monkeypatch.setattr(cpus, "_auto", None)
    monkeypatch.delenv(cpus.ENV_RANK_CPUS, raising=False)
    return monkeypatch


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only: auto has nothing to choose")
@pytest.mark.parametrize(
    ("ratio", "chosen"), [(cpus.AUTO_RATIO, "one"), (cpus.AUTO_RATIO * 0.99, "any"), (40.0, "one")]
)
def test_auto_holds_the_ranks_on_one_cpu_where_a_cross_cpu_hand_off_costs_the_ratio(
    undecided: pytest.MonkeyPatch, ratio: float, chosen: str
) -> None:
    """``auto`` (the default): ``one`` from :data:`cpus.AUTO_RATIO` up, measured once per process; the rank
    threads then run where the decision says, with the values of any CPU."""
    calls: list[int] = []
    undecided.setattr(cpus, "on_a_virtual_machine", lambda: False)  # bare metal: measured
    undecided.setattr(cpus, "handoff_ratio", lambda: calls.append(1) or ratio)
    assert cpus.decided() is None
    assert cpus.mode() == chosen and cpus.mode() == chosen and calls == [1]  # measured once
    decision = cpus.decided()
    assert decision is not None and decision.mode == chosen and decision.ratio == ratio
    assert f"took {ratio:.1f}x one on the same CPU here" in decision.describe()
    assert decision.describe().startswith(f"rank threads on {'one CPU' if chosen == 'one' else 'any CPU'}")
    held = ThreadedWorld(warm=False).run(RunRequest(_where, 3))
    assert all(len(mine) == (1 if chosen == "one" else len(OWN)) for mine, _, _ in held)
    undecided.setenv(cpus.ENV_RANK_CPUS, "any")
    assert [v for *_, v in ThreadedWorld(warm=False).run(RunRequest(_where, 3))] == [v for *_, v in held]


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only: auto has nothing to choose")
def test_auto_holds_the_ranks_on_one_cpu_on_a_virtual_machine_without_measuring(undecided: pytest.MonkeyPatch) -> None:
    undecided.setattr(cpus, "on_a_virtual_machine", lambda: True)
    undecided.setattr(cpus, "handoff_ratio", lambda: pytest.fail("measured on a virtual machine"))
    decision = cpus.auto_decision()
    assert (decision.mode, decision.ratio) == ("one", None) and cpus.mode() == "one"
    assert decision.describe() == (
        "rank threads on one CPU (DSTEST_RANK_CPUS=auto: a virtual machine (the CPUs' hypervisor flag): an idle "
        "CPU wakes slowly)"
    )


def test_a_virtual_machine_is_read_from_the_cpus_hypervisor_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import builtins

    real_open = builtins.open
    for flags, expected in (("fpu vme de hypervisor lahf_lm", True), ("fpu vme de lahf_lm", False)):
        info = tmp_path / f"cpuinfo-{expected}"
        info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins, "open", lambda path, *a, _i=info, **k: real_open(_i if path == "/proc/cpuinfo" else path, *a, **k)
        )
        assert cpus.on_a_virtual_machine() is expected
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert cpus.on_a_virtual_machine() is False


def test_auto_does_not_measure_where_the_process_has_one_cpu(undecided: pytest.MonkeyPatch) -> None:
    undecided.setattr(cpus, "handoff_ratio", lambda: pytest.fail("measured with one CPU"))
    undecided.setattr(cpus, "_real_affinity", lambda pid: {min(OWN)})
    decision = cpus.auto_decision()
    assert (decision.mode, decision.ratio, decision.reason) == ("any", None, "this process has one CPU")


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only")
def test_the_hand_off_measure_gives_the_callers_cpus_back_and_leaves_no_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    ratio = cpus.handoff_ratio(trips=20, rounds=1)
    assert ratio > 0
    assert cpus._real_affinity(0) == OWN
    assert {t.ident for t in threading.enumerate()} == before


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only")
def test_the_current_cpu_is_the_one_the_thread_is_held_on() -> None:
    def on(cpu: int, seen: list[int | None]) -> None:
        os.sched_setaffinity(0, {cpu})
        seen.append(cpus._current_cpu())

    for cpu in sorted(OWN):
        seen: list[int | None] = []
        t = threading.Thread(target=on, args=(cpu, seen))
        t.start()
        t.join()
        assert seen == [cpu]


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only")
def test_a_cpu_claimed_elsewhere_is_passed_over_and_the_claim_is_kept(
    monkeypatch: pytest.MonkeyPatch, no_claim: list[Any], tmp_path: Any
) -> None:
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    first, second = sorted(OWN)[:2]
    monkeypatch.setattr(cpus, "_current_cpu", lambda: first)
    other = cpus._claim(first)  # another process's claim (another open file: flock tells them apart)
    assert other is not None
    no_claim.append(other)
    assert cpus._claim(first) is None  # held: not claimed twice
    assert cpus.choose() == second
    assert cpus.choose() == second  # kept for the process's life
    folder = tmp_path / f"dstest-rank-cpus-{os.getuid()}"
    assert sorted(p.name for p in folder.iterdir()) == [f"cpu{first}.lock", f"cpu{second}.lock"]
    assert folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(len(OWN) < 2, reason="one CPU only")
def test_the_callers_cpu_first_and_a_claim_outside_the_allowed_cpus_is_not_kept(
    monkeypatch: pytest.MonkeyPatch, no_claim: list[Any]
) -> None:
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    first, second = sorted(OWN)[:2]
    monkeypatch.setattr(cpus, "_current_cpu", lambda: second)
    assert cpus.choose() == second  # the caller's CPU, not the lowest
    held: list[int | None] = []

    def narrowed() -> None:  # a thread allowed only the other CPU: the process's claim is not on it
        os.sched_setaffinity(0, {first})
        held.append(cpus.choose())

    t = threading.Thread(target=narrowed)
    t.start()
    t.join()
    assert held == [first]
    monkeypatch.setattr(cpus, "_current_cpu", lambda: None)  # not known: the lowest allowed CPU
    cpus._claimed[1].close()  # type: ignore[index]
    monkeypatch.setattr(cpus, "_claimed", None)
    assert cpus.choose() == first


def test_own_is_the_calling_threads_cpus_and_a_bad_pin_is_ignored() -> None:
    assert cpus.own() == OWN
    cpus.pin(None)
    cpus.pin(10_000)  # no such CPU: sched_setaffinity refuses, the thread keeps its CPUs
    assert os.sched_getaffinity(0) == OWN


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_holds_no_claim_of_its_parents(monkeypatch: pytest.MonkeyPatch, no_claim: list[Any]) -> None:
    """A process world's worker is forked: its rank threads must claim a CPU of their own, not share the
    claim (and the lock) of the process that forked it."""
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    cpus.choose()
    assert cpus._claimed is not None
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork() in a process with threads; the child only reports
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report, and leave without running any of the parent's cleanup
        os.write(write, b"none" if cpus._claimed is None else b"held")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 8) == b"none"
    os.close(read)


_CHILD_CPUS = "import os, sys; print(sorted(os.sched_getaffinity(0)))"


def _cpus_from_child_fork(out: Any) -> None:
    out.put(sorted(os.sched_getaffinity(0)))


def _started_processes(ctx: Any, tmp: str) -> dict[str, Any]:
    """The CPUs of processes this rank starts, each way a library starts one, and its own CPUs after each."""
    import multiprocessing
    import subprocess

    seen: dict[str, Any] = {}
    mine: list[frozenset[int]] = []
    proc = subprocess.run([sys.executable, "-c", _CHILD_CPUS], capture_output=True, text=True, check=True)
    seen["subprocess"] = eval(proc.stdout)
    mine.append(frozenset(cpus._real_affinity(0)))
    path = os.path.join(tmp, f"system{ctx.rank}")
    assert os.system(f"{sys.executable} -c '{_CHILD_CPUS}' > {path}") == 0
    with open(path) as f:
        seen["os.system"] = eval(f.read())
    mine.append(frozenset(cpus._real_affinity(0)))
    with subprocess.Popen([sys.executable, "-c", _CHILD_CPUS], stdout=subprocess.PIPE, text=True, close_fds=False) as p:
        seen["posix_spawn"] = eval(p.communicate()[0])  # close_fds=False: subprocess may use posix_spawn
    mine.append(frozenset(cpus._real_affinity(0)))
    for method in ("fork", "spawn"):
        mp = multiprocessing.get_context(method)
        out = mp.SimpleQueue()
        child = mp.Process(target=_cpus_from_child_fork, args=(out,))
        child.start()
        seen[method] = out.get()
        child.join()
        mine.append(frozenset(cpus._real_affinity(0)))
    seen["mine"] = sorted(set().union(*mine)) if len(set(mine)) == 1 else [sorted(m) for m in mine]
    return seen


@pytest.mark.skipif(len(OWN) < 2, reason="needs two CPUs to tell one CPU from all")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_on_one_cpu_the_processes_a_rank_starts_get_every_cpu_and_the_rank_stays_on_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, warm: bool
) -> None:
    """E4 (nothing of the setting outlives the run's own threads): a process inherits the CPUs of the thread
    that starts it; on one CPU, a rank's ``subprocess`` (fork_exec and posix_spawn), ``os.system`` and
    multiprocessing's fork and spawn children run on every CPU the caller had, as on any CPU, and the rank
    thread is back on its one CPU after each."""
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process with threads (Python 3.12+)
        seen = ThreadedWorld(warm=warm).run(RunRequest(_started_processes, 2, args=(str(tmp_path),)))
    for rank_seen in seen:
        mine = rank_seen.pop("mine")
        assert len(mine) == 1, mine  # one CPU, the same after every start
        assert rank_seen == {k: sorted(OWN) for k in rank_seen}, rank_seen


def test_with_v_the_session_says_where_auto_held_the_rank_threads_and_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_spec="""
        import dstest, torch, torch.distributed as dist

        @dstest.spec(world_size=[2], worlds=["threaded"])
        def test_sum(ctx):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    monkeypatch.delenv(cpus.ENV_RANK_CPUS, raising=False)  # the default, auto: the child decides for itself
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines(
        [
            r"dstest: rank threads on (one|any) CPU \(DSTEST_RANK_CPUS=auto: (a hand-off between threads on two CPUs "
            r"took [0-9.]+x one on the same CPU here|this process has one CPU|threads cannot be pinned here|"
            r"a virtual machine \(the CPUs' hypervisor flag\): an idle CPU wakes slowly)\)"
        ]
    )


def _bind_to_a_core(ctx: Any) -> None:
    os.sched_setaffinity(0, {max(OWN)})  # as a launcher's --bind-to-core, or DeepSpeed's --bind_cores_to_rank


@pytest.mark.skipif(len(OWN) < 2, reason="needs two CPUs to tell one CPU from all")
@pytest.mark.parametrize("mode", ["any", "one"])
def test_a_run_that_binds_its_ranks_to_a_core_leaves_the_next_run_where_a_new_thread_starts(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """E4: a warm crew's rank threads serve one test after another; one whose code bound its thread to a core
    (``os.sched_setaffinity``) is put back on the crew's CPUs before the next run, as a new thread (and a fresh
    process) would start there."""
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, mode)
    world = ThreadedWorld(warm=True)
    before = world.run(RunRequest(_where, 3))
    world.run(RunRequest(_bind_to_a_core, 3))
    after = world.run(RunRequest(_where, 3))
    assert [mine for mine, _, _ in after] == [mine for mine, _, _ in before]
    assert all(mine == (OWN if mode == "any" else mine) for mine, _, _ in after)


@pytest.mark.skipif(len(OWN) < 2, reason="needs two CPUs to tell one CPU from all")
def test_a_parked_thread_a_run_bound_to_a_core_serves_the_next_run_on_every_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dstest.worlds.threaded import parked

    monkeypatch.setenv("DSTEST_PARKED_THREADS", str(parked.PARK_FROM))
    monkeypatch.setenv(cpus.ENV_RANK_CPUS, "any")
    world = ThreadedWorld(warm=False)
    try:
        world.run(RunRequest(_bind_to_a_core, parked.PARK_FROM))
        assert parked.parked_threads() == parked.PARK_FROM
        later = world.run(RunRequest(_own_cpus, parked.PARK_FROM))
        assert set(later) == {frozenset(OWN)}
    finally:
        parked.shutdown_parked()
