"""Zero silent passes at the entry points (contract E9 for bodies that do not run, and the contracts' "clear error"; issue 10): every argument is checked, every body really runs.

Covers ``dstest.run``, ``@dstest.spec``, the fixtures, every ``--dstest-*`` option, the ``dstest`` CLI and
``RunRequest`` (what every ``World.run`` takes): timeouts must be finite positive numbers of
seconds (at most :data:`MAX_TIMEOUT_S`), world sizes ints >= 1, targets and worlds known; generator and
``async def`` bodies are refused; ``@dstest.spec`` works on test-class methods; a skip inside a spec is
reported at the spec's own line.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest

import dstest
from dstest.errors import InvalidArgument, InvalidSpec, InvalidWorldSize
from dstest.registry import check_target, target_factory
from dstest.specification import Settings
from dstest.worlds.protocol import MAX_TIMEOUT_S, check_timeout
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

BAD_TIMEOUTS: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    0,
    0.0,
    -1,
    1e12,
    MAX_TIMEOUT_S + 1,
    "10",
    True,
    None,
    [60],
]
GOOD_TIMEOUTS: list[Any] = [1, 0.5, Fraction(1, 2), MAX_TIMEOUT_S]
BAD_WORLD_SIZES: list[Any] = [2.5, 2.0, True, 0, -1, "2", None]


def rank_body(ctx: Any) -> int:
    return int(ctx.rank)


def generator_body(ctx: Any) -> Any:
    yield ctx.rank


async def coroutine_body(ctx: Any) -> None:
    raise AssertionError("never runs")


async def async_generator_body(ctx: Any) -> Any:
    yield ctx.rank


UNRUNNABLE = [generator_body, coroutine_body, async_generator_body]


def _hidden(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a plain wrapper: the decoration-time checks cannot see what it is."""

    @functools.wraps(fn)
    def plain(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    del plain.__wrapped__  # inspect would otherwise look through to fn
    return plain


def _timeout_error(value: Any) -> str:
    return rf"timeout={re.escape(repr(value))}: .*allowed: a finite number of seconds, > 0 and <= 86400"


# -- 1. timeouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
def test_bad_timeouts_are_refused_everywhere(value: Any) -> None:
    """NaN, inf, absurd values, strings and bools: an InvalidArgument naming timeout, value and rule."""
    with pytest.raises(InvalidArgument, match=_timeout_error(value)):
        check_timeout(value)
    with pytest.raises(InvalidArgument, match=_timeout_error(value)):
        RunRequest(rank_body, 2, timeout=value)
    with pytest.raises(InvalidArgument, match=_timeout_error(value)):
        dstest.run(rank_body, 2, timeout=value)
    with pytest.raises(InvalidArgument, match=_timeout_error(value)):
        Settings(timeout=value)
    if value is not None:  # spec(timeout=None) means "the --dstest-timeout"
        with pytest.raises(InvalidArgument, match=_timeout_error(value)):
            dstest.spec(timeout=value)
    for world in ("threaded", "fake"):  # World.run itself, through its RunRequest
        with pytest.raises(InvalidArgument, match=_timeout_error(value)):
            dstest.get_world(world).run(RunRequest(rank_body, 2, timeout=value))


@pytest.mark.parametrize("value", GOOD_TIMEOUTS, ids=repr)
def test_good_timeouts_are_accepted(value: Any) -> None:
    assert check_timeout(value) == float(value)
    assert dstest.run(rank_body, 2, timeout=value) == [0, 1]
    assert dstest.spec(timeout=value)(rank_body) is not None


# -- 1. world sizes, seeds, targets, worlds -------------------------------------------------------------
@pytest.mark.parametrize("value", BAD_WORLD_SIZES, ids=repr)
def test_bad_world_sizes_are_refused_everywhere(value: Any) -> None:
    shown = re.escape(f"world_size={value!r}")
    with pytest.raises(InvalidWorldSize, match=rf"{shown} must be an int >= 1"):
        RunRequest(rank_body, value)
    with pytest.raises(InvalidWorldSize, match=rf"{shown} must be an int >= 1"):
        dstest.run(rank_body, value)
    for world in ("threaded", "fake"):
        with pytest.raises(InvalidWorldSize, match=rf"{shown} must be an int >= 1"):
            dstest.get_world(world).run(RunRequest(rank_body, value))
    if value is not None:
        with pytest.raises(InvalidWorldSize, match=rf"{shown}"):
            dstest.spec(world_size=value)


@pytest.mark.parametrize(
    ("world_size", "message"),
    [
        (2.5, r"world_size=2.5 \(float\): give an int >= 1 or a list of them"),
        ("2", r"world_size='2' \(str\): give an int >= 1 or a list"),
        ([2, 2.5], r"world_size=\[2, 2.5\]: each size must be an int >= 1, got 2.5"),
        ([2, True], r"each size must be an int >= 1, got True"),
        ([], r"world_size=\[\] must name at least one world size"),
        ([2, 2], r"world_size=\[2, 2\]: lists \[2\] more than once"),
    ],
)
def test_spec_world_sizes(world_size: Any, message: str) -> None:
    with pytest.raises(InvalidWorldSize, match=message):
        dstest.spec(world_size=world_size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": "bogus"}, r"target='bogus': unknown target; allowed: impl, deepspeed"),
        ({"target": None}, r"target=None: unknown target"),
        ({"world": "bogus"}, r"world='bogus': unknown world; allowed: threaded, "),
        ({"world": ["threaded"]}, r"world=\['threaded'\]: unknown world"),
        ({"seed": -1}, r"seed=-1: must be an int >= 0"),
        ({"seed": 1.5}, r"seed=1.5: must be an int >= 0 \(e.g. 0\), got a float"),
        ({"seed": True}, r"seed=True: must be an int >= 0"),
        ({"args": "ab"}, r"args='ab' \(str\): must be a tuple or list"),
        ({"kwargs": {1: 2}}, r"kwargs=\{1: 2\}: must be a dict with str keys"),
    ],
)
def test_run_refuses_unknown_targets_worlds_and_bad_seeds(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        dstest.run(rank_body, 2, **kwargs)


@pytest.mark.parametrize(
    ("worlds", "message"),
    [
        ("threaded", r"worlds='threaded': give a list of world names, e.g. worlds=\['threaded'\]"),
        ([], r"worlds=\[\] names no world"),
        (["threaded", "threaded"], r"lists \['threaded'\] more than once"),
        (["gloo"], r"unknown \['gloo'\]; allowed: \['threaded'"),
    ],
)
def test_spec_worlds(worlds: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        dstest.spec(worlds=worlds)


def test_settings_get_world_and_contract_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="target='bogus': unknown target"):
        Settings(target="bogus")
    with pytest.raises(InvalidArgument, match="seed=-3"):
        Settings(seed=-3)
    with pytest.raises(InvalidArgument, match=r"world=\['threaded'\] is unknown"):
        dstest.get_world(["threaded"])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="contract=4: must be a str"):
        dstest.spec(contract=4)  # type: ignore[arg-type]


