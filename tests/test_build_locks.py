"""JIT builds of native ops on a first run (issue 40, finding 7): no run is poisoned by a build an earlier one left.

torch's ``cpp_extension.load`` builds under a ``FileBaton``: ``<build dir>/lock``, created with ``O_EXCL`` and
held open by the builder until it removes it. A builder killed mid-build (the process world kills a pool at a
timeout) leaves the file, and every later build of that extension waits on it, with no limit. Here, without
DeepSpeed (CI has none), with real ``cpp_extension.load`` calls that reach torch's wait (no compiler runs: the
lock is there first) and short timeouts:

- a lock no live process holds is found and removed; one held by a live process (this one, or another) is not;
- a rank waiting on a build lock says so in the timeout's report, naming the lock, on the threaded and the
  process world, and the stale lock is gone afterwards (the next run is not poisoned);
- a rank killed while holding a build lock (the first spec's builder at its timeout) leaves no lock behind;
- a target's ``prepare(device)`` (where DeepSpeed's and impl's builds now happen) runs once, in the caller's
  thread, before the timed part: a prepare longer than the run's timeout does not fail the run, and under
  pytest (the ``dstest`` command) its progress is shown before the specs start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

import dstest
from dstest.errors import WorldTimeout

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]

#: torch 2.15 builds under an OS advisory lock (``torch.utils._filelock``) that the kernel drops when its holder
#: dies, so a killed builder leaves nothing that blocks; torch 2.11-2.14 build under ``FileBaton``, whose lock
#: file blocks every later build for as long as it exists (the finding's case).
baton_builds = pytest.mark.skipif(
    not hasattr(cpp_extension, "FileBaton"),
    reason="this torch's cpp_extension builds under an OS lock, not FileBaton: a killed builder leaves no lock that blocks",
)
SOURCE = "int dstest_lock_probe() { return 1; }\n"


def _stale_lock(root: Path, name: str) -> Path:
    """What a builder killed mid-build leaves: the build directory with torch's empty ``lock`` in it."""
    build = root / name
    build.mkdir(parents=True)
    lock = build / "lock"
    lock.touch()
    return lock


# -- bodies (module level: the process world sends them by reference) ------------------------------------
def loads_extension(ctx: Any, root: str, source: str, name: str, ranks: tuple[int, ...]) -> int:
    """Ranks in ``ranks`` build extension ``name`` as a library does on first use (DeepSpeed's op builders
    call ``cpp_extension.load`` with no build directory: torch puts it under ``TORCH_EXTENSIONS_DIR``)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    if ctx.rank in ranks:
        cpp_extension.load(name=name, sources=[source])
    return int(ctx.rank)


def holds_then_waits(ctx: Any, root: str, source: str, name: str) -> int:
    """Rank 0 is the builder (it holds the extension's build lock, as torch's ``_jit_compile`` does while ninja
    runs, and is still at it when the timeout fires); rank 1 builds the same extension and waits on rank 0."""
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    lock = os.path.join(root, name, "lock")
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        assert FileBaton(lock).try_acquire()
        while True:  # the compiler, for longer than the run's timeout
            time.sleep(0.05)
    while not os.path.exists(lock):  # rank 0 took the lock first, as a builder that started earlier
        time.sleep(0.01)
    cpp_extension.load(name=name, sources=[source])
    return int(ctx.rank)


def prepared_marker(ctx: Any, marker: str) -> bool:
    """What the ranks of a target whose build is done in ``prepare`` find: the build's output."""
    ctx.target.check_built()
    return os.path.exists(marker)


