"""Third-party targets and worlds: written outside the package, picked up by pytest hooks, run the bundled specs.

The worked example of docs/extending.md ("Adding a target or a world"): a conftest defines a tiny target (only
``is_parallel``, with one bug: it calls a one-rank group parallel) and a tiny world (the threaded world
under another name, counting its runs), returns them from the ``pytest_dstest_targets`` / ``pytest_dstest_worlds``
hooks, and runs the A1-A4 specs with ``--dstest-target=mytarget --dstest-worlds=myworld``. The bug shows
as deviations (``D``), not failures: the target is third-party.
"""

from __future__ import annotations

import pytest

from dstest import cli
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

CONFTEST = '''
import torch.distributed as dist

from dstest.worlds import get_world

RUNS = []


class TinyTarget:
    """A system under test with one feature, is_parallel (contract A1-A4), and one bug."""

    name = "mytarget"
    third_party = True
    default_world = "myworld"
    config_errors = (ValueError,)

    @staticmethod
    def environment(device):
        return {"MYTARGET_DEVICE": device}

    def supports(self, feature):
        return feature == "is_parallel"

    def is_parallel(self, group):
        # The bug: a one-rank group (size 1) counts as parallel; A2 at W=1, A3, A4 at W=2 catch it.
        return group is not None and dist.get_world_size(group) >= 1


class TinyWorld:
    """Ranks as threads (the threaded world does the work); counts the runs it was given."""

    name = "myworld"
    marker = "cpu"

    def unavailable_reason(self, world_size):
        return None

    def run(self, request):
        RUNS.append(request.world_size)
        return get_world("threaded").run(request)


def pytest_dstest_targets():
    return {"mytarget": TinyTarget}


def pytest_dstest_worlds():
    return {"myworld": TinyWorld}


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"myworld ran {len(RUNS)} runs")
'''

#: A1 (ws 1-3) passes; A2 at W=1, A3 (ws 1-3) and A4 at W=2 deviate; the rest pass.
EXPECTED = {"passed": 8, "deviation": 5}


