"""The suite's child pytest sessions forked from a warm interpreter (tests/_forked_children.py) see what a fresh
``python -m pytest`` sees: its working directory, arguments, ``sys.path``, environment, standard streams and
exit status; a timeout still kills it; an environment the warm interpreter cannot give runs fresh."""

from __future__ import annotations

import json
import os
import sys

import _forked_children
import pytest

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(os.environ.get("DSTEST_SUITE_FORK") == "0", reason="DSTEST_SUITE_FORK=0: no child is forked"),
]

# What the child session saw, written by its conftest as one JSON line on stdout.
SEEN = """
import json, os, sys
print("SEEN " + json.dumps({
    "parent": os.getppid(),
    "cwd": os.getcwd(),
    "argv": sys.argv[1:],
    "argv0": os.path.basename(sys.argv[0]),
    "path": sys.path,
    "main": getattr(sys.modules["__main__"].__spec__, "name", None),
    "probe": os.environ.get("FORKED_CHILDREN_PROBE"),
    "stdin": sys.stdin.read(),
    "hashseed_env": os.environ.get("PYTHONHASHSEED"),
}))
"""

TESTS = """
import os, sys, time

def test_passes():
    pass

def test_fails_if_asked():
    assert os.environ.get("FORKED_CHILDREN_FAIL") != "1", "asked to fail"

def test_sleeps_if_asked():
    if os.environ.get("FORKED_CHILDREN_SLEEP"):
        time.sleep(float(os.environ["FORKED_CHILDREN_SLEEP"]))
"""


def _seen(result: pytest.RunResult) -> dict[str, object]:
    lines = [line for line in result.outlines if line.startswith("SEEN ")]
    assert len(lines) == 1, result.outlines
    return json.loads(lines[0][len("SEEN ") :])  # type: ignore[no-any-return]


def _run(pytester: pytest.Pytester, forked: bool, *args: str) -> pytest.RunResult:
    before = _forked_children.allowed
    _forked_children.allowed = forked
    try:
        return pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args, timeout=120)
    finally:
        _forked_children.allowed = before


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("FORKED_CHILDREN_PROBE", "from the test")
    pytester.makeconftest(SEEN)
    pytester.makepyfile(test_child=TESTS)
    return pytester


def test_a_forked_child_sees_what_a_fresh_one_sees(project: pytest.Pytester) -> None:
    fresh, forked = _run(project, False), _run(project, True)
    a, b = _seen(fresh), _seen(forked)
    assert a["parent"] == os.getpid()  # the fresh one is this process's child
    assert b["parent"] != os.getpid()  # the forked one is the server's
    for seen in (a, b):
        seen.pop("parent")
        seen["argv"] = [x for x in seen["argv"] if not x.startswith("--basetemp=")]  # numbered per run
    assert a == b
    assert a["cwd"] == str(project.path) and a["probe"] == "from the test" and a["main"] == "pytest.__main__"
    assert a["path"][0] == str(project.path)  # python -m puts the working directory first
    fresh.assert_outcomes(passed=3)
    forked.assert_outcomes(passed=3)


@pytest.mark.parametrize("forked", [False, True])
def test_exit_statuses_and_outputs_are_the_sessions(project: pytest.Pytester, forked: bool, monkeypatch) -> None:
    monkeypatch.setenv("FORKED_CHILDREN_FAIL", "1")
    failed = _run(project, forked)
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
    failed.assert_outcomes(passed=2, failed=1)
    failed.stdout.fnmatch_lines(["*AssertionError: asked to fail*"])
    assert _run(project, forked, "--no-such-option").ret == pytest.ExitCode.USAGE_ERROR
    assert _run(project, forked, "-k", "nothing_matches").ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_standard_input_reaches_a_forked_child(project: pytest.Pytester) -> None:
    result = project.run(sys.executable, "-mpytest", "-s", "-p", "no:cacheprovider", stdin=b"to the child", timeout=120)
    seen = _seen(result)
    assert seen["stdin"] == "to the child" and seen["parent"] != os.getpid()


def test_a_timeout_kills_a_forked_child(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKED_CHILDREN_SLEEP", "120")
    with pytest.raises(project.TimeoutExpired):
        project.runpytest_subprocess("-s", "-p", "no:cacheprovider", timeout=3)
    with open(project.path / "out", "w") as out:
        child = project.popen([sys.executable, "-mpytest", "-s", "-p", "no:cacheprovider"], stdout=out, stderr=out)
        assert child.poll() is None and child.pid != os.getpid()  # running, and no wait
        child.kill()
        assert child.wait(60) == -9 and child.poll() == -9


def test_a_variable_read_at_import_that_differs_runs_fresh(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # the interpreter reads it at its start
    seen = _seen(_run(project, True))
    assert seen["parent"] == os.getpid() and seen["hashseed_env"] == "7"
    assert _forked_children.differs_at_import({"PYTHONHASHSEED": "7"}, {}) == ["PYTHONHASHSEED"]
    assert _forked_children.differs_at_import({"TORCHINDUCTOR_CACHE_DIR": "/x", "PYTHONPATH": "/y"}, {}) == []
    assert _forked_children.differs_at_import({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}) == ["OMP_NUM_THREADS"]
