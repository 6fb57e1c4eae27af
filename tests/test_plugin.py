"""The pytest plugin as users run it (pytester): expansion, markers, options, failures, fixtures."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.cpu

SPEC_FILE = """
import torch, torch.distributed as dist
import dstest

@dstest.spec(world_size=[1, 2, 3, 4])
def test_sum(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size
"""


def test_spec_expands_to_one_item_per_world_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPEC_FILE)
    result = pytester.runpytest("-m", "cpu", "--strict-markers", "-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        ["*test_sum?threaded-ws1? PASSED*", "*test_sum?threaded-ws4? PASSED*", "*4 passed, 4 deselected*"]
    )
    assert result.ret == 0


def test_gpu_items_are_collected_and_skip_with_a_reason(pytester: pytest.Pytester) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the skip path is for GPU-less machines")
    pytester.makepyfile(SPEC_FILE)
    result = pytester.runpytest("-m", "gpu", "-rs", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*SKIPPED*CUDA*", "*4 skipped, 4 deselected*"])


def test_failing_rank_shows_its_traceback(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dstest

        @dstest.spec(world_size=[3], worlds=["threaded"])
        def test_rank_two_fails(ctx):
            if ctx.rank == 2:
                assert ctx.rank == 99, "rank two disagrees"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*---- rank 2 ----*", "*rank two disagrees*", "*1 failed*"])


def test_parametrize_and_fixtures_reach_every_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist
        import dstest

        @pytest.fixture
        def base():
            return 10.0

        @pytest.mark.parametrize("scale", [1.0, 3.0])
        @dstest.spec(world_size=[2, 3], worlds=["threaded"])
        def test_scaled(ctx, scale, base):
            t = torch.full((1,), scale + base)
            dist.all_reduce(t)
            assert t.item() == (scale + base) * ctx.world_size
        """
    )
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*test_scaled?threaded-ws3-3.0? PASSED*", "*4 passed*"])