def test_an_external_target_and_world_run_the_bundled_specs(pytester: pytest.Pytester) -> None:
    """The conftest route: a downstream suite imports the bundled specs; its conftest brings target and world."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_conformance="from dstest.conformance.optional_groups import *  # noqa: F403\n")
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--dstest-target=mytarget",
        "--dstest-worlds=myworld",
        "-k",
        "A1 or A2 or A3 or A4",
        "-rA",
    )
    outcomes = result.parseoutcomes()
    got = {k: outcomes.get(k, 0) for k in ("passed", "deviation", "failed")}
    assert got == {**EXPECTED, "failed": 0}, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*myworld ran 13 runs*", "*DEVIATIONS of target 'mytarget' from the contracts (docs/contracts.md)*", "DEV *test_a3_single_rank_group*"]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # a deviation is still a failed check under pytest


def test_the_cli_runs_an_external_target_like_pytest(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """The plug-in route (``dstest -p MODULE``, ``pytest -p MODULE``): the CLI and pytest count the same."""
    import json

    pytester.makepyfile(myplugin=CONFTEST)
    monkeypatch.syspath_prepend(str(pytester.path))
    out = tmp_path / "r.json"
    flags = ["--target", "mytarget", "--world", "myworld", "-k", "A1 or A2 or A3 or A4", "--json", str(out)]
    assert cli.main(["-p", "myplugin", *flags]) == 0  # deviations are findings...
    assert "8 passed, 0 failed, 5 deviations, 0 skipped" in capsys.readouterr().out
    assert cli.main(["-p", "myplugin", *flags, "--fail-on-deviation"]) == 1  # ...unless asked
    capsys.readouterr()
    rows = json.loads(out.read_text())
    assert {r["world"] for r in rows} == {"myworld"} and {r["target"] for r in rows} == {"mytarget"}
    result = pytester.runpytest_subprocess(
        cli.specs_path(), "-p", "myplugin", "-p", "no:cacheprovider",
        "--dstest-target=mytarget", "--dstest-worlds=myworld", "-k", "A1 or A2 or A3 or A4",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == sum(r["status"] == "pass" for r in rows) == EXPECTED["passed"]
    assert outcomes.get("deviation") == sum(r["status"] == "deviation" for r in rows) == EXPECTED["deviation"]


def test_external_names_are_checked_after_the_hooks(pytester: pytest.Pytester) -> None:
    """Unknown names are usage errors listing the plug-ins; registered ones are accepted."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    bad = pytester.runpytest("--dstest-target=theirtarget", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--dstest-target='theirtarget': unknown target; allowed: impl, deepspeed, mytarget*"])
    bad = pytester.runpytest("--dstest-worlds=theirworld", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--dstest-worlds='theirworld': unknown world(s) [[]'theirworld'[]]*myworld*"])
    good = pytester.runpytest("--dstest-target=mytarget", "--dstest-worlds=myworld", "-p", "no:cacheprovider")
    assert good.ret == pytest.ExitCode.OK, good.stderr.str()


def test_a_plugin_target_runs_in_the_process_world(pytester: pytest.Pytester) -> None:
    """The binding travels to worker processes: the plug-in's class by reference, its environment applied."""
    pytester.makepyfile(
        mytarget_pkg="""
        import os

        class EnvTarget:
            name = "envtarget"
            third_party = True
            default_world = "process"
            config_errors = (ValueError,)

            @staticmethod
            def environment(device):
                return {"ENVTARGET_ON": device}

            def supports(self, feature):
                return False
        """
    )
    pytester.makeconftest(
        """
        from mytarget_pkg import EnvTarget

        def pytest_dstest_targets():
            return {"envtarget": EnvTarget}
        """
    )
    pytester.makepyfile(
        test_env="""
        import os
        import dstest

        @dstest.spec(world_size=2, worlds=["threaded", "process"])
        def test_bound(ctx):
            assert ctx.target.name == "envtarget"
            assert os.environ["ENVTARGET_ON"] == "cpu"
        """
    )
    result = pytester.runpytest_subprocess("--dstest-target=envtarget", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_registry_refuses_builtin_names_and_non_callables() -> None:
    from dstest.errors import InvalidArgument
    from dstest.registry import register_target, register_world

    with pytest.raises(InvalidArgument, match="'impl' is built into dstest"):
        register_target("impl", object)
    with pytest.raises(InvalidArgument, match=r"factory=3 .* is not callable"):
        register_world("w3", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="give a non-empty str without commas"):
        register_world("a,b", object)


def test_world_run_knows_no_target() -> None:
    """A function run by a world directly gets no ctx.target; dstest.run binds one."""
    import dstest
    from dstest.errors import InvalidSpec, RankFailure, WorldAborted
    from dstest.worlds import get_world

    with pytest.raises(RankFailure) as failure:
        get_world("threaded").run(RunRequest(_target_name, 2))
    raised = failure.value.exceptions
    # The first rank to fail aborts the world: a rank that had not reached ctx.target yet unwinds with
    # WorldAborted (a consequence) instead of raising its own InvalidSpec.
    assert any(isinstance(e, InvalidSpec) for e in raised.values()), raised
    assert all(isinstance(e, (InvalidSpec, WorldAborted)) for e in raised.values()), raised
    assert "no system under test is bound" in str(failure.value)
    assert dstest.run(_target_name, 2) == ["impl", "impl"]
    assert dstest.run(_target_name, 2, world="fake") == ["impl", "impl"]


def _target_name(ctx: object) -> str:
    return ctx.target.name  # type: ignore[attr-defined]


def test_target_environment_comes_from_the_target() -> None:
    """DS_ACCELERATOR is DeepSpeed's business: its class asks for it (the process world no longer sets it)."""
    import pickle

    from dstest.specification import TargetBinding

    binding = TargetBinding("deepspeed")  # DeepSpeed itself is not imported
    assert binding.environment("cpu") == {"DS_ACCELERATOR": "cpu"} and binding.environment("cuda") == {}
    assert TargetBinding("impl").environment("cpu") == {}
    assert pickle.loads(pickle.dumps(binding)) == binding  # built-ins travel by name


CAPABLE_CONFTEST = '''
import pathlib

import dstest
from dstest.worlds import get_world


class CapableWorld:
    """Ranks as threads; declares what it can do (shape checks, nothing else) and is closed once at the end."""

    name = "capworld"
    marker = "cpu"
    capabilities = dstest.Capabilities(strict_shapes=True)

    def unavailable_reason(self, world_size):
        return None

    def run(self, request):
        return get_world("threaded").run(request)

    def close(self):
        with open(pathlib.Path(__file__).parent / "closed.txt", "a") as f:
            f.write("closed\\n")


def pytest_dstest_worlds():
    return {"capworld": CapableWorld}
'''

CAPABLE_TESTS = """
import torch
import torch.distributed as dist

import dstest
from dstest.faults import Kill


def _shapes_differ(ctx):
    dist.all_reduce(torch.ones(2, 3) if ctx.rank == 0 else torch.ones(3, 2))


@dstest.spec(world_size=[2], worlds=["capworld"])
def test_runs(ctx):
    dist.all_reduce(torch.ones(2))


@dstest.spec(world_size=[2], worlds=["capworld"], faults=[Kill(1)])
def test_asks_for_faults(ctx):
    dist.all_reduce(torch.ones(2))


def test_strict_shapes_are_asked_of_it():
    try:
        dstest.run(_shapes_differ, 2, world="capworld", strict_shapes=True)
    except dstest.CollectiveMismatch as exc:
        assert "shape" in str(exc)
    except dstest.RankFailure as exc:
        assert "CollectiveMismatch" in str(exc), exc
    else:
        raise AssertionError("a shape-only difference passed with strict_shapes=True")


def test_module_watch_is_refused():
    try:
        dstest.run(_shapes_differ, 2, world="capworld", watch_modules=["json"])
    except dstest.InvalidArgument as exc:
        assert "the capworld world does not watch module state" in str(exc), exc
    else:
        raise AssertionError("watch_modules ran on a world that does not declare it")
"""


def test_a_third_party_world_declares_what_it_can_do_and_is_closed_once(pytester: pytest.Pytester) -> None:
    """A plug-in world's ``capabilities`` decide what runs on it (what it does not declare is refused before any
    rank starts, with the world named), and the session's end closes it through ``close()``, once."""
    pytester.makeconftest(CAPABLE_CONFTEST)
    pytester.makepyfile(test_capable=CAPABLE_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ["*InvalidArgument: faults=*: the capworld world cannot inject faults*", "FAILED *test_asks_for_faults*"]
    )
    assert (pytester.path / "closed.txt").read_text() == "closed\n"
