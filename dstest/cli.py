"""``dstest`` / ``python -m dstest``: the conformance run.

Runs the bundled specs (``dstest.specs``, the contracts of SPEC.md) against one or more targets, worlds and
world sizes, prints a table (spec x world size: pass / FAIL / DEV / skip, with times) and writes JSON and
JUnit XML for CI systems. Exit code 1 when a spec fails on a target; deviations of a third-party target
(DeepSpeed) are findings, reported but not failing unless ``--fail-on-deviation``.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import itertools
import json
import pkgutil
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Result", "discover", "main"]


@dataclass
class Result:
    spec: str
    contract: str | None
    params: str
    target: str
    world: str
    world_size: int
    status: str  # pass | fail | deviation | skip
    seconds: float
    detail: str = ""
    ranks: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Item:
    module: str
    name: str
    info: Any
    params: dict[str, Any]
    param_id: str
    skip: str | None = None


def _expand_parametrize(fn: Any) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The (id, kwargs) combinations of a function's ``pytest.mark.parametrize`` marks."""
    axes: list[list[tuple[str, dict[str, Any]]]] = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        ids = mark.kwargs.get("ids")
        axis = []
        for i, value in enumerate(values):
            vals = value.values if hasattr(value, "values") and hasattr(value, "marks") else value
            if len(names) == 1 and not (hasattr(value, "values") and hasattr(value, "marks")):
                vals = (value,)
            pid = getattr(value, "id", None) or (ids[i] if isinstance(ids, list | tuple) else None)
            pid = pid or "-".join(str(v) for v in vals)
            axis.append((str(pid), dict(zip(names, vals))))
        axes.append(axis)
    combos = []
    for combo in itertools.product(*axes):
        ident = "-".join(c[0] for c in combo)
        merged: dict[str, Any] = {}
        for _, kw in combo:
            merged.update(kw)
        combos.append((ident, merged))
    return combos or [("", {})], None


def discover(pattern: str = "*") -> list[_Item]:
    """Every bundled spec (module ``dstest.specs.*``) whose name or contract matches ``pattern``."""
    import inspect

    import dstest.specs as pkg
    from dstest.specification import CASE_ARG, SETTINGS_ARG, spec_info

    items = []
    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        module = importlib.import_module(f"dstest.specs.{mod}")
        for name, obj in sorted(vars(module).items()):
            info = spec_info(obj)
            if info is None or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(info.contract or "", pattern)):
                continue
            combos, _ = _expand_parametrize(obj)
            wanted = [p for p in inspect.signature(obj).parameters if p not in (CASE_ARG, SETTINGS_ARG)]
            for pid, kwargs in combos:
                missing = [p for p in wanted if p not in kwargs]
                skip = f"needs pytest fixtures {missing}; run it under pytest" if missing else None
                items.append(_Item(module.__name__, name, info, kwargs, pid, skip))
    # SPEC order (A1, A2, ..., D8), then name: the table reads like SPEC.md.
    return sorted(items, key=lambda it: (_contract_key(it.info.contract), it.name))


def _contract_key(contract: str | None) -> tuple[str, int]:
    if not contract:
        return ("~", 0)
    digits = "".join(ch for ch in contract[1:] if ch.isdigit())
    return (contract[:1], int(digits) if digits else 0)


def _classify(exc: BaseException, third_party: bool) -> tuple[str, str, dict[str, str]]:
    from _pytest.outcomes import Failed  # pytest.raises' "DID NOT RAISE" and pytest.fail

    from dstest.errors import Deviation, DstestError, RankFailure, WorldAborted

    def is_contract_failure(e: BaseException) -> bool:
        """What the target did (an assertion or its own error), not a fault of dstest's inputs or worlds."""
        if isinstance(e, DstestError) and not isinstance(e, Deviation):
            return False
        return isinstance(e, AssertionError | ValueError | TypeError | NotImplementedError | Failed)

    ranks: dict[str, str] = {}
    if isinstance(exc, RankFailure):
        primary = {r: e for r, e in exc.exceptions.items() if not isinstance(e, WorldAborted)}
        ranks = {str(r): exc.failures[r] for r in sorted(exc.failures)}
        first = next(iter(primary.values()), None) or exc
        detail = f"{type(first).__name__}: {first}".splitlines()[0]
        contract_failure = bool(primary) and all(is_contract_failure(e) for e in primary.values())
    else:
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
        contract_failure = is_contract_failure(exc)
    if third_party and contract_failure:
        return "deviation", detail, ranks
    return "fail", detail, ranks


