"""``dstest`` / ``python -m dstest``: the conformance run.

Runs the bundled specs (``dstest.conformance``, the contracts of docs/contracts.md) against one or more targets, worlds and
world sizes, prints a table (spec x world size: pass / FAIL / DEV / skip, with times) and writes JSON and
JUnit XML for CI systems and a self-contained HTML page for people. Exit code 1 when a spec fails on a
target; deviations of a third-party target (DeepSpeed) are findings, reported but not failing unless
``--fail-on-deviation``.

There is one conformance route: this command runs pytest in-process on the bundled package, once per
target, with :class:`dstest.report.ConformanceReport` collecting the outcomes; it only translates its
flags into pytest's (:func:`pytest_args`). So ``dstest --target X -k A1`` and
``pytest --dstest-target=X --dstest-worlds=<X's default world> <dstest/conformance> -k A1`` count the same,
fixtures and plug-in targets and worlds (pytest hooks, entry points) included.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dstest.report import Result

from dstest.worlds.request import DEFAULT_TIMEOUT

__all__ = ["main", "pytest_args"]


def _sizes(text: str) -> list[int]:
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import parse_world_sizes

    try:
        return list(parse_world_sizes(text, "--world-sizes"))
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _timeout(text: str) -> float:
    """``--timeout``: a finite number of seconds, > 0 and at most a day (the check every run makes)."""
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import parse_timeout

    try:
        return parse_timeout(text, "--timeout")
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _output(flag: str) -> Callable[[str], str]:
    """An argparse type for a report file (``--json``, ``--junit``, ``--html``): its directory must exist.

    Checked before the run, so that a long run does not end in an error about where its report goes.
    """

    def check(text: str) -> str:
        from dstest.errors import InvalidArgument
        from dstest.report.html import check_output_path

        try:
            return check_output_path(text, flag)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def _name(kind: str, known: Sequence[str]) -> Callable[[str], str]:
    """An argparse type for ``--target`` / ``--world``: a known name (built in or a plug-in's entry point).

    Plug-ins that pytest hooks add are known only inside the run; those names go through and the run
    checks them (``--dstest-target``, ``--dstest-worlds``).
    """

    def check(text: str) -> str:
        if not text.strip() or "," in text:
            raise argparse.ArgumentTypeError(f"--{kind}={text!r}: give one {kind} name; allowed: {', '.join(known)}")
        return text.strip()

    return check


def _default_world(target: str) -> str:
    """Where target ``target`` runs when no ``--world`` is given (its class's ``default_world``)."""
    from dstest.registry import target_factory

    return str(getattr(target_factory(target), "default_world", "threaded"))


def specs_path() -> str:
    """The directory of the bundled conformance package (``dstest/conformance``)."""
    import importlib.util

    found = importlib.util.find_spec("dstest.conformance")
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:  # pragma: no cover - a broken installation
        raise RuntimeError("dstest.conformance cannot be found: reinstall dstest")
    return os.path.realpath(locations[0])


def pytest_args(
    target: str,
    worlds: Sequence[str],
    *,
    world_sizes: Sequence[int] | None = None,
    keyword: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    collect_only: bool = False,
    plugins: Sequence[str] = (),
) -> list[str]:
    """The pytest command line of one target's conformance run (what the CLI flags translate to).

    ``keyword`` is pytest's ``-k`` expression (spec names, parameter ids and contracts are keywords,
    e.g. ``A1`` or ``B4 and not fp16``); a glob (``B*``, ``*sum*``) selects by spec name or contract
    instead (``--dstest-specs``). ``plugins`` are modules loaded with ``-p`` (e.g. one implementing
    ``pytest_dstest_targets``). The run uses no ini file and no cache, wherever it is started.
    """
    specs = specs_path()
    args = [
        specs,
        "-c", os.devnull,  # the bundled package's run, not the caller project's pytest configuration
        "--rootdir", specs,
        "-p", "no:cacheprovider",
        "-p", "no:terminal",  # the report prints the table; pytest's own lines would repeat it
        f"--dstest-target={target}",
        f"--dstest-worlds={','.join(worlds)}",
        f"--dstest-timeout={timeout!r}",
    ]  # fmt: skip
    for plugin in plugins:
        args += ["-p", plugin]
    if world_sizes:
        args.append(f"--dstest-world-sizes={','.join(str(s) for s in world_sizes)}")
    if keyword:
        if any(ch in keyword for ch in "*?["):
            args.append(f"--dstest-specs={keyword}")
        else:
            args += ["-k", keyword]
    if collect_only:
        args.append("--collect-only")
    return args


def _run(args: Sequence[str], plugin: object) -> int:
    import pytest

    return int(pytest.main(list(args), plugins=[plugin]))


def _parser() -> argparse.ArgumentParser:
    """The command line's options (the names of targets and worlds known now are checked and listed)."""
    from dstest.registry import target_names, world_names

    parser = argparse.ArgumentParser(prog="dstest", description=__doc__.splitlines()[0] if __doc__ else None)
    targets_known, worlds_known = target_names(), world_names()
    parser.add_argument(
        "--target", action="append", type=_name("target", targets_known),
        help=f"system under test (repeatable; default impl; known: {', '.join(targets_known)})",
    )  # fmt: skip
    parser.add_argument(
        "--world", action="append", type=_name("world", worlds_known),
        help=f"world to run in (repeatable; default: the target's own; known: {', '.join(worlds_known)})",
    )  # fmt: skip
    parser.add_argument(
        "--world-sizes", type=_sizes, default=None, help="override every spec's world sizes, e.g. 1,2,3"
    )
    parser.add_argument(
        "-k", "--spec", default=None,
        help="pytest -k expression over spec names and contracts (e.g. 'A1', 'B4 and not fp16'), or a glob (e.g. 'B*')",
    )  # fmt: skip
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_TIMEOUT,
        help=f"seconds per world run, > 0 and <= 86400 (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument("--json", metavar="PATH", type=_output("--json"), help="write every result as JSON")
    parser.add_argument("--junit", metavar="PATH", type=_output("--junit"), help="write JUnit XML")
    parser.add_argument(
        "--html", metavar="PATH", type=_output("--html"),
        help="write the report as one self-contained HTML page (matrix per target, evidence, filters)",
    )  # fmt: skip
    parser.add_argument("--fail-on-deviation", action="store_true", help="exit 1 when a third-party target deviates")
    parser.add_argument("--list", action="store_true", help="list the specs and exit")
    parser.add_argument(
        "-p", "--plugin", action="append", default=[], metavar="MODULE",
        help="load this pytest plugin module in the run (repeatable), e.g. one whose pytest_dstest_targets() adds a target",
    )  # fmt: skip
    return parser


def _run_target(target: str, args: argparse.Namespace) -> tuple[list[Result], int | None]:
    """Run (or list) the specs on one target: ``(its results, None)`` to go on with the next target, or
    ``([], exit code)`` when the command ends here (listed, nothing matched, the run stopped); raises
    SystemExit(2) on pytest's usage error, which pytest explained."""
    import pytest

    from dstest.registry import target_names
    from dstest.report import ConformanceReport

    unknown = target not in target_names()  # may be a pytest hook's: the run checks it
    # Without --world each target runs where it can: impl in threads, DeepSpeed (module-global process
    # groups) in the process world.
    worlds = list(dict.fromkeys(args.world or (["threaded"] if unknown else [_default_world(target)])))
    report = ConformanceReport(target, progress=not args.list, listing=args.list)
    code = _run(
        pytest_args(
            target, worlds, world_sizes=args.world_sizes, keyword=args.spec, timeout=args.timeout,
            collect_only=args.list, plugins=args.plugin,
        ),
        report,
    )  # fmt: skip
    for error in report.errors:
        print(f"dstest: {error}", file=sys.stderr)
    if code == pytest.ExitCode.USAGE_ERROR:  # pytest printed why (an unknown target or world, ...)
        raise SystemExit(2)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED or (code == pytest.ExitCode.OK and not report.cases):
        print(f"dstest: no bundled spec matches {args.spec!r}", file=sys.stderr)
        return [], 2
    if code in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.INTERRUPTED) or report.errors:
        print(f"dstest: the run of target {target!r} stopped (pytest exit code {code})", file=sys.stderr)
        return [], 3 if code == pytest.ExitCode.INTERNAL_ERROR else 1
    if args.list:
        for contract, label, sizes in report.listing:
            print(f"{contract or '-':<6} {label}  ws={list(sizes)}")
        return [], 0
    return list(report.results), None


def _write_reports(results: list[Result], args: argparse.Namespace, argv: Sequence[str] | None, seconds: float) -> None:
    """The table and summary on stdout, and the files asked for (--json, --junit, --html)."""
    from dstest.report import summary, table, write_json, write_junit

    print(table(results))
    print(summary(results, seconds))
    if args.json:
        write_json(results, args.json)
    if args.junit:
        write_junit(results, args.junit)
    if args.html:
        from dstest.report.html import write_html

        command = shlex.join(["dstest", *(sys.argv[1:] if argv is None else argv)])
        write_html(results, args.html, seconds=seconds, command=command, plugins=args.plugin)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    targets = list(dict.fromkeys(args.target or ["impl"]))
    results: list[Result] = []
    start = time.perf_counter()
    for target in targets:
        found, code = _run_target(target, args)
        if code is not None:
            return code
        results += found
    _write_reports(results, args, argv, time.perf_counter() - start)
    failed = any(r.status == "fail" for r in results)
    deviated = any(r.status == "deviation" for r in results)
    return 1 if failed or (args.fail_on_deviation and deviated) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