def test_known_target_names_match_the_targets_package() -> None:
    """The plugin checks --dstest-target against the torch-free registry; each name it accepts has an adapter."""
    import dstest.targets

    for name in dstest.targets.TARGET_NAMES:
        assert check_target(name) == name
        assert callable(target_factory(name))
    with pytest.raises(InvalidArgument, match=r"target='nope': unknown target; allowed: impl, deepspeed"):
        check_target("nope")


# -- 1. pytest options and fixtures (pytester) --------------------------------------------------------
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--dstest-timeout=nan", "*--dstest-timeout='nan': NaN is not a number of seconds; allowed: *<= 86400*"),
        ("--dstest-timeout=inf", "*--dstest-timeout='inf': more than the maximum of 86400 s*"),
        ("--dstest-timeout=1e12", "*--dstest-timeout='1e12': more than the maximum of 86400 s*"),
        ("--dstest-timeout=0", "*--dstest-timeout='0': must be > 0 seconds*"),
        ("--dstest-timeout=ten", "*--dstest-timeout='ten': give seconds per world run*"),
        ("--dstest-target=bogus", "*--dstest-target='bogus': unknown target; allowed: impl, deepspeed*"),
        ("--dstest-seed=-1", "*--dstest-seed='-1': give an integer seed >= 0*"),
        ("--dstest-seed=1.5", "*--dstest-seed='1.5': give an integer seed >= 0*"),
        ("--dstest-worlds=fake,fake", "*--dstest-worlds='fake,fake': lists [[]'fake'[]] more than once*"),
        ("--dstest-worlds=bogus", "*--dstest-worlds='bogus': unknown world(s)*"),
        ("--dstest-mark-unmarked=tpu", "*--dstest-mark-unmarked='tpu': allowed values are 'cpu' and 'gpu'*"),
        ("--dstest-world-sizes=0,2", "*--dstest-world-sizes='0,2': give comma-separated ints >= 1*"),
        ("--dstest-world-sizes=2,2", "*--dstest-world-sizes='2,2': give each size once*"),
    ],
)
def test_bad_options_are_usage_errors(pytester: pytest.Pytester, option: str, message: str) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest(option, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("attr", "value", "message"),
    [
        ("dstest_timeout", "float('nan')", "*--dstest-timeout=nan: NaN is not a number of seconds*"),
        ("dstest_target", "'bogus'", "*--dstest-target='bogus': unknown target; allowed: impl, deepspeed*"),
        ("dstest_seed", "-2", "*--dstest-seed=-2: must be an int >= 0*"),
    ],
)
def test_option_values_set_without_the_parser_are_checked(
    pytester: pytest.Pytester, attr: str, value: str, message: str
) -> None:
    """A conftest that sets the option values directly still gets a usage error from pytest_configure."""
    pytester.makeconftest(
        f"""
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(config):
            config.option.{attr} = {value}
        """
    )
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_good_options_are_accepted(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    for option in ("--dstest-target=deepspeed", "--dstest-timeout=86400", "--dstest-seed=7"):
        result = pytester.runpytest(option, "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.OK, (option, result.stderr.str())


def test_fixtures_check_their_arguments(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import math, pytest
        from dstest.errors import InvalidArgument, InvalidWorldSize

        def body(ctx):
            return ctx.rank

        def test_world_size(dstest_run):
            with pytest.raises(InvalidWorldSize, match="world_size=2.5 must be an int >= 1"):
                dstest_run(body, 2.5)

        def test_timeout(dstest_run):
            with pytest.raises(InvalidArgument, match="timeout=nan: NaN"):
                dstest_run(body, 2, timeout=math.nan)

        def test_unknown_keyword(dstest_run):
            with pytest.raises(InvalidArgument, match=r"unknown keyword\\(s\\) \\['wrld'\\]; allowed: \\['args'"):
                dstest_run(body, 2, wrld="fake")

        def test_world(dstest_world):
            from dstest.worlds.request import RunRequest

            with pytest.raises(InvalidArgument, match="world='gloo' is unknown"):
                dstest_world("gloo")
            with pytest.raises(InvalidArgument, match="timeout=inf"):
                dstest_world("threaded").run(RunRequest(body, 2, timeout=math.inf))

        def test_settings_are_checked(dstest_settings):
            assert dstest_settings.target == "deepspeed"

        def test_good_call(dstest_run):
            assert dstest_run(body, 2) == [0, 1]
        """
    )
    result = pytester.runpytest("--dstest-target=deepspeed", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)


# -- 1. the CLI ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timeout", "nan"], "--timeout='nan': NaN is not a number of seconds"),
        (["--timeout", "inf"], "--timeout='inf': more than the maximum of 86400 s"),
        (["--timeout", "1e12"], "--timeout='1e12': more than the maximum"),
        (["--timeout", "-1"], "--timeout='-1': must be > 0 seconds"),
        (["--timeout", "ten"], "--timeout='ten': give seconds per world run"),
        (["--target", "bogus"], "--dstest-target='bogus': unknown target; allowed: impl, deepspeed"),
        (["--world", "bogus"], "--dstest-worlds='bogus': unknown world(s) ['bogus']"),
        (["--world-sizes", "2,2"], "--world-sizes='2,2': give each size once"),
        (["--world-sizes", "2.5"], "--world-sizes='2.5': give comma-separated ints >= 1"),
    ],
)
def test_cli_refuses_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dstest.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--list"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# -- 2. generator and async bodies --------------------------------------------------------------------
@pytest.mark.parametrize("body", UNRUNNABLE, ids=lambda f: f.__name__)
def test_spec_refuses_generator_and_async_bodies(body: Callable[..., Any]) -> None:
    with pytest.raises(InvalidSpec, match=rf"@dstest.spec body {body.__name__} is an? .*would not run its body"):
        dstest.spec(world_size=2)(body)


@pytest.mark.parametrize("body", UNRUNNABLE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("world", ["threaded", "fake"])
def test_run_refuses_generator_and_async_bodies(body: Callable[..., Any], world: str) -> None:
    with pytest.raises(InvalidSpec, match=rf"fn={body.__name__} is an? .*would not run its body"):
        dstest.run(body, 2, world=world)
    with pytest.raises(InvalidSpec, match=rf"fn={body.__name__} is an? "):
        RunRequest(body, 2)


@pytest.mark.parametrize("world", ["threaded", "fake"])
def test_run_refuses_a_hidden_coroutine_body(world: str) -> None:
    """A wrapper hides ``async def`` from the checks: the coroutine it returns is still refused, closed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited" on top of the error
        with pytest.raises(InvalidSpec, match=r"returned a coroutine on ranks \[0, 1\] instead of running"):
            dstest.run(_hidden(coroutine_body), 2, world=world)
    assert dstest.run(rank_body, 2, world=world) == [0, 1]


def test_hidden_generator_spec_fails_instead_of_passing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import functools, dstest

        def plain(fn):
            def call(ctx):
                return fn(ctx)
            call.__name__ = call.__qualname__ = fn.__name__
            return call

        @dstest.spec(world_size=[2], worlds=["threaded"])
        @plain
        def test_hidden_generator(ctx):
            assert False, "never runs"
            yield
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*InvalidSpec: fn=test_hidden_generator returned a generator on ranks [[]0, 1[]]*"])


def test_generator_spec_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dstest

        @dstest.spec(world_size=[2], worlds=["threaded"])
        async def test_async(ctx):
            assert False
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*InvalidSpec: @dstest.spec body test_async is a coroutine function (async def)*"])


# -- 3. methods of test classes -----------------------------------------------------------------------
METHODS_FILE = """
import pytest, torch, torch.distributed as dist
import dstest
from dstest.worlds.request import RunRequest

@pytest.fixture
def base():
    return 10

class TestMethods:
    def setup_method(self):
        self.offset = 5

    @dstest.spec(world_size=[1, 2], worlds=["threaded", "fake"])
    def test_self_and_ctx(self, ctx):
        assert isinstance(self, TestMethods) and self.offset == 5
        assert ctx.rank < ctx.world_size

    @dstest.spec(world_size=[2], worlds=["threaded"])
    @pytest.mark.parametrize("scale", [1, 3])
    def test_params_and_fixtures(self, ctx, scale, base):
        t = torch.full((1,), float(scale * base + self.offset))
        dist.all_reduce(t)
        assert t.item() == 2 * (scale * base + 5)

    @staticmethod
    @dstest.spec(world_size=[2], worlds=["threaded"])
    def test_static(ctx):
        assert ctx.world_size == 2

    @dstest.spec(world_size=[2], worlds=["threaded"])
    def test_fails(self, ctx):
        assert ctx.rank == 0, "rank one of a method fails"

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_plain_function(ctx):
    assert ctx.world_size == 2
"""


def test_spec_methods_get_self_and_ctx(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(METHODS_FILE)
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        [
            "*TestMethods::test_self_and_ctx?threaded-ws2? PASSED*",
            "*TestMethods::test_params_and_fixtures?threaded-ws2-3? PASSED*",
            "*TestMethods::test_static?threaded-ws2? PASSED*",
            "*rank one of a method fails*",
        ]
    )
    result.assert_outcomes(passed=8, failed=1)


def test_method_without_self_is_a_clear_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import dstest

        class TestNoSelf:
            @dstest.spec(world_size=[2], worlds=["threaded"])
            def test_forgot_self(ctx):
                pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        [
            "*InvalidSpec: spec TestNoSelf.test_forgot_self is a method of a test class, but its first parameter is "
            "'ctx', not self: write def test_forgot_self(self, ctx, ...)*"
        ]
    )
    result.stdout.no_fnmatch_line("*dstest_case*")


def test_spec_method_needs_ctx_after_self() -> None:
    class Holder:
        with pytest.raises(
            InvalidSpec, match=r"must take the rank context as its first positional argument after self"
        ):

            @dstest.spec(world_size=2)
            def test_only_self(self: Any) -> None: ...

    assert Holder is not None


# -- 4. where a skip is reported ----------------------------------------------------------------------
def _line(source: str, marker: str) -> int:
    """The 1-based line of ``marker`` in ``source`` as pytester writes it (dedented, stripped)."""
    lines = source.strip().splitlines()
    return next(n for n, text in enumerate(lines, 1) if marker in text)


SKIP_FILE = """
import pytest, dstest

def helper(ctx):
    pytest.skip("helper skips")  # <helper>

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_body_skips(ctx):
    x = 1
    pytest.skip("body skips")  # <body>

@dstest.spec(world_size=[2], worlds=["threaded", "fake"])
def test_helper_skips(ctx):
    helper(ctx)

class TestSkips:
    @dstest.spec(world_size=[2], worlds=["threaded"])
    def test_method_skips(self, ctx):
        pytest.skip("method skips")  # <method>

@dstest.spec(world_size=[64], worlds=["nccl"])  # <unavailable>: pytest places a decorated test here too
def test_unavailable(ctx):
    pass
"""


def test_skips_are_reported_at_the_spec_line(pytester: pytest.Pytester) -> None:
    torch = pytest.importorskip("torch")
    path = pytester.makepyfile(test_skiploc=SKIP_FILE)
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    at = functools.partial(_line, SKIP_FILE)
    lines = [
        f"SKIPPED [[]1[]] test_skiploc.py:{at('<body>')}: body skips",
        f"SKIPPED [[]2[]] test_skiploc.py:{at('<helper>')}: helper skips",
        f"SKIPPED [[]1[]] test_skiploc.py:{at('<method>')}: method skips",
    ]
    if not torch.cuda.is_available():
        lines.append(f"SKIPPED [[]1[]] test_skiploc.py:{at('<unavailable>')}: needs 64 CUDA devices, found 0")
    result.stdout.fnmatch_lines(lines, consecutive=False)
    result.stdout.no_fnmatch_line("*dstest/specification*")
    assert path.name == "test_skiploc.py"


PROCESS_FILE = """
import pytest, dstest

class TestInProcesses:
    def setup_method(self):
        self.value = 41

    @dstest.spec(world_size=[2], worlds=["process"])
    def test_method(self, ctx):
        import torch.distributed as dist
        assert self.value == 41 and dist.get_rank() == ctx.rank

@dstest.spec(world_size=[2], worlds=["process"])
def test_skips(ctx):
    pytest.skip("process skips")  # <skip>
"""


def test_process_world_methods_and_skip_location(pytester: pytest.Pytester) -> None:
    """The process world has no traceback objects: the location comes from the rank's traceback text."""
    pytester.makepyfile(test_inprocesses=PROCESS_FILE)
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    line = _line(PROCESS_FILE, "<skip>")
    result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] test_inprocesses.py:{line}: process skips"])
    result.assert_outcomes(passed=1, skipped=1)


def test_run_accepts_a_spec_function_but_not_a_spec_method() -> None:
    """``dstest.run`` on a ``@dstest.spec`` function runs its body; a spec method needs pytest's self."""
    decorated = dstest.spec(world_size=2)(rank_body)
    assert dstest.run(decorated, 3) == [0, 1, 2]

    class Holder:
        @dstest.spec(world_size=2)
        def test_method(self: Any, ctx: Any) -> None: ...

    with pytest.raises(InvalidSpec, match="is a spec method of a test class: run it through pytest"):
        dstest.run(Holder.test_method, 2)


def test_unpicklable_self_is_a_clear_error_for_the_process_world() -> None:
    import pickle
    import threading

    from dstest.specification.bodies import SpecSelf

    class Unpicklable:
        lock = None

        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(InvalidArgument, match=r"self=.*does not pickle .*keep only picklable attributes on self"):
        pickle.dumps(SpecSelf(Unpicklable()))
    holder = pickle.loads(pickle.dumps(SpecSelf(Fraction(1, 3))))
    assert holder.get() == Fraction(1, 3)
