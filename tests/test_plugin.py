"""The pytest plugin as users run it (pytester): expansion, markers, options, failures, fixtures."""

from __future__ import annotations

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
    result = pytester.run(
        "python", "-c", "import sys, dstest.plugin, dstest; print('torch' in sys.modules)"
    )
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
