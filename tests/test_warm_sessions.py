"""``pytest --dstest-warm``: a later run is forked from a server that has imported what the session needs, with
the verdicts of a cold run, and never with stale code (contract F3).

Each test has its own server directory (``DSTEST_WARM_DIR``) and stops its servers at the end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from _warm import settled, stop_servers, wait_for_server

pytestmark = pytest.mark.cpu

FORKED = "dstest warm: forked from a warm server"
COLD = "dstest warm: cold run"

TESTS = """
import dstest
import torch.distributed as dist
import mylib

@dstest.spec(world_size=2, worlds=("process",), contract="F3")
def test_process_ranks_agree(ctx):
    import torch
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0

def test_library_value():
    assert mylib.VALUE == _on_disk(mylib)

def test_fails():
    assert 1 == 2

@dstest.spec(world_size=2, worlds=("process",))
def test_workers_see_library_value(ctx):
    import mylib
    assert mylib.VALUE == _on_disk(mylib)

def _on_disk(module):
    import re
    with open(module.__file__) as f:
        return int(re.search(r"^VALUE = ([0-9]+)$", f.read(), re.M).group(1))
"""

CONFTEST = """
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))

def pytest_configure(config):
    from dstest.worlds.process.byref import preload_in_fork_server
    preload_in_fork_server("mylib")
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """A project whose conftest puts ``lib/`` on sys.path and preloads ``mylib`` in the workers (so the warm
    server imports it too); its own server directory; the servers stopped afterwards."""
    warm_dir = tmp_path_factory.mktemp("warm")
    os.chmod(warm_dir, 0o700)
    monkeypatch.setenv("DSTEST_WARM_DIR", str(warm_dir))
    monkeypatch.setenv("DSTEST_WARM_IDLE", "120")
    (pytester.path / "lib").mkdir()
    (pytester.path / "lib" / "mylib.py").write_text("VALUE = 1\n")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_project=TESTS)
    settled(pytester.path / "lib" / "mylib.py")  # the first server knows which version it imported
    yield pytester, warm_dir
    stop_servers()


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("--dstest-warm", "-p", "no:cacheprovider", "-rA", *args, timeout=240)


def _header(result: pytest.RunResult) -> str:
    return next((line for line in result.outlines if line.startswith("dstest warm:")), "")


