"""``--dstest-crosscheck``: the plugin also runs threaded cases on the process world and compares them (contract E14).

CI runs the project's torch-stack specs this way (issue 42): a threaded pass where processes would fail, or
give other values or another collective trace, fails the test with ``WorldsDiverge``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu


CROSSCHECK_FILE = """
import torch, torch.distributed as dist
import dstest


@dstest.spec(world_size=[2, 3], worlds=["threaded"])
def test_agrees(ctx):
    t = torch.full((3,), float(ctx.rank))
    dist.all_reduce(t)
    return t


@dstest.spec(world_size=[2], worlds=["threaded"])
def test_differs(ctx):
    t = torch.ones(2)
    dist.all_reduce(t)
    if ctx.world == "threaded":
        dist.broadcast(t, src=0)  # a call only the threaded world makes: the traces differ
    return t
"""


def test_crosscheck_all_fails_a_case_whose_worlds_differ(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CROSSCHECK_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "--dstest-crosscheck=all")
    result.stdout.fnmatch_lines(
        [
            "*test_agrees?threaded-ws2? PASSED*",
            "*test_agrees?threaded-ws3? PASSED*",
            "*test_differs?threaded-ws2? FAILED*",
            "*WorldsDiverge: test_differs?threaded-ws2? at world size 2: the collective traces differ*",
            "*1 failed, 2 passed*",
        ]
    )
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # without the option: threads alone
    plain.stdout.fnmatch_lines(["*3 passed*"])


def test_a_crosscheck_sample_takes_the_same_cases_every_run():
    from dstest.specification import sampled

    names = [f"test_{i}[threaded-ws{w}]" for i in range(400) for w in (2, 3)]
    taken = [n for n in names if sampled(25, n)]
    assert 150 < len(taken) < 250  # about a quarter
    assert taken == [n for n in names if sampled(25, n)]
    assert all(sampled(100, n) for n in names) and not any(sampled(0, n) for n in names)


@pytest.mark.parametrize("value", ["0", "101", "half", "-5%", ""])
def test_a_bad_crosscheck_value_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(CROSSCHECK_FILE)
    # In this process: pytest refuses the value while parsing its arguments, before any test or world runs.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", f"--dstest-crosscheck={value}")
    result.stderr.fnmatch_lines(["*--dstest-crosscheck=*give 'all' or a percent of the threaded cases*"])
    assert result.ret != 0