def _run_all(
    items: Sequence[_Item], targets: Sequence[str], worlds: Sequence[str], sizes: Sequence[int] | None, timeout: float
) -> Iterator[Result]:
    import pytest

    from dstest.targets import get_target
    from dstest.worlds import get_world

    for target in targets:
        third_party = bool(getattr(get_target(target), "third_party", False))
        for item in items:
            for world_name in worlds:
                world = get_world(world_name)
                for ws in sizes or item.info.world_sizes:
                    base = dict(
                        spec=item.name, contract=item.info.contract, params=item.param_id, target=target,
                        world=world_name, world_size=ws,
                    )
                    reason = item.skip or world.unavailable_reason(ws)
                    if reason:
                        yield Result(**base, status="skip", seconds=0.0, detail=reason)
                        continue
                    start = time.perf_counter()
                    try:
                        world.run(item.info.fn, ws, kwargs=item.params, timeout=item.info.timeout or timeout, target=target)
                        status, detail, ranks = "pass", "", dict[str, str]()
                    except BaseException as exc:  # classify everything a spec can end with
                        if isinstance(exc, KeyboardInterrupt):
                            raise
                        skipped = _skip_reason(exc, pytest)
                        if skipped is not None:
                            status, detail, ranks = "skip", skipped, {}
                        else:
                            status, detail, ranks = _classify(exc, third_party)
                    yield Result(**base, status=status, seconds=time.perf_counter() - start, detail=detail, ranks=ranks)


def _skip_reason(exc: BaseException, pytest: Any) -> str | None:
    from dstest.errors import RankFailure, WorldAborted

    if isinstance(exc, pytest.skip.Exception):
        return str(exc)
    if isinstance(exc, RankFailure):
        primary = [e for e in exc.exceptions.values() if not isinstance(e, WorldAborted)]
        if primary and all(isinstance(e, pytest.skip.Exception) for e in primary):
            return str(primary[0])
    return None


_SYMBOL = {"pass": "pass", "fail": "FAIL", "deviation": "DEV", "skip": "skip"}


def _table(results: Sequence[Result]) -> str:
    sizes = sorted({r.world_size for r in results})
    rows: dict[tuple[str, str, str, str], dict[int, Result]] = {}
    for r in results:
        label = r.spec + (f"[{r.params}]" if r.params else "")
        rows.setdefault((r.target, r.world, label, r.contract or ""), {})[r.world_size] = r
    width = max([len(k[2]) for k in rows] + [4])
    head = f"{'target':<10} {'world':<9} {'contract':<8} {'spec':<{width}} " + " ".join(f"{'ws' + str(s):>12}" for s in sizes)
    lines = [head, "-" * len(head)]
    for (target, world, label, contract), cells in rows.items():
        shown = []
        for s in sizes:
            cell = cells.get(s)
            shown.append(f"{'':>12}" if cell is None else f"{_SYMBOL[cell.status] + f' {cell.seconds * 1000:.0f}ms':>12}")
        lines.append(f"{target:<10} {world:<9} {contract:<8} {label:<{width}} " + " ".join(shown))
    return "\n".join(lines)


def _junit(results: Sequence[Result], path: str) -> None:
    suite = ET.Element(
        "testsuite",
        name="dstest-conformance",
        tests=str(len(results)),
        failures=str(sum(r.status in ("fail", "deviation") for r in results)),
        skipped=str(sum(r.status == "skip" for r in results)),
    )
    for r in results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"{r.target}.{r.contract or 'spec'}",
            name=f"{r.spec}[{'-'.join(p for p in (r.params, r.world, 'ws' + str(r.world_size)) if p)}]",
            time=f"{r.seconds:.4f}",
        )
        if r.status == "skip":
            ET.SubElement(case, "skipped", message=r.detail)
        elif r.status in ("fail", "deviation"):
            node = ET.SubElement(case, "failure", message=r.detail, type=r.status)
            node.text = "\n".join(r.ranks.values())
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def _default_world(target: str) -> str:
    from dstest.targets import get_target

    return str(getattr(get_target(target), "default_world", "threaded"))


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes={text!r}: give comma-separated ints >= 1, e.g. 1,2,3")
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes={text!r}: give each size once, e.g. 1,2,3")
    return sizes


