"""The fork server's feed: modules a session names while it goes on (a pytest session's collection), imported
by the server before its first worker (dstest._fork_server_modules, launch.start_fork_server_fed).

Contracts: F2 (tests on torch's bases run on warm workers with the verdicts upstream gives them: a module the
server cannot import, or whose import initialized CUDA, is left to each worker, as without the feed) and F3 (a
warm server imports what the cold run fed its fork server, and serves no session it could not give CUDA)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from dstest.compat import _server_feed

pytestmark = pytest.mark.cpu

FOLLOWER = "import dstest._fork_server_modules, json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fed_'))))"


def _module(root: Path, name: str) -> None:
    (root / f"{name}.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")


def _follower(feed: Path, *, via_shell_for: float | None = None) -> subprocess.Popen[str]:
    """A process that follows ``feed`` as the fork server does, then prints the ``fed_*`` modules it has."""
    env = {**os.environ, "DSTEST_FORK_SERVER_FEED": str(feed)}
    command = [sys.executable, "-c", FOLLOWER]
    if via_shell_for is not None:  # its parent, a shell, exits after that many seconds
        command = ["sh", "-c", f"{shlex.join(command)} & sleep {via_shell_for}"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line(path: list[str], modules: list[str]) -> str:
    return json.dumps({"path": path, "modules": modules}) + "\n"


def test_the_server_imports_what_is_fed_as_it_comes_until_the_last_line(tmp_path: Path) -> None:
    """Lines appended while the server follows, one written in two halves, a name it has already, one that
    fails to import and one that does not exist: it imports the rest, in order, with the path each line gives,
    and stops at the last line."""
    libs = tmp_path / "libs"
    libs.mkdir()
    for name in ("fed_a", "fed_b", "fed_c"):
        _module(libs, name)
    (libs / "fed_broken.py").write_text("raise RuntimeError('broken on import')\n")
    feed = tmp_path / "feed"
    feed.write_text("")
    path = [str(libs), *sys.path]
    proc = _follower(feed)
    try:
        with open(feed, "a") as f:
            f.write(_line(path, ["fed_a"]))
            f.flush()
            time.sleep(0.2)
            half = _line(path, ["fed_broken", "fed_missing", "fed_a", "fed_b"])
            f.write(half[:20])
            f.flush()
            time.sleep(0.2)
            f.write(half[20:])
            f.flush()
            time.sleep(0.2)
            assert proc.poll() is None  # still following: no last line yet
            f.write(json.dumps({"done": True}) + "\n")
            f.write(_line(path, ["fed_c"]))  # after the last line: not read
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out) == ["fed_a", "fed_b"], err
    assert json.loads((tmp_path / "feed.end").read_text()) == {"cuda": None}


CUDA_AT_IMPORT = """
import torch

torch.cuda.is_initialized = lambda: True  # as if this import had asked for a device's capability
"""


def test_the_server_stops_at_a_module_whose_import_initialized_cuda_and_names_it(tmp_path: Path) -> None:
    """Workers forked from a process that initialized CUDA cannot use it: the server imports nothing after
    such a module and names it in the feed's end file, without waiting for the feed's last line."""
    libs = tmp_path / "libs"
    libs.mkdir()
    for name in ("fed_a", "fed_c"):
        _module(libs, name)
    (libs / "fed_cuda.py").write_text(CUDA_AT_IMPORT)
    feed = tmp_path / "feed"
    feed.write_text(_line([str(libs), *sys.path], ["fed_a", "fed_cuda", "fed_c"]))
    proc = _follower(feed)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out) == ["fed_a", "fed_cuda"], err
    assert json.loads((tmp_path / "feed.end").read_text()) == {"cuda": "fed_cuda"}


@pytest.mark.parametrize("ending", ["garbled", "parent-gone"])
def test_the_server_stops_following_a_garbled_feed_or_once_its_session_has_gone(tmp_path: Path, ending: str) -> None:
    """A line it cannot read ends the feed; so does the end of the process that started the server (it then
    serves, or exits as its session has gone), without a last line: it never waits for ever."""
    libs = tmp_path / "libs"
    libs.mkdir()
    _module(libs, "fed_a")
    feed = tmp_path / "feed"
    feed.write_text(_line([str(libs), *sys.path], ["fed_a"]))
    if ending == "garbled":
        proc = _follower(feed)
        with open(feed, "a") as f:
            f.write('{"path": 3}\n')
    else:
        proc = _follower(feed, via_shell_for=1.0)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out) == ["fed_a"], err  # what it was fed before the end


SCRIPT = """
import json
import os
import sys
import tempfile
import warnings

from dstest.worlds.process import launch


def where(ctx):
    import fed_lib
    import torch

    return [fed_lib.IMPORTED_IN, os.getpid(), torch.cuda.is_initialized()]


if __name__ == "__main__":
    assert launch.start_fork_server_fed(os.path.join(tempfile.mkdtemp(), "feed"))
    sys.path.insert(0, {libs!r})
    import fed_lib

    assert launch.feed_fork_server({fed!r})
    from dstest.worlds.process import ProcessWorld, shutdown_all
    from dstest.worlds.request import RunRequest

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = ProcessWorld().run(RunRequest(where, 2, timeout=60))
    fed_after = launch.feed_fork_server(["json"])
    shutdown_all()
    told = [str(w.message) for w in caught if type(w.message).__name__ == "ForkServerSkipped"]
    preload = launch.fork_server_preload()
    print(json.dumps({{"seen": seen, "fed_after": fed_after, "told": told, "preload": preload}}))