# -- finding the lock's holders, removing a stale one -----------------------------------------------------
def test_a_lock_no_process_holds_is_removed_a_held_one_is_kept(tmp_path: Path) -> None:
    from dstest.worlds import build_locks

    lock = _stale_lock(tmp_path, "ext")
    state = build_locks.clear_if_stale(lock)
    assert state.removed and state.holders == () and not lock.exists(), state

    baton = FileBaton(str(lock))  # this process builds: it holds the lock open, as torch's builder does
    assert baton.try_acquire()
    try:
        state = build_locks.clear_if_stale(lock)
        assert not state.removed and state.holders == (os.getpid(),) and lock.exists(), state
        assert f"pid {os.getpid()}" in state.describe()
    finally:
        baton.release()

    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from torch.utils.file_baton import FileBaton
            assert FileBaton({str(lock)!r}).try_acquire()
            print("held", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    ) as other:  # fmt: skip
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "held"
            state = build_locks.clear_if_stale(lock)
            assert not state.removed and state.holders == (other.pid,) and lock.exists(), state
        finally:
            other.kill()
            other.wait()
    state = build_locks.clear_if_stale(lock)  # its builder died with it: the lock is stale now
    assert state.removed and not lock.exists(), state
    assert build_locks.clear_if_stale(lock).holders == ()  # no lock: nothing to do, nothing held


def test_the_build_directory_is_the_one_torch_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dstest finds DeepSpeed's op's lock where torch's ``load`` puts it, with and without TORCH_EXTENSIONS_DIR."""
    from dstest.worlds import build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_locks.torch_build_dir("probe") == Path(cpp_extension._get_build_directory("probe", False))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build_locks.torch_build_dir("probe") == Path(cpp_extension._get_build_directory("probe", False))


def test_the_stacks_of_waiting_and_building_ranks_are_recognised() -> None:
    """Both stack formats: faulthandler's (the process world) and traceback's (the threaded world)."""
    from dstest.worlds import build_locks

    waiting_fh = '  File "/x/torch/utils/file_baton.py", line 50 in wait\n  File "/x/torch/utils/cpp_extension.py", line 2400 in _jit_compile\n'
    waiting_tb = '  File "/x/torch/utils/cpp_extension.py", line 2400, in _jit_compile\n    baton.wait()\n  File "/x/torch/utils/file_baton.py", line 50, in wait\n'
    building = '  File "/x/torch/utils/cpp_extension.py", line 2388 in _jit_compile\n  File "/x/torch/utils/cpp_extension.py", line 2500 in _write_ninja_file_and_build_library\n'
    assert build_locks.stack_kind(waiting_fh) == build_locks.stack_kind(waiting_tb) == "waiting"
    assert build_locks.stack_kind(building) == "building"
    assert build_locks.stack_kind('  File "/x/mine.py", line 3 in wait\n') is None