def _timeout(text: str) -> float:
    """``--timeout``: a finite number of seconds, > 0 and at most a day (the check every run makes)."""
    from dstest.errors import InvalidArgument
    from dstest.worlds.protocol import MAX_TIMEOUT_S, check_timeout

    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--timeout={text!r}: give seconds per world run, > 0 and <= {MAX_TIMEOUT_S:g} (e.g. 120)"
        ) from None
    try:
        return check_timeout(seconds)
    except InvalidArgument as exc:
        detail = str(exc).removeprefix(f"timeout={seconds!r}").lstrip(" :")
        raise argparse.ArgumentTypeError(f"--timeout={text!r}: {detail}") from None


def main(argv: Sequence[str] | None = None) -> int:
    from dstest.worlds import WORLD_NAMES
    from dstest.worlds.protocol import TARGET_NAMES

    parser = argparse.ArgumentParser(prog="dstest", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", action="append", choices=list(TARGET_NAMES), help="system under test (repeatable; default impl)")
    parser.add_argument("--world", action="append", choices=list(WORLD_NAMES), help="world to run in (repeatable; default threaded)")
    parser.add_argument("--world-sizes", type=_sizes, default=None, help="override every spec's world sizes, e.g. 1,2,3")
    parser.add_argument("-k", "--spec", default="*", help="glob over spec names or contracts, e.g. 'B*' or '*sum*'")
    parser.add_argument("--timeout", type=_timeout, default=120.0, help="seconds per world run, > 0 and <= 86400 (default 120)")
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write JUnit XML")
    parser.add_argument("--fail-on-deviation", action="store_true", help="exit 1 when a third-party target deviates")
    parser.add_argument("--list", action="store_true", help="list the specs and exit")
    args = parser.parse_args(argv)

    items = discover(args.spec)
    if args.list:
        for it in items:
            print(f"{it.info.contract or '-':<6} {it.name}{'[' + it.param_id + ']' if it.param_id else ''}  ws={list(it.info.world_sizes)}")
        return 0
    if not items:
        print(f"dstest: no bundled spec matches {args.spec!r}", file=sys.stderr)
        return 2
    targets = args.target or ["impl"]
    # Without --world each target runs where it can: impl in threads, DeepSpeed (module-global process
    # groups) in the process world.
    worlds = args.world or sorted({_default_world(t) for t in targets}, key=list(WORLD_NAMES).index)
    total = sum(len(args.world_sizes or it.info.world_sizes) for it in items) * len(targets) * len(worlds)
    results: list[Result] = []
    start = time.perf_counter()
    live = sys.stderr.isatty()
    for n, result in enumerate(_run_all(items, targets, worlds, args.world_sizes, args.timeout), 1):
        results.append(result)
        if live:  # a redrawn bar on a terminal; in CI logs, a line per tenth of the run
            bar = "#" * (30 * n // total)
            print(f"\r[{bar:<30}] {n}/{total} {result.spec[:50]:<50}", end="", file=sys.stderr, flush=True)
        elif n == total or n % max(1, total // 10) == 0:
            print(f"dstest: {n}/{total} runs done", file=sys.stderr, flush=True)
    if live:
        print(file=sys.stderr)
    print(_table(results))
    counts = {s: sum(r.status == s for r in results) for s in _SYMBOL}
    print(
        f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['deviation']} deviations, "
        f"{counts['skip']} skipped in {time.perf_counter() - start:.1f}s"
    )
    for r in results:
        if r.status in ("fail", "deviation"):
            detail = r.detail if len(r.detail) <= 160 else r.detail[:157] + "..."  # whole text in --json/--junit
            print(f"  {_SYMBOL[r.status]:<4} {r.target} {r.contract or ''} {r.spec}[{r.params}] ws{r.world_size}: {detail}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=1)
    if args.junit:
        _junit(results, args.junit)
    failed = counts["fail"] or (args.fail_on_deviation and counts["deviation"])
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