def test_run_fixture_without_decorator(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        def body(ctx):
            return ctx.rank * 2

        @pytest.mark.cpu
        def test_plain(dstest_run):
            assert dstest_run(body, world_size=3) == [0, 2, 4]
        """
    )
    result = pytester.runpytest("-m", "cpu", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*1 passed*"])


def test_worlds_option_and_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPEC_FILE)
    result = pytester.runpytest("--dstest-worlds=fake", "--collect-only", "-q", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*test_sum?fake-ws1?*", "*4 tests collected*"])
    bad = pytester.runpytest("--dstest-worlds=nope", "-p", "no:cacheprovider")
    bad.stderr.fnmatch_lines(["*--dstest-worlds='nope': unknown world(s)*nope*use a comma-separated list*"])
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad_timeout = pytester.runpytest("--dstest-timeout=-3", "-p", "no:cacheprovider")
    bad_timeout.stderr.fnmatch_lines(["*--dstest-timeout='-3'*> 0*"])


def test_mark_unmarked_keeps_plain_tests_under_m_cpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    pass\n")
    assert pytester.runpytest("-m", "cpu", "-p", "no:cacheprovider").ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result = pytester.runpytest("-m", "cpu", "--dstest-mark-unmarked=cpu", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*1 passed*"])


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["@pytest.mark.cpu: *Provided by dstest.", "@pytest.mark.gpu: *Provided by dstest."])


def test_plugin_import_does_not_import_torch(pytester: pytest.Pytester) -> None:
    result = pytester.run(sys.executable, "-c", "import sys, dstest.pytest.plugin, dstest; print('torch' in sys.modules)")
    assert result.ret == 0, result.stderr.str()
    result.stdout.fnmatch_lines(["False"])


def test_rank_skip_skips_the_item(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, dstest

        @dstest.spec(world_size=[2], worlds=["threaded"])
        def test_skips(ctx):
            pytest.skip("target lacks the feature")
        """
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*target lacks the feature*", "*1 skipped*"])


# -- a good guest: a project that does not use dstest, in an environment where dstest is installed ------------

GUEST_INI = """
[pytest]
markers =
    soak: the guest's own long runs
    cpu: the guest's own cpu marker
    gpu: the guest's own gpu marker
addopts = --strict-markers -p no:cacheprovider
filterwarnings = error
"""

# Records in guest.json whether the dstest plugin is active in the run and whether torch is imported, after
# collection and at the end of the session.
GUEST_CONFTEST = """
import json, sys

def _record(config, when):
    path = config.rootpath / "guest.json"
    seen = json.loads(path.read_text()) if path.exists() else {}
    active = any(getattr(p, "__name__", None) == "dstest.pytest.plugin" for p in config.pluginmanager.get_plugins())
    seen[when] = {"dstest": active, "torch": "torch" in sys.modules}
    path.write_text(json.dumps(seen))

def pytest_collection_finish(session):
    _record(session.config, "collection_finish")

def pytest_sessionfinish(session):
    _record(session.config, "sessionfinish")
"""

GUEST_TESTS = """
import pytest

@pytest.mark.soak
def test_soak():
    pass

@pytest.mark.soak
@pytest.mark.cpu
def test_soak_on_cpu():
    pass

@pytest.mark.cpu
def test_cpu():
    pass

@pytest.mark.gpu
def test_gpu():
    pass

def test_plain():
    pass
"""


def _guest(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)  # dstest comes from its entry point
    # The guest is a plain pytest session, not a worker of this one's xdist: other plugins of the environment
    # act on these (pytest-benchmark, on CI's python, warns "Benchmarks are automatically disabled", an error
    # under the guest's filterwarnings = error).
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeini(GUEST_INI)
    pytester.makeconftest(GUEST_CONFTEST)
    pytester.makepyfile(test_guest=GUEST_TESTS)


def _seen(pytester: pytest.Pytester) -> dict[str, dict[str, bool]]:
    path = pytester.path / "guest.json"
    seen: dict[str, dict[str, bool]] = json.loads(path.read_text())
    path.unlink()
    return seen


def _no_warnings(result: pytest.RunResult) -> None:
    text = result.stdout.str() + result.stderr.str()
    assert "warning" not in text.lower(), text


@pytest.mark.parametrize(
    ("args", "passed"),
    [
        ((), ["test_soak", "test_soak_on_cpu", "test_cpu", "test_gpu", "test_plain"]),
        (("-m", "cpu"), ["test_soak_on_cpu", "test_cpu"]),
        (("-m", "soak"), ["test_soak", "test_soak_on_cpu"]),
        (("-m", "not soak"), ["test_cpu", "test_gpu", "test_plain"]),
    ],
    ids=["no-m", "m-cpu", "m-soak", "m-not-soak"],
)
def test_a_project_with_its_own_markers_runs_as_without_dstest(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], passed: list[str]
) -> None:
    """A project that declares its own soak, cpu and gpu markers (--strict-markers, filterwarnings = error)
    and never uses dstest: with dstest's plugin active, exactly the tests its -m selects run, nothing is
    deselected on dstest's account and no warning appears: the same as with the plugin blocked."""
    _guest(pytester, monkeypatch)
    # In a fresh process, as the project runs: in this one dstest's own modules are imported already, and
    # pytest's assertion rewriting warns about them (an error under the guest's filterwarnings = error).
    result = pytester.runpytest_subprocess("-v", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert _seen(pytester)["collection_finish"]["dstest"], "the dstest plugin is not active in the run"
    result.stdout.fnmatch_lines([f"*test_guest.py::{name} PASSED*" for name in passed])
    result.assert_outcomes(passed=len(passed), deselected=5 - len(passed))
    _no_warnings(result)
    without = pytester.runpytest_subprocess("-v", "-p", "no:dstest", *args)
    assert not _seen(pytester)["collection_finish"]["dstest"]
    without.assert_outcomes(passed=len(passed), deselected=5 - len(passed))


def test_a_project_with_its_own_markers_keeps_their_descriptions(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--markers`` lists the project's own soak, cpu and gpu once each, with the project's descriptions."""
    _guest(pytester, monkeypatch)
    result = pytester.runpytest_subprocess("--markers")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.soak: the guest's own long runs",
            "@pytest.mark.cpu: the guest's own cpu marker",
            "@pytest.mark.gpu: the guest's own gpu marker",
        ]
    )
    for name in ("soak", "cpu", "gpu"):
        assert result.stdout.str().count(f"@pytest.mark.{name}:") == 1, result.stdout.str()
    assert "Provided by dstest" not in result.stdout.str()


@pytest.mark.fresh_interpreter  # which modules a session imports: not in a fork of an interpreter with torch
def test_a_project_that_does_not_use_dstest_does_not_import_torch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a fresh process (an in-process run shares this one's torch), the plugin, active through its entry
    point, imports no torch: not at start-up and collection, not while the project's tests run."""
    _guest(pytester, monkeypatch)
    result = pytester.runpytest_subprocess("-m", "cpu")
    result.assert_outcomes(passed=2, deselected=3)
    _no_warnings(result)
    seen = _seen(pytester)
    assert seen["collection_finish"] == {"dstest": True, "torch": False}, seen
    assert seen["sessionfinish"] == {"dstest": True, "torch": False}, seen


def test_soak_items_are_left_out_where_the_ini_opts_in(pytester: pytest.Pytester) -> None:
    """``dstest_deselect_soak = true`` (this repository's setting): soak items run only where -m names soak."""
    pytester.makeini("[pytest]\ndstest_deselect_soak = true\naddopts = --strict-markers -p no:cacheprovider\n")
    pytester.makepyfile(test_guest=GUEST_TESTS)
    pytester.runpytest_inprocess().assert_outcomes(passed=3, deselected=2)
    pytester.runpytest_inprocess("-m", "cpu").assert_outcomes(passed=1, deselected=4)
    pytester.runpytest_inprocess("-m", "soak").assert_outcomes(passed=2, deselected=3)
    pytester.runpytest_inprocess("-m", "soak or cpu").assert_outcomes(passed=3, deselected=2)


def test_this_repository_opts_in_to_leaving_soak_out(pytestconfig: pytest.Config) -> None:
    """The README's ``pytest -m cpu -n 2`` must not run the soak items that carry cpu too."""
    assert pytestconfig.getini("dstest_deselect_soak") is True