def test_f3_a_later_run_is_forked_with_the_cold_runs_verdicts(project, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester, warm_dir = project
    cold = _run(pytester)
    assert COLD in _header(cold), cold.outlines[:12]
    cold.assert_outcomes(passed=3, failed=1)
    cold.stdout.fnmatch_lines(["*a warm server is starting for the next run*"])
    wait_for_server(warm_dir)
    for _ in range(2):  # the server serves more than once
        warm = _run(pytester)
        assert FORKED in _header(warm), warm.outlines[:12]
        warm.assert_outcomes(passed=3, failed=1)
        assert warm.ret == cold.ret == pytest.ExitCode.TESTS_FAILED
        warm.stdout.fnmatch_lines(["*assert 1 == 2*"])  # the run's output reaches its own stdout
    spread = _run(pytester, "-n", "2")  # its xdist workers are the session's, started afresh as in a cold run
    assert FORKED in _header(spread), spread.outlines[:12]
    spread.assert_outcomes(passed=3, failed=1)
    terminal = _run(pytester, "-k", "agree", "-s")  # the tests may read the terminal: only this process has it
    assert "-s: the tests may read the terminal" in _header(terminal)
    terminal.assert_outcomes(passed=1)
    monkeypatch.setenv("DSTEST_WARM_PROBE", "another environment")  # gets its own server
    other = _run(pytester, "-k", "agree")
    assert "no warm server for this directory, environment and plugins yet" in _header(other)
    other.assert_outcomes(passed=1)


def test_f3_a_changed_source_file_makes_the_run_cold_and_current(project) -> None:
    """``mylib`` was imported by the server; after it changes, the run is cold, names the file, and its tests
    (in this process and in the workers) see the new value; the next server serves the new code."""
    pytester, warm_dir = project
    _run(pytester, "-k", "library").assert_outcomes(passed=2)
    wait_for_server(warm_dir)
    assert FORKED in _header(_run(pytester, "-k", "library"))
    lib = pytester.path / "lib" / "mylib.py"
    lib.write_text("VALUE = 22\n")
    settled(lib)  # the cold run's new server then knows it imported this version
    changed = _run(pytester, "-k", "library")
    assert COLD in _header(changed) and "mylib.py changed after the warm server imported it" in _header(changed)
    changed.assert_outcomes(passed=2)
    wait_for_server(warm_dir)
    again = _run(pytester, "-k", "library")
    assert FORKED in _header(again), again.outlines[:12]
    again.assert_outcomes(passed=2)


CUDA_IN_THE_SERVER = """
import sys

import torch

_main = getattr(sys.modules.get("__main__"), "__spec__", None)
if _main is not None and _main.name.startswith("dstest.pytest.warm"):  # in the warm server only
    torch.cuda.is_initialized = lambda: True  # as if this import had asked for a device's capability
VALUE = 1
"""


def test_f3_a_server_whose_preload_initialized_cuda_does_not_serve(project) -> None:
    """A session forked from a process that initialized CUDA could not use it: a warm server whose imports
    did (here ``mylib``, in the server only) says so in its log and serves no run; the next run is cold."""
    pytester, warm_dir = project
    (pytester.path / "lib" / "mylib.py").write_text(CUDA_IN_THE_SERVER)
    _run(pytester, "-k", "library").assert_outcomes(passed=2)
    deadline = time.monotonic() + 180
    logs = ""
    while "not serving" not in logs and time.monotonic() < deadline:
        time.sleep(0.2)
        logs = "\n".join(p.read_text() for p in warm_dir.glob("*.log"))
    assert "warm server: importing the preload initialized CUDA; not serving" in logs, logs
    assert not list(warm_dir.glob("*.sock")), logs
    again = _run(pytester, "-k", "library")
    assert COLD in _header(again), again.outlines[:12]
    again.assert_outcomes(passed=2)


def test_f3_without_the_option_nothing_is_started(project) -> None:
    pytester, warm_dir = project
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "agree", timeout=240)
    result.assert_outcomes(passed=1)
    assert not _header(result)
    assert not list(warm_dir.iterdir())


@pytest.mark.hypothesis_in_children  # its sessions load hypothesis' pytest plugin, as a user's do
def test_f3_a_package_pytest_rewrites_imported_by_the_preload_gives_no_new_warning(project) -> None:
    """``mylib`` (preloaded in the server) imports hypothesis, which pytest rewrites on import in every session
    (it installs a pytest plugin), as torch's test bases do: the server imports hypothesis through pytest's
    rewriting first, so that a forked session finds it rewritten and warns of nothing the cold run did not."""
    pytester, warm_dir = project
    (pytester.path / "lib" / "mylib.py").write_text("import hypothesis  # rewritten by pytest\nVALUE = 1\n")
    settled(pytester.path / "lib" / "mylib.py")  # the cold run's server then knows it imported this version
    cold = _run(pytester, "-k", "library")
    cold.assert_outcomes(passed=2)
    assert "PytestAssertRewriteWarning" not in cold.stdout.str()
    wait_for_server(warm_dir)
    warm = _run(pytester, "-k", "library")
    assert FORKED in _header(warm), warm.outlines[:12]
    warm.assert_outcomes(passed=2)
    assert "PytestAssertRewriteWarning" not in warm.stdout.str(), warm.stdout.str()[-2000:]


# ``mylib`` as imported by the warm server only: it says so (``hold/importing``) and waits for ``hold/go``, so
# that a test can change the file while the server is importing it.
HELD_LIB = """
import os, sys, time
_hold = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "hold")
if sys.argv[0].endswith(os.path.join("warm", "__main__.py")) and os.path.isdir(_hold):  # python -m dstest.pytest.warm
    open(os.path.join(_hold, "importing"), "w").close()
    _until = time.monotonic() + 120
    while not os.path.exists(os.path.join(_hold, "go")) and time.monotonic() < _until:
        time.sleep(0.05)
VALUE = 1
"""