"""


def _fed_script(tmp_path: Path, fed: list[str]) -> dict[str, Any]:
    libs = tmp_path / "libs"
    libs.mkdir()
    _module(libs, "fed_lib")
    (libs / "fed_cuda.py").write_text(CUDA_AT_IMPORT)
    script = tmp_path / "fed_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(libs=str(libs), fed=fed)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["fed_after"] is False  # the pool ended the feed: later feeding does nothing
    assert len(report["seen"]) == 2
    return report


def test_a_feed_the_session_never_ended_is_ended_by_the_first_pool(tmp_path: Path) -> None:
    """A process that feeds its server and forks workers from it without ending the feed: the pool ends it,
    so the server serves (it does not wait for a last line), and every worker starts with the fed module
    imported by the server."""
    report = _fed_script(tmp_path, ["fed_lib"])
    assert all(imported != pid for imported, pid, _ in report["seen"]), report  # the server imported it
    assert report["told"] == []
    assert report["preload"][-1] == "fed_lib", report  # what a warm server of this session would import


def test_a_server_a_fed_module_initialized_cuda_in_is_replaced_and_the_module_named(tmp_path: Path) -> None:
    """A fed module initialized CUDA in the server: before the first worker, the server is replaced by one
    that imports its preloads only (the run's workers can use CUDA), the module is named in a warning, and
    each worker imports what the collection imported itself, as without the feed."""
    report = _fed_script(tmp_path, ["fed_cuda", "fed_lib"])
    assert all(imported == pid for imported, pid, _ in report["seen"]), report  # each worker imported it
    assert not any(cuda for _, _, cuda in report["seen"]), report  # forked from a server without fed_cuda
    (told,) = report["told"]
    assert told.startswith("importing fed_cuda initialized CUDA, in the process world's fork server"), told
    assert "fed_cuda" not in report["preload"] and "fed_lib" not in report["preload"], report


def test_what_a_worker_would_import_again_is_fed_in_import_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """new_imports: the modules imported since the last look, in import order, each looked at once; not the
    session's own (pytest's, dstest's), not conftests, not modules pytest rewrote, not those without a file."""
    libs = tmp_path / "libs"
    libs.mkdir()
    for name in ("fed_one", "fed_two"):
        _module(libs, name)
    (libs / "conftest.py").write_text("")
    monkeypatch.syspath_prepend(str(libs))
    seen = set(sys.modules)
    import importlib
    import types

    for name in ("fed_two", "fed_one", "conftest"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    rewritten = types.ModuleType("fed_rewritten")
    rewritten.__file__ = str(libs / "fed_rewritten.py")
    rewritten.__loader__ = type("AssertionRewritingHook", (), {})()  # type: ignore[assignment]
    fileless = types.ModuleType("fed_fileless")
    own = types.ModuleType("dstest._fed_own")
    own.__file__ = str(libs / "own.py")
    for module in (rewritten, fileless, own):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        assert _server_feed.new_imports(seen) == ["fed_two", "fed_one"]
        assert _server_feed.new_imports(seen) == []  # each looked at once
        assert {"fed_two", "fed_one", "conftest", "fed_rewritten", "fed_fileless", "dstest._fed_own"} <= seen
    finally:
        for name in ("fed_two", "fed_one", "conftest"):
            sys.modules.pop(name, None)


def test_an_xdist_controller_starts_no_server_of_its_own() -> None:
    """A session that hands its tests to pytest-xdist's workers (``-n N``) runs none: it starts no fork server
    (each worker starts and feeds its own); an xdist worker, ``-n 0`` and ``--dist no`` run their tests."""
    from types import SimpleNamespace

    def config(worker: bool = False, **option: Any) -> Any:
        made = SimpleNamespace(option=SimpleNamespace(**option))
        if worker:
            made.workerinput = {"workerid": "gw0"}
        return made

    assert _server_feed.xdist_controller(config(numprocesses=2, dist="load"))
    assert _server_feed.xdist_controller(config(numprocesses="auto", dist="worksteal"))
    assert not _server_feed.xdist_controller(config(worker=True, numprocesses=2, dist="load"))
    assert not _server_feed.xdist_controller(config(numprocesses=0, dist="load"))
    assert not _server_feed.xdist_controller(config(numprocesses=2, dist="no"))
    assert not _server_feed.xdist_controller(config())  # no xdist


def test_the_server_can_start_before_the_session_imports_torch() -> None:
    """The torch-bases plugin starts the fork server first thing, so that the server imports torch on the other
    core while the session does: the plugin's module, the feed and the fork server's launch import no torch."""
    code = (
        "import sys\n"
        "import dstest.compat.torch, dstest.compat._server_feed, dstest.worlds.process.launch\n"
        "import dstest.worlds.process as p\n"
        "assert 'ProcessWorld' in dir(p)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.replace("'", '"')) == [], proc.stdout
