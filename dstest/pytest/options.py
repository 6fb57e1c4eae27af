"""The plugin's options and ini settings (``pytest_addoption``), and the parsers that check each value.

Every ``--dstest-*`` option is checked when pytest parses it, by the same checks ``dstest.run`` and the
run request make (:mod:`dstest.worlds.protocol`, :mod:`dstest.registry`), and refused as a usage error that
names the option, the value and what is allowed. Imports only pytest and the standard library at import
time (the defaults come from the torch-free :mod:`dstest.worlds.request`).
"""

from __future__ import annotations

from typing import Any

import pytest

from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT

OPT_WORLDS = "--dstest-worlds"
OPT_TIMEOUT = "--dstest-timeout"
OPT_TARGET = "--dstest-target"
OPT_SEED = "--dstest-seed"
OPT_MARK_UNMARKED = "--dstest-mark-unmarked"
OPT_WORLD_SIZES = "--dstest-world-sizes"
OPT_SPECS = "--dstest-specs"
OPT_TRACE = "--dstest-trace"
OPT_FLIGHT_RECORDER = "--dstest-flight-recorder"
OPT_ASYNC_HAZARDS = "--dstest-async-hazards"
OPT_STRICT_SHAPES = "--dstest-strict-shapes"
OPT_UNCHECKED = "--dstest-unchecked"
INI_UNCHECKED = "dstest_unchecked"
OPT_WARM = "--dstest-warm"
OPT_NO_WARM = "--dstest-no-warm"
INI_WARM = "dstest_warm"
OPT_THREADS_ALONE = "--dstest-threads-alone"
OPT_CROSSCHECK = "--dstest-crosscheck"
INI_DESELECT_SOAK = "dstest_deselect_soak"


def usage_error(option: str, value: object, exc: Exception, shown: str) -> pytest.UsageError:
    """An option error in pytest's usage-error form, naming the option, the value and what is allowed.

    The shared checks start their message with the Python argument (``shown``, e.g. ``timeout=nan``); on
    the command line the option and the text given are named instead.
    """
    detail = str(exc).removeprefix(shown).lstrip(" :")
    return pytest.UsageError(f"{option}={value!r}: {detail}")


def _parse_worlds(value: str) -> tuple[str, ...]:
    """The world names of ``--dstest-worlds``; whether each is known is checked at configure time, after
    plug-ins (conftests included) have registered theirs."""
    names = tuple(w.strip() for w in value.split(",") if w.strip())
    if not names:
        from dstest.worlds import WORLD_NAMES  # light: no torch import

        raise pytest.UsageError(
            f"{OPT_WORLDS}={value!r}: unknown world(s) (none given); use a comma-separated list of {', '.join(WORLD_NAMES)}"
        )
    repeated = sorted({w for w in names if names.count(w) > 1})
    if repeated:
        raise pytest.UsageError(f"{OPT_WORLDS}={value!r}: lists {repeated} more than once; give each world once")
    return names


def check_worlds(names: tuple[str, ...] | None) -> None:
    from dstest.registry import world_names

    known = world_names()
    unknown = [w for w in names or () if w not in known]
    if unknown:
        raise pytest.UsageError(
            f"{OPT_WORLDS}={','.join(names or ())!r}: unknown world(s) {unknown}; "
            f"use a comma-separated list of {', '.join(known)}"
        )


def _parse_world_sizes(value: str) -> tuple[int, ...]:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import parse_world_sizes  # light: no torch import

    try:
        return parse_world_sizes(value, OPT_WORLD_SIZES)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None


def _parse_timeout(value: str) -> float:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import parse_timeout  # light: no torch import

    try:
        return parse_timeout(value, OPT_TIMEOUT)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None


def _parse_target(value: str) -> str:
    """The name of ``--dstest-target``; whether it is known is checked at configure time (plug-ins first)."""
    return value


def _parse_seed(value: str) -> int:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import check_seed

    try:
        return check_seed(int(value))
    except (ValueError, InvalidArgument):
        raise pytest.UsageError(f"{OPT_SEED}={value!r}: give an integer seed >= 0 (e.g. 0)") from None


def _parse_crosscheck(value: str) -> int:
    text = value.strip().lower()
    if text == "all":
        return 100
    try:
        percent = int(text.removesuffix("%"))
    except ValueError:
        percent = -1
    if not 1 <= percent <= 100:
        raise pytest.UsageError(
            f"{OPT_CROSSCHECK}={value!r}: give 'all' or a percent of the threaded cases from 1% to 100% (e.g. 25%)"
        )
    return percent


def _parse_mark(value: str) -> str:
    if value not in ("cpu", "gpu"):
        raise pytest.UsageError(f"{OPT_MARK_UNMARKED}={value!r}: allowed values are 'cpu' and 'gpu'")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dstest", "dstest: distributed specs on simulated and real worlds")
    group.addoption(
        OPT_WORLDS,
        type=_parse_worlds,
        default=None,
        help="comma-separated worlds to expand every spec to (threaded, threaded-cuda, fake, process, nccl, "
        "launched); default: each spec's own list, else threaded,nccl (under torchrun: nccl runs as launched)",
    )
    group.addoption(
        OPT_TIMEOUT,
        type=_parse_timeout,
        default=DEFAULT_TIMEOUT,
        help=f"seconds before a world is failed with every rank's stack: > 0, at most 86400 (default {DEFAULT_TIMEOUT:g})",
    )
    group.addoption(
        OPT_TARGET,
        type=_parse_target,
        default="impl",
        help="system under test for the bundled specs: impl (default), deepspeed, or a plug-in's target",
    )
    group.addoption(
        OPT_WORLD_SIZES,
        type=_parse_world_sizes,
        default=None,
        metavar="1,2,3",
        help="run every spec at these world sizes instead of its own",
    )
    group.addoption(
        OPT_SPECS,
        default=None,
        metavar="GLOB",
        help="keep only specs whose function name or contract matches this glob (e.g. 'B*', '*sum*')",
    )
    group.addoption(
        OPT_SEED,
        type=_parse_seed,
        default=DEFAULT_SEED,
        help=f"base seed of every rank's generator, an int >= 0 (default {DEFAULT_SEED})",
    )
    group.addoption(
        OPT_MARK_UNMARKED,
        type=_parse_mark,
        default=None,
        metavar="cpu|gpu",
        help="give tests that carry neither the cpu nor the gpu marker this one, so -m cpu keeps them",
    )
    _add_observation_options(group)
    _add_compat_options(group, parser)
    _add_warm_options(group, parser)