# -- a rank waiting on a build lock, at the timeout -------------------------------------------------------
@baton_builds
@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_waiting_on_a_stale_build_lock_is_told_and_the_lock_removed(
    world: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding's second spec: a killed build left the lock; the rank waits on it until the timeout. The
    report says which lock and that it was left by a build no process runs any more; the lock is gone after,
    so the run after it is not poisoned (before: the lock stayed and every later run waited its timeout)."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))  # the parent's view of where builds go (as a user's)
    name = f"dstest_stale_probe_{world}"
    lock = _stale_lock(root, name)
    source = tmp_path / "probe.cpp"
    source.write_text(SOURCE)
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        dstest.run(loads_extension, 2, world=world, timeout=3, args=(str(root), str(source), name, (1,)))
    assert time.monotonic() - start < 30
    msg = str(info.value)
    first = msg.splitlines()[0]
    assert "rank 1 was waiting on a torch extension build lock" in first, first
    assert f"rank 1 was waiting in torch's FileBaton.wait on the build lock {lock}" in msg, msg
    assert "no live process holds it" in msg and "removed it" in msg, msg
    assert not lock.exists(), "the stale lock is still there: every later build of the extension would wait on it"


@baton_builds
def test_a_rank_killed_while_holding_a_build_lock_leaves_no_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding's first spec: rank 0 builds (holds the lock), rank 1 waits on it, the timeout kills both.
    Killed, the builder can no longer remove its lock; dstest does, and says who held it."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    name = "dstest_killed_builder_probe"
    source = tmp_path / "probe.cpp"
    source.write_text(SOURCE)
    with pytest.raises(WorldTimeout) as info:
        dstest.run(holds_then_waits, 2, world="process", timeout=4, args=(str(root), str(source), name))
    msg = str(info.value)
    lock = root / name / "lock"
    assert f"rank 1 was waiting in torch's FileBaton.wait on the build lock {lock}" in msg, msg
    assert "held by rank 0 (pid " in msg and "killed with the pool" in msg, msg
    assert not lock.exists(), "the killed builder's lock is still there: every later run would wait on it"


# -- builds before the timed part -----------------------------------------------------------------------
_MARKER: list[str] = []  # where PreparedTarget.prepare writes its "build" (set by the test, in this process)


class PreparedTarget:
    """A target whose ranks need a build made first: ``prepare`` builds it (slower than the run's timeout)."""

    name = "prepared_probe"
    third_party = True
    default_world = "threaded"
    config_errors = (ValueError,)
    prepared: ClassVar[list[tuple[str, int, str]]] = []  # (device, pid, thread name) of each prepare

    @staticmethod
    def prepare(device: str) -> None:
        import threading

        PreparedTarget.prepared.append((device, os.getpid(), threading.current_thread().name))
        time.sleep(2.5)
        for path in _MARKER:
            Path(path).write_text("built")

    def supports(self, feature: str) -> bool:
        return feature == "is_parallel"

    def check_built(self) -> None:
        pass


@pytest.mark.parametrize("world", WORLDS)
def test_a_targets_prepare_runs_once_before_the_timed_part(world: str, tmp_path: Path) -> None:
    from dstest.binding import forget_prepared
    from dstest.registry import register_target

    register_target("prepared_probe", PreparedTarget, replace=True)
    forget_prepared("prepared_probe")
    PreparedTarget.prepared.clear()
    marker = tmp_path / "built"
    _MARKER[:] = [str(marker)]
    try:
        # prepare takes 2.5 s, the run's timeout is 2 s: counted in the run, the first run would time out
        assert dstest.run(prepared_marker, 2, world=world, target="prepared_probe", timeout=2, args=(str(marker),)) == [
            True,
            True,
        ]
        assert dstest.run(prepared_marker, 2, world=world, target="prepared_probe", timeout=2, args=(str(marker),)) == [
            True,
            True,
        ]
    finally:
        _MARKER.clear()
    import threading

    assert PreparedTarget.prepared == [("cpu", os.getpid(), threading.current_thread().name)]


PLUGIN = '''
import os, sys, time

import torch.distributed as dist

MARKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built")


class BuildingTarget:
    """is_parallel needs an op that prepare builds; the build is slower than the spec's timeout."""

    name = "buildingtarget"
    third_party = True
    default_world = "threaded"
    config_errors = (ValueError,)

    @staticmethod
    def prepare(device):
        print("building the probe op (first run on this machine) ...", file=sys.stderr, flush=True)
        time.sleep(2.5)
        with open(MARKER, "w") as f:
            f.write("built")

    def supports(self, feature):
        return feature == "is_parallel"

    def is_parallel(self, group):
        if not os.path.exists(MARKER):
            raise RuntimeError("the probe op was not built before the run")
        return group is not None and dist.get_world_size(group) > 1


def pytest_dstest_targets():
    return {"buildingtarget": BuildingTarget}
'''


def test_the_dstest_command_builds_before_the_specs_and_says_so(pytester: pytest.Pytester) -> None:
    """``dstest --target X``: X's prepare runs once, before the first spec, its progress on stderr ahead of
    the runs' progress; the specs' 2 s timeout does not count its 2.5 s."""
    pytester.makepyfile(buildingplugin=PLUGIN)
    result = pytester.run(
        sys.executable, "-m", "dstest", "-p", "buildingplugin", "--target", "buildingtarget",
        "--world", "threaded", "-k", "A1", "--timeout", "2",
        timeout=300,
    )  # fmt: skip
    err = result.stderr.str()
    assert result.ret == 0, result.stdout.str() + err
    assert "3 passed, 0 failed" in result.stdout.str(), result.stdout.str()
    assert err.count("building the probe op (first run on this machine) ...") == 1, err
    assert err.index("building the probe op") < err.index("runs done"), err


# -- impl's and DeepSpeed's builds --------------------------------------------------------------------------
def test_impl_builds_its_ops_in_prepare(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """impl's ZeRO-3 gatherer compacts with its native op, built on first use: the impl target builds it in
    prepare (and says so when a build is due), so no spec's rank builds it inside its timeout."""
    from dstest.targets.impl import ImplTarget
    from impl.ops import _build

    calls: list[str] = []
    built = [False]
    monkeypatch.setattr(_build, "load_extension", lambda: calls.append("load"))
    monkeypatch.setattr(_build, "is_built", lambda: built[0])
    ImplTarget.prepare("cpu")
    assert calls == ["load"]
    err = capsys.readouterr().err
    assert "building impl's native ops" in err and "built impl's native ops in" in err, err
    built[0] = True  # built: a rank's load only checks the build (about a second); nothing to do here
    ImplTarget.prepare("cpu")
    assert calls == ["load"] and capsys.readouterr().err == ""


def test_a_stale_lock_of_deepspeeds_op_is_removed_before_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the rank, before DeepSpeed's communication backend builds its shm_comm op (and before the session's
    prebuild), a lock left by a killed build of that op is removed: DeepSpeed need not be installed to test it."""
    from dstest.targets import _deepspeed_setup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _stale_lock(tmp_path, "deepspeed_shm_comm")
    state = _deepspeed_setup.clear_stale_op_lock()
    assert state is not None and state.removed and not lock.exists(), state


def test_a_build_in_a_subprocess_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """The session's prebuild of DeepSpeed's op runs in a child process and says every few seconds that it
    is still building (a first build takes minutes on a busy machine)."""
    from dstest.targets import _deepspeed_setup

    code = _deepspeed_setup.run_build(
        [sys.executable, "-c", "import time; time.sleep(1.3)"], env=dict(os.environ), what="the probe op", every=0.5
    )
    err = capsys.readouterr().err
    assert code == 0
    assert err.count("still building the probe op") >= 1, err
    assert "built the probe op in" in err, err


def test_deepspeeds_build_is_due_when_its_library_is_missing_or_older_than_a_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session builds DeepSpeed's op only when a rank would compile it (no library, or a source newer than
    it: DeepSpeed upgraded); otherwise it starts no child process at all."""
    from dstest.targets import _deepspeed_setup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    source = tmp_path / "shm.cpp"
    source.write_text(SOURCE)
    (build / "build.ninja").write_text(f"build shm.o: compile {source}\nbuild deepspeed_shm_comm.so: link shm.o\n")
    assert _deepspeed_setup._build_due()  # no library
    library = build / "deepspeed_shm_comm.so"
    library.write_bytes(b"")
    os.utime(source, (time.time() - 100, time.time() - 100))
    assert not _deepspeed_setup._build_due()
    os.utime(source, (time.time() + 100, time.time() + 100))
    assert _deepspeed_setup._build_due()  # a source changed after the build


def user_body(ctx: Any) -> int:
    return int(ctx.rank)


def test_a_users_spec_on_the_default_target_does_not_build_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A project's own spec on the default target (impl) never pays for impl's native build, nor needs a
    compiler for it: only the bundled conformance specs and runs naming another target prepare theirs."""
    from dstest.binding import forget_prepared
    from dstest.targets.impl import ImplTarget

    calls: list[str] = []
    monkeypatch.setattr(ImplTarget, "prepare", staticmethod(lambda device: calls.append(device)))
    forget_prepared("impl")
    assert dstest.run(user_body, 2) == [0, 1]
    assert calls == []
    from dstest.conformance import optional_groups
    from dstest.specification import Case, Settings, run_spec, spec_info

    info = spec_info(optional_groups.test_a1_none_is_absent)
    assert info is not None
    run_spec(info, Case(world="threaded", world_size=1), Settings(), {})
    assert calls == ["cpu"]
    forget_prepared("impl")