def test_f3_a_file_changed_while_the_server_imports_it_makes_the_next_run_cold(project) -> None:
    """The server imports ``mylib`` after the cold run; the file changes (same size) while that import is
    under way. The server has the old code, so the next run must not be forked from it: it runs cold, names
    the file, and sees the new value in this process and in the workers."""
    pytester, warm_dir = project
    lib = pytester.path / "lib" / "mylib.py"
    lib.write_text(HELD_LIB)
    hold = pytester.path / "hold"
    hold.mkdir()
    _run(pytester, "-k", "library").assert_outcomes(passed=2)
    deadline = time.monotonic() + 180
    while not (hold / "importing").exists():
        assert time.monotonic() < deadline, "the warm server never imported mylib"
        time.sleep(0.05)
    lib.write_text(HELD_LIB.replace("VALUE = 1", "VALUE = 2"))  # the same size
    (hold / "go").touch()
    wait_for_server(warm_dir)
    settled(lib)  # the cold run's new server then knows it imported this version
    after = _run(pytester, "-k", "library")
    assert COLD in _header(after), after.outlines[:12]
    assert "mylib.py" in _header(after), _header(after)
    after.assert_outcomes(passed=2)
    wait_for_server(warm_dir)  # the cold run's own server has the new code
    again = _run(pytester, "-k", "library")
    assert FORKED in _header(again), again.outlines[:12]
    again.assert_outcomes(passed=2)


def test_f3_the_ini_setting_keeps_a_server_between_runs_without_the_option(project) -> None:
    """``dstest_warm = true`` in the ini file: every run is a warm one without ``--dstest-warm`` (the first cold,
    starting the server, the next forked from it); ``--dstest-no-warm`` runs one in its own process and
    starts nothing."""
    pytester, warm_dir = project
    pytester.makeini("[pytest]\ndstest_warm = true\n")

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "agree", *args, timeout=240)

    cold = run()
    assert COLD in _header(cold), cold.outlines[:12]
    cold.assert_outcomes(passed=1)
    wait_for_server(warm_dir)
    warm = run()
    assert FORKED in _header(warm), warm.outlines[:12]
    warm.assert_outcomes(passed=1)
    alone = run("--dstest-no-warm")
    assert not _header(alone), alone.outlines[:12]
    alone.assert_outcomes(passed=1)
    assert "a warm server" not in alone.stdout.str()


def _server_pid(warm_dir: Path) -> int:
    logs = "".join(p.read_text() for p in warm_dir.glob("*.log"))
    return int(logs.split("warm server ", 1)[1].split(":", 1)[0])


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie. The server's parent, the cold run, has exited, so init
    reaps it, and an init may take seconds to (this project's sandboxes' does: 1-3 s after the exit)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # the state, after "pid (comm)"
    except OSError:  # no /proc (not Linux): kill alone, once init has reaped it
        return False


def _wait_gone(pid: int, warm_dir: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _exited(pid):
            return
        time.sleep(0.1)
    logs = "\n".join(p.read_text() for p in warm_dir.glob("*.log"))
    raise AssertionError(f"the warm server {pid} still runs {timeout} s later; its log:\n{logs}")


def test_f3_an_idle_server_stops_once_its_sources_change_or_its_socket_goes(
    project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept server does not wait for its idle time when no run can use it any more: a file it imported
    changed (checked every ``DSTEST_WARM_WATCH`` seconds while no session runs), or its socket was removed."""
    pytester, warm_dir = project
    monkeypatch.setenv("DSTEST_WARM_WATCH", "0.5")
    _run(pytester, "-k", "library").assert_outcomes(passed=2)
    wait_for_server(warm_dir)
    pid = _server_pid(warm_dir)
    (pytester.path / "lib" / "mylib.py").write_text("VALUE = 3\n")
    _wait_gone(pid, warm_dir)
    assert "mylib.py changed after the warm server imported it; stopping" in "".join(
        p.read_text() for p in warm_dir.glob("*.log")
    )
    assert not list(warm_dir.glob("*.sock"))
    for log in warm_dir.glob("*.log"):
        log.unlink()
    settled(pytester.path / "lib" / "mylib.py")  # else the next server may stop for a change it cannot date
    _run(pytester, "-k", "library").assert_outcomes(passed=2)  # cold: starts a server with the new code
    wait_for_server(warm_dir)
    pid = _server_pid(warm_dir)
    for sock in warm_dir.glob("*.sock"):
        sock.unlink()
    _wait_gone(pid, warm_dir)
