"""Contract E14: what rank threads share that processes would not is named, and processes judge such tests.

A rank that rebinds an attribute of a shared module (``unittest.mock.patch``, torch's ``patch_*`` test helpers,
``mod.fn = other``) changes it for every rank thread, where each process of a world has its own module. The
threaded world names the module, the attribute and the rank; the plugin then runs the spec on the process world,
whose verdict counts, and names the test in the session summary (issue 42).
"""

from __future__ import annotations

import sys
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import RankFailure
from dstest.worlds.threaded import thread_shared_in_last_run

pytestmark = pytest.mark.cpu

# A stand-in for a library module the body patches (torch's FSDP tests patch torch's own module functions).
LIB = types.ModuleType("dstest_test_patched_lib")
LIB.reduce = lambda t: dist.all_reduce(t)  # type: ignore[attr-defined]
sys.modules[LIB.__name__] = LIB


def patch_with_rank_closure(ctx):
    """torch's ``patch_reduce_scatter`` pattern: each rank patches with a closure of its own, then calls."""
    seen = []

    def mine(t):
        seen.append(ctx.rank)
        dist.all_reduce(t)

    with mock.patch.object(LIB, "reduce", mine):
        dist.barrier()  # every rank has patched: the last patcher's closure is the one all ranks call
        LIB.reduce(torch.ones(1))
        dist.barrier()
    assert seen == [ctx.rank], f"rank {ctx.rank} ran another rank's patch (its closure saw {seen})"


def plain_assignment(ctx):
    old = LIB.reduce
    LIB.reduce = lambda t: dist.all_reduce(t)  # type: ignore[attr-defined]
    try:
        LIB.reduce(torch.ones(1))
    finally:
        LIB.reduce = old  # type: ignore[attr-defined]
    return ctx.rank


def imports_and_collectives(ctx):
    import torch.distributed.fsdp  # an import binds a submodule on its package: not a patch

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_rank_patching_a_shared_module_is_named_with_the_module_attribute_and_rank():
    with pytest.raises(RankFailure) as info:
        dstest.run(patch_with_rank_closure, 2)
    text = str(info.value)
    assert "ran another rank's patch" in text
    assert "a rank rebound an attribute of a module during the run: dstest_test_patched_lib.reduce (by rank" in text
    assert 'worlds=["process"]' in text
    assert info.value.thread_shared[0].startswith("dstest_test_patched_lib.reduce rebound by rank")  # type: ignore[attr-defined]


def test_the_same_body_passes_on_processes():
    assert dstest.run(patch_with_rank_closure, 2, world="process") == [None, None]


def test_a_passing_run_that_rebound_a_module_attribute_is_seen_too():
    assert dstest.run(plain_assignment, 2) == [0, 1]
    shared = thread_shared_in_last_run()
    assert len(shared) == 1 and shared[0].startswith("dstest_test_patched_lib.reduce rebound by rank")


def test_imports_and_collectives_share_nothing():
    assert dstest.run(imports_and_collectives, 2) == [2.0, 2.0]
    assert thread_shared_in_last_run() == []


def test_writes_outside_rank_threads_are_not_noted():
    dstest.run(imports_and_collectives, 2)
    LIB.other = 1  # type: ignore[attr-defined]
    LIB.other = 2  # type: ignore[attr-defined]  (the main thread: no run, nothing noted)
    del LIB.other  # type: ignore[attr-defined]
    assert thread_shared_in_last_run() == []


SPEC_FILE = """
import sys, types
from unittest import mock
import torch, torch.distributed as dist
import dstest

LIB = types.ModuleType("judged_lib")
LIB.reduce = lambda t: dist.all_reduce(t)
sys.modules["judged_lib"] = LIB


@dstest.spec(world_size=[2], worlds=["threaded"])
def test_patches_per_rank(ctx):
    seen = []

    def mine(t):
        seen.append(ctx.rank)
        dist.all_reduce(t)

    with mock.patch.object(LIB, "reduce", mine):
        dist.barrier()
        LIB.reduce(torch.ones(1))
        dist.barrier()
    assert seen == [ctx.rank], f"rank {ctx.rank} ran another rank's patch"


@dstest.spec(world_size=[2], worlds=["threaded"])
def test_patches_and_is_wrong_anyway(ctx):
    with mock.patch.object(LIB, "reduce", lambda t: None):
        LIB.reduce(torch.ones(1))
    assert ctx.rank < 0, "wrong on every world"


@dstest.spec(world_size=[2], worlds=["threaded"])
def test_clean(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_the_plugin_hands_a_test_that_shared_state_to_the_process_world(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPEC_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.stdout.fnmatch_lines(
        [
            "*test_patches_per_rank*threaded-ws2* PASSED*",
            "*test_patches_and_is_wrong_anyway*threaded-ws2* FAILED*",
            "*test_clean*threaded-ws2* PASSED*",
            "*judged on the process world because rank threads shared state (judged_lib.reduce rebound by rank*",
            "*2 tests were judged on processes (rank threads shared state)*",
            "*test_patches_per_rank*judged_lib.reduce rebound by rank*(threaded: *ran another rank's patch*",
            "*test_patches_and_is_wrong_anyway*judged_lib.reduce rebound by rank*",
            '*mark them @dstest.spec(worlds=?"process"?)*',
            "*1 failed, 2 passed*",
        ]
    )


def test_threads_alone_keeps_the_threaded_verdict(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPEC_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "--dstest-threads-alone")
    result.stdout.fnmatch_lines(["*test_patches_per_rank*threaded-ws2* FAILED*", "*2 failed, 1 passed*"])
    assert "judged on processes" not in result.stdout.str()


def catches_warnings(ctx):
    import warnings

    with warnings.catch_warnings():  # rebinds warnings.filters on exit: the interpreter's, not a patch
        warnings.simplefilter("ignore")
        t = torch.ones(1)
        dist.all_reduce(t)
    return t.item()


def test_the_standard_librarys_bookkeeping_is_not_a_patch():
    assert dstest.run(catches_warnings, 2) == [2.0, 2.0]
    assert thread_shared_in_last_run() == []


def imports_a_module_that_rebinds_at_import(ctx):
    if ctx.rank == 0:  # a module's top-level code, as an import runs it, rebinding another module's attribute
        module = types.ModuleType("dstest_test_rebinds_at_import")
        code = "import sys\nlib = sys.modules['dstest_test_patched_lib']\nlib.reduce = lambda t: t\n"
        exec(compile(code, "<import>", "exec"), module.__dict__)
    dist.barrier()
    return ctx.rank


def test_a_modules_import_time_code_is_not_a_ranks_patch():
    """torch._dynamo wraps torch.manual_seed at import: imported first on a rank thread it looked like a patch."""
    saved = LIB.reduce
    try:
        assert dstest.run(imports_a_module_that_rebinds_at_import, 2) == [0, 1]
        assert thread_shared_in_last_run() == []
    finally:
        LIB.reduce = saved  # type: ignore[attr-defined]
