"""Conformance outcomes: what a failed spec means, and the report of a run (table, JSON, JUnit XML).

One classification serves both routes: the pytest plugin marks a spec failure of a third-party target as
a *deviation* (``pytest_runtest_makereport``), and the ``dstest`` command, which runs pytest with
:class:`ConformanceReport` registered, reads the same mark. So ``pytest --dstest-target=X dstest/conformance``
and ``dstest --target X`` count the same passes, failures, deviations and skips.

A deviation is the target breaking a docs/contracts.md contract (an assertion in the spec, or the target's own
ValueError/TypeError/NotImplementedError, or a :class:`dstest.errors.Deviation` an adapter raised) on a
target that is not ours to fix (``third_party = True``). Everything else that fails, dstest's own errors
included, is a failure.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dstest.report.progress import Progress

__all__ = [
    "CASE_PROPERTY",
    "DEVIATION",
    "FAILURE_PROPERTY",
    "OUTCOME_PROPERTY",
    "ConformanceReport",
    "Result",
    "annotate",
    "classify",
    "contract_key",
    "counts",
    "is_deviation",
    "is_third_party",
    "summary",
    "table",
    "write_json",
    "write_junit",
]

#: The ``report.user_properties`` entry that marks a report's dstest outcome (survives pytest-xdist).
OUTCOME_PROPERTY = "dstest_outcome"
#: Its value for a deviation.
DEVIATION = "deviation"

SYMBOL = {"pass": "pass", "fail": "FAIL", "deviation": "DEV", "skip": "skip"}


@dataclass
class Result:
    """One run of one spec case (target, world, world size, parameters)."""

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


def is_third_party(target: str) -> bool:
    """Whether target ``target`` is not ours to fix (its class's ``third_party``; the adapter is not made)."""
    from dstest.registry import target_factory

    return bool(getattr(target_factory(target), "third_party", False))


def classify(exc: BaseException, third_party: bool) -> tuple[str, str, dict[str, str]]:
    """``(status, one-line detail, {rank: traceback})`` of a spec that raised ``exc``; status 'fail' or 'deviation'."""
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
        detail = f"{type(first).__name__}: {first}".splitlines()[0] if str(first) else type(first).__name__
        contract_failure = bool(primary) and all(is_contract_failure(e) for e in primary.values())
    else:
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        contract_failure = is_contract_failure(exc)
    if third_party and contract_failure:
        return DEVIATION, detail, ranks
    return "fail", detail, ranks


def is_deviation(report: Any) -> bool:
    """Whether a pytest report carries the deviation mark (see the plugin's makereport hook)."""
    return (OUTCOME_PROPERTY, DEVIATION) in list(getattr(report, "user_properties", ()) or ())


def contract_key(contract: str | None) -> tuple[str, int]:
    """contract order: by letter, then by number (E9 before E10); specs without a contract last."""
    if not contract:
        return ("~", 0)
    digits = "".join(ch for ch in contract[1:] if ch.isdigit())
    return (contract[:1], int(digits) if digits else 0)


def table(results: Sequence[Result]) -> str:
    """Spec x world size: pass / FAIL / DEV / skip with times, one row per (target, world, spec, params)."""
    sizes = sorted({r.world_size for r in results})
    rows: dict[tuple[str, str, str, str], dict[int, Result]] = {}
    for r in results:
        label = r.spec + (f"[{r.params}]" if r.params else "")
        rows.setdefault((r.target, r.world, label, r.contract or ""), {})[r.world_size] = r
    width = max([len(k[2]) for k in rows] + [4])
    head = f"{'target':<10} {'world':<9} {'contract':<8} {'spec':<{width}} " + " ".join(
        f"{'ws' + str(s):>12}" for s in sizes
    )
    lines = [head, "-" * len(head)]
    for (target, world, label, contract), cells in rows.items():
        shown = []
        for s in sizes:
            cell = cells.get(s)
            shown.append(
                f"{'':>12}" if cell is None else f"{SYMBOL[cell.status] + f' {cell.seconds * 1000:.0f}ms':>12}"
            )
        lines.append(f"{target:<10} {world:<9} {contract:<8} {label:<{width}} " + " ".join(shown))
    return "\n".join(lines)


def write_json(results: Sequence[Result], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) for r in results], fh, indent=1)