def _add_compat_options(group: Any, parser: pytest.Parser) -> None:
    """Options of the plugins that run other projects' suites (``-p dstest.compat.torch``)."""
    group.addoption(
        OPT_UNCHECKED,
        action="store_true",
        default=False,
        help=f"with -p dstest.compat.torch: the gloo groups tests on torch's process-based bases form are torch's "
        "own, as upstream (no check of collectives across ranks, no deadlock report naming each rank's call); by "
        f"default they are dstest's checked groups. The ini setting {INI_UNCHECKED} = true does the same",
    )
    parser.addini(
        INI_UNCHECKED,
        type="bool",
        default=False,
        help="the ini form of --dstest-unchecked (torch's process-based test bases on torch's own gloo groups)",
    )


def _parse_trace_dir(value: str, option: str = OPT_TRACE) -> str:
    import os

    if not value.strip():
        raise pytest.UsageError(f"{option}={value!r}: give a directory to write the trace files into")
    if os.path.exists(value) and not os.path.isdir(value):
        raise pytest.UsageError(f"{option}={value!r}: is a file; give a directory (made if missing)")
    return value


def _parse_flight_recorder_dir(value: str) -> str:
    return _parse_trace_dir(value, OPT_FLIGHT_RECORDER)


def _add_observation_options(group: Any) -> None:
    group.addoption(
        OPT_TRACE,
        type=_parse_trace_dir,
        default=None,
        metavar="DIR",
        help="write every test's world runs as Chrome-trace JSON (DIR/<test id>.json; open in ui.perfetto.dev). "
        "Without it, a failing test's trace goes to pytest's cache (.pytest_cache/d/dstest-traces). "
        "Also writes torch flight-recorder dumps of each run (DIR/<test id>.fr/run-<n>)",
    )
    group.addoption(
        OPT_FLIGHT_RECORDER,
        type=_parse_flight_recorder_dir,
        default=None,
        metavar="DIR",
        help="a world run that fails (mismatch, deadlock, timeout) writes torch flight-recorder dumps to "
        "DIR/<test id>/run-<n> and its report names them; read with python -m "
        "torch.distributed.flight_recorder.fr_trace",
    )
    group.addoption(
        OPT_ASYNC_HAZARDS,
        action="store_true",
        default=False,
        help="poison the outputs of async_op=True collectives and irecvs until they are waited (NaN, "
        "integers 0xA5 bytes), so code that reads them early fails; threaded worlds only",
    )
    group.addoption(
        OPT_STRICT_SHAPES,
        action="store_true",
        default=False,
        help="also refuse collectives and transfers whose ranks' buffers differ only in shape (by default, "
        "as on gloo and NCCL, element counts and dtypes must match)",
    )
    group.addoption(
        OPT_THREADS_ALONE,
        action="store_true",
        default=False,
        help="keep the threaded world's verdict even where its rank threads shared what processes would not (a "
        "module attribute a rank rebound, a module global holding a rank's group, torch.default_generator used "
        "by name); by default such a spec is run again on the process world, whose verdict counts",
    )
    group.addoption(
        OPT_CROSSCHECK,
        type=_parse_crosscheck,
        default=0,
        metavar="all|N%",
        help="also run these threaded cases (all, or a sample of N percent, the same cases run after run) on the "
        "process world and fail on any difference in verdict, per-rank results or collective traces (dstest.crosscheck)",
    )


def _add_warm_options(group: Any, parser: pytest.Parser) -> None:
    """The warm server's options and ini setting (dstest.pytest.warm), and the soak marker's setting."""
    group.addoption(
        OPT_WARM,
        action="store_true",
        dest="dstest_warm",
        default=None,
        help="run in a session forked from a warm server that has already imported torch and what the "
        "process world's workers need (started by the first such run; a changed source file makes the run "
        f"cold again and stops the server); the ini setting {INI_WARM} = true makes every run so; see "
        "dstest.pytest.warm",
    )
    group.addoption(
        OPT_NO_WARM,
        action="store_false",
        dest="dstest_warm",
        help=f"run in this process, neither handed to a warm server nor starting one, whatever {INI_WARM} says",
    )
    parser.addini(
        INI_WARM,
        type="bool",
        default=False,
        help=f"dstest: every run as with {OPT_WARM} (a warm server kept between runs; {OPT_NO_WARM} runs one "
        "cold; python -m dstest.pytest.warm --stop stops the servers)",
    )
    parser.addini(
        INI_DESELECT_SOAK,
        type="bool",
        default=False,
        help="dstest: deselect items marked soak unless -m names soak (default false: a project's own soak "
        "marker is left alone)",
    )