def write_junit(results: Sequence[Result], path: str) -> None:
    """JUnit XML: a deviation is a ``<failure type="deviation">`` (CI shows it; the exit code may not)."""
    suite = ET.Element(
        "testsuite",
        name="dstest-conformance",
        tests=str(len(results)),
        failures=str(sum(r.status in ("fail", DEVIATION) for r in results)),
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
        elif r.status in ("fail", DEVIATION):
            node = ET.SubElement(case, "failure", message=r.detail, type=r.status)
            node.text = "\n".join(r.ranks.values())
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def _skip_detail(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


@dataclass
class _Case:
    spec: str
    contract: str | None
    params: str
    world: str
    world_size: int


#: The ``report.user_properties`` entries that carry a case and its failure from an xdist worker (where the
#: spec ran) to the controller (where the report is written): see :func:`annotate`.
CASE_PROPERTY = "dstest_case"
FAILURE_PROPERTY = "dstest_failure"


def _case_of(item: pytest.Item) -> _Case | None:
    """The conformance case a collected item runs, or None for an item that is not a spec."""
    from dstest.specification import CASE_ARG, spec_info

    info = spec_info(getattr(item, "function", None))
    callspec: Any = getattr(item, "callspec", None)
    case = callspec.params.get(CASE_ARG) if callspec is not None else None
    if info is None or case is None:
        return None
    params = callspec.id.replace(case.id, "", 1).replace("--", "-").strip("-")
    return _Case(getattr(item, "originalname", item.name), info.contract, params, case.world, case.world_size)


def annotate(report: pytest.TestReport, item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Put ``item``'s case (and a failure's detail and rank tracebacks) on ``report`` for another process.

    A :class:`ConformanceReport` on the xdist controller sees reports, never items: it reads these.
    """
    case = _case_of(item)
    if case is None:
        return
    report.user_properties.append((CASE_PROPERTY, asdict(case)))
    if call.excinfo is not None and report.failed:
        _, detail, ranks = classify(call.excinfo.value, third_party=False)  # the status is the plugin's mark
        report.user_properties.append((FAILURE_PROPERTY, [detail, ranks]))


def _property(report: pytest.TestReport, name: str) -> Any:
    return next((value for key, value in getattr(report, "user_properties", ()) or () if key == name), None)


class ConformanceReport:
    """A pytest plugin that collects one :class:`Result` per spec case of a run (the ``dstest`` command's).

    Registered by :func:`dstest.cli.main` for one in-process ``pytest.main`` per target; it reads the
    dstest plugin's deviation mark, shows progress on stderr and keeps the results in run order. With
    ``select=False`` it only watches (the ``--dstest-html`` option of any pytest run): it leaves the
    collected items as they are, and under pytest-xdist reads each case from its report (:func:`annotate`).
    """

    def __init__(self, target: str, *, progress: bool = True, listing: bool = False, select: bool = True) -> None:
        self.target = target
        self._third_party: bool | None = None  # known once the run has registered its plug-ins
        self.results: list[Result] = []
        self.cases: dict[str, _Case] = {}
        self.errors: list[str] = []
        self.listing: list[tuple[str | None, str, tuple[int, ...]]] = []
        self.list_only = listing
        self.progress = progress
        self.select = select
        self._partial: dict[str, Result] = {}
        self._details: dict[str, tuple[str, dict[str, str]]] = {}
        self._done = 0
        self._progress: Progress | None = None

    @property
    def third_party(self) -> bool:
        if self._third_party is None:
            self._third_party = is_third_party(self.target)
        return self._third_party

    # -- collection ----------------------------------------------------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        kept = []
        for item in items:
            case = _case_of(item)
            if case is None:
                continue  # only specs are conformance cases
            self.cases[item.nodeid] = case
            kept.append(item)
        if not self.select:
            return
        # contract order (A1, A2, ..., D8), then name, as docs/contracts.md reads; pytest runs them in that order too.
        kept.sort(key=lambda it: (contract_key(self.cases[it.nodeid].contract), self.cases[it.nodeid].spec))
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in self.cases])
        items[:] = kept
        if self.list_only:
            seen: dict[tuple[str | None, str], list[int]] = {}
            for it in kept:
                c = self.cases[it.nodeid]
                label = c.spec + (f"[{c.params}]" if c.params else "")
                sizes = seen.setdefault((c.contract, label), [])
                if c.world_size not in sizes:
                    sizes.append(c.world_size)
            self.listing = [(contract, label, tuple(sizes)) for (contract, label), sizes in seen.items()]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"collecting {report.nodeid or 'the specs'} failed:\n{report.longreprtext}")

    # -- outcomes ------------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        case = self.cases.get(report.nodeid)
        if case is None:
            sent = _property(report, CASE_PROPERTY)
            if sent is None:
                return
            case = self.cases[report.nodeid] = _Case(**sent)
        result = self._partial.get(report.nodeid)
        if result is None:
            result = Result(
                spec=case.spec, contract=case.contract, params=case.params, target=self.target, world=case.world,
                world_size=case.world_size, status="pass", seconds=0.0,
            )  # fmt: skip
            self._partial[report.nodeid] = result
        result.seconds += report.duration
        if report.skipped and result.status == "pass":
            result.status, result.detail = "skip", _skip_detail(report)
        elif report.failed and result.status in ("pass", "skip"):
            result.status = DEVIATION if is_deviation(report) else "fail"
            result.detail, result.ranks = self._failure_detail(report)
            if report.when != "call":
                result.detail = f"in {report.when}: {result.detail}"
        if report.when == "teardown":
            self.results.append(self._partial.pop(report.nodeid))
            self._done += 1
            self._show_progress(result.status)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Keep the one-line detail and every rank's traceback of a failing case (for the table and JSON)."""
        report = yield
        if call.excinfo is not None and report.failed and item.nodeid in self.cases:
            _, detail, ranks = classify(call.excinfo.value, self.third_party)
            self._details[item.nodeid] = (detail, ranks)
        return report

    def _failure_detail(self, report: pytest.TestReport) -> tuple[str, dict[str, str]]:
        found = self._details.pop(report.nodeid, None)
        if found is not None:
            return found
        sent = _property(report, FAILURE_PROPERTY)
        if sent is not None:
            return str(sent[0]), {str(rank): str(text) for rank, text in sent[1].items()}
        text = report.longreprtext.strip()
        lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
        return (lines[0] if lines else (text.splitlines() or ["failed"])[-1]), {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.progress:  # stderr is the terminal's here and after each case, a capture while specs run
            from dstest.report.progress import for_stream

            self._progress = for_stream(sys.stderr, self.target)
            self._progress.start(len(self.cases))

    def _show_progress(self, status: str) -> None:
        if self._progress is not None:
            self._progress.advance(status, self._done)
            if self._done == len(self.cases):
                self._progress.close()

    def pytest_sessionfinish(self) -> None:
        """A stopped run's bar stays where it was (an interrupted run never reaches its last case)."""
        if self._progress is not None:
            self._progress.close()


def counts(results: Sequence[Result]) -> dict[str, int]:
    """How many results have each status: ``{"pass": n, "fail": n, "deviation": n, "skip": n}``."""
    return {s: sum(r.status == s for r in results) for s in SYMBOL}


def summary(results: Sequence[Result], seconds: float) -> str:
    """The count line and one line per failure or deviation (the whole text is in --json/--junit)."""
    n = counts(results)
    lines = [
        f"\n{n['pass']} passed, {n['fail']} failed, {n[DEVIATION]} deviations, {n['skip']} skipped in {seconds:.1f}s"
    ]
    for r in results:
        if r.status in ("fail", DEVIATION):
            detail = r.detail if len(r.detail) <= 160 else r.detail[:157] + "..."
            lines.append(
                f"  {SYMBOL[r.status]:<4} {r.target} {r.contract or ''} {r.spec}[{r.params}] ws{r.world_size}: {detail}"
            )
    return "\n".join(lines)
