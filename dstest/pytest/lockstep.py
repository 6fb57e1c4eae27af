"""pytest under a launcher (torchrun): every launched rank runs the same items in lockstep, rank 0 reports.

The dstest plugin registers :class:`Lockstep` when the launcher's variables are set
(:func:`dstest.worlds.launched.launch_environment`). Each rank is a whole pytest session; they agree
through the launcher's store (:mod:`dstest.worlds.launched`):

* **Collection.** After collection (and deselection) every rank posts a digest of its item ids; ranks
  that collected different items stop with a usage error naming the ranks and the first items that
  differ, before any item runs.
* **Every phase of every item** (setup, call, teardown) ends with an exchange: each rank posts its
  report, and every rank gives the phase the combined outcome (failed if any rank failed, else skipped
  if any skipped, else passed). So every rank takes the same path through the protocol (a setup that
  failed on one rank skips the call on all) and ``-x`` / ``--maxfail`` stop every rank at the same item.
  Rank 0's report carries every failing rank's traceback and captured output (identical reports, as the
  launched world's own combined failure is, are shown once with the ranks named); its terminal and
  JUnit file show one result per item. Ranks other than 0 print nothing and write no JUnit file.
* **A rank that does not report** a phase within ``--dstest-timeout`` seconds of the others (hung in an
  ordinary test or fixture, where nothing can stop it) is reported on the item and the session stops
  after it, on every rank that waited; rank 0 then exits non-zero, and the launcher stops the rest.
  Spec runs have their own timeout (:class:`dstest.worlds.launched.LaunchedWorld`), which reports a hung
  rank with its stack and lets the session go on.
* **The end.** Every rank exits with rank 0's exit status, after rank 0 has written its report.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

import pytest

from dstest.worlds.launched import Launch, connect

__all__ = ["COLLECT_TIMEOUT_S", "Lockstep"]

#: Seconds the ranks wait for each other to finish collecting (imports of a large suite included).
COLLECT_TIMEOUT_S = 300.0
_OUTCOMES = ("failed", "skipped", "passed")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


class Lockstep:
    """The pytest hooks of one launched rank (registered by the dstest plugin as ``dstest.pytest.lockstep``)."""

    def __init__(self, config: pytest.Config, timeout: float) -> None:
        self.config = config
        self.timeout = timeout
        self.launch: Launch = connect()
        self.index: dict[str, int] = {}
        self.session: pytest.Session | None = None
        self._devnull: Any = None

    # -- start: one reporter -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session
        if self.launch.rank == 0:
            return
        # Quiet before the terminal reporter prints its header; a JUnit file is written by rank 0 only. The
        # reporter stays registered (assertion rewriting asks it for its writer) but writes to devnull:
        # pytest-internal (``TerminalReporter._tw``, pytest 8-9).
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            from _pytest._io import TerminalWriter

            self._devnull = open(os.devnull, "w")
            reporter._tw = TerminalWriter(self._devnull)
        for plugin in self.config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "LogXML" and hasattr(plugin, "logfile"):
                plugin.logfile = os.devnull

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        launch = self.launch
        return [
            f"dstest launched world: {launch.world_size} ranks ({launch.backend}); every rank runs every item, "
            "rank 0 reports"
        ]

    # -- collection ----------------------------------------------------------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        launch = self.launch
        ids = [item.nodeid for item in session.items]
        self.index = {nodeid: i for i, nodeid in enumerate(ids)}
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        launch.post(launch.key("collect", launch.rank), json.dumps({"digest": digest, "ids": ids}).encode())
        keys = [launch.key("collect", r) for r in range(launch.world_size)]
        missing = launch.wait_for(keys, time.monotonic() + COLLECT_TIMEOUT_S)
        if missing:
            ranks = [r for r in range(launch.world_size) if keys[r] in missing]
            raise pytest.UsageError(
                f"dstest launched world: ranks {ranks} did not finish collecting within {COLLECT_TIMEOUT_S:g} s "
                "of this rank (an import that hangs, or a rank that died); every rank must collect the same items"
            )
        posted = {r: json.loads(launch.get(keys[r])) for r in range(launch.world_size)}
        if len({p["digest"] for p in posted.values()}) == 1:
            return
        raise pytest.UsageError(_divergence(posted, launch.rank))

    # -- items ---------------------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        self.launch.begin_item(self.index.get(item.nodeid, -1), item.nodeid)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        self._exchange(item, report)
        return report

    def _exchange(self, item: pytest.Item, report: pytest.TestReport) -> None:
        launch, config = self.launch, self.config
        base = launch.key("report", self.index.get(item.nodeid, -1), report.when) + "/"
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        if report.outcome != "passed":  # counted before the report is posted: a peer that sees it sees the count
            launch.count(base + report.outcome, 1)
        launch.post(base + str(launch.rank), json.dumps(data).encode())
        live = [r for r in range(launch.world_size) if r not in launch.lost]
        keys = {r: base + str(r) for r in live}
        missing_keys = launch.wait_for(list(keys.values()), time.monotonic() + self.timeout)
        silent = [r for r, k in keys.items() if k in missing_keys]
        if not silent and report.outcome == "passed" and not any(
            launch.count(base + outcome) for outcome in ("failed", "skipped")
        ):
            return  # every rank passed: the common case costs one post and one wait
        reports: dict[int, pytest.TestReport] = {}
        for r in live:
            if r == launch.rank or r in silent:
                continue
            got = config.hook.pytest_report_from_serializable(config=config, data=json.loads(launch.get(keys[r])))
            if isinstance(got, pytest.TestReport):
                reports[r] = got
        reports[launch.rank] = report
        _merge(report, reports, launch.rank)
        if silent:
            for r in silent:
                launch.lost[r] = f"rank {r} did not report {item.nodeid} ({report.when})"
            why = (
                f"dstest launched world: ranks {silent} did not report the {report.when} phase of this item within "
                f"{self.timeout:g} s (--dstest-timeout) of rank {launch.rank}: hung outside a spec run, or gone. "
                "The session stops here: the remaining items need every rank"
            )
            report.outcome = "failed"
            report.longrepr = why + ("\n\n" + report.longreprtext if report.longreprtext else "")
            if self.session is not None:
                self.session.shouldstop = why

    # -- end -----------------------------------------------------------------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        launch, session = self.launch, self.session
        done = launch.key("done")
        if session is not None:
            if launch.rank == 0:
                launch.post(done, str(int(session.exitstatus)).encode())
            elif not launch.wait_for([done], time.monotonic() + self.timeout + COLLECT_TIMEOUT_S):
                session.exitstatus = int(launch.get(done).decode())
        # The launched world itself is closed with every other world (the plugin's unconfigure): this
        # object holds the launch until it is dropped.
        if self._devnull is not None:
            self._devnull.close()


def _merge(report: pytest.TestReport, reports: dict[int, pytest.TestReport], rank: int) -> None:
    """Give ``report`` (this rank's) the combined outcome of every rank; on rank 0 also every failure."""
    outcomes = {r: rep.outcome for r, rep in reports.items()}
    combined = next(o for o in _OUTCOMES if o in outcomes.values() or o == "passed")
    failing = sorted(r for r, o in outcomes.items() if o == "failed")
    if combined == "skipped" and report.outcome != "skipped":
        first = min(r for r, o in outcomes.items() if o == "skipped")
        report.longrepr = reports[first].longrepr
    if combined == "failed":
        texts: dict[str, list[int]] = {}
        shown: dict[str, str] = {}
        for r in failing:
            # Object addresses in the arguments pytest shows differ between processes, nothing else does.
            same = _ADDRESS.sub("0x?", reports[r].longreprtext)
            texts.setdefault(same, []).append(r)
            shown.setdefault(same, reports[r].longreprtext)
        if len(texts) == 1 and rank in failing:
            if len(failing) > 1:
                report.sections.append(("dstest launched world", f"ranks {failing} failed with this same report"))
        elif rank == 0:
            parts = []
            for same, ranks in texts.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks} (the same report)"
                parts.append(f"---- {who} ----\n{shown[same]}")
            report.longrepr = f"failed on ranks {failing} of {len(reports)}:\n" + "\n".join(parts)
        else:
            report.longrepr = f"failed on ranks {failing} (rank 0 reports every traceback)"
        for r in failing:
            if r == rank:
                continue
            for title, content in reports[r].sections:
                report.sections.append((f"{title} (rank {r})", content))
    report.outcome = combined  # type: ignore[assignment]


def _divergence(posted: dict[int, dict[str, Any]], rank: int) -> str:
    """The usage error of ranks that collected different items: which ranks, and the first differences."""
    reference = posted[0]["ids"]
    differ = [r for r, p in sorted(posted.items()) if p["digest"] != posted[0]["digest"]]
    lines = [
        f"dstest launched world: the ranks collected different items (rank 0: {len(reference)} items; "
        + ", ".join(f"rank {r}: {len(posted[r]['ids'])}" for r in differ)
        + "); every rank must collect the same items in the same order to run them in lockstep"
    ]
    for r in differ[:3]:
        ids = posted[r]["ids"]
        only_here = [i for i in ids if i not in set(reference)][:3]
        only_zero = [i for i in reference if i not in set(ids)][:3]
        if only_here:
            lines.append(f"  only on rank {r}: {', '.join(only_here)}")
        if only_zero:
            lines.append(f"  missing on rank {r} (on rank 0): {', '.join(only_zero)}")
        if not only_here and not only_zero:
            first = next(i for i, (a, b) in enumerate(zip(reference, ids)) if a != b)
            lines.append(f"  rank {r} runs the same items in another order (first at position {first}: {ids[first]})")
    lines.append(
        "Collect the same tests everywhere: the same files, options and -k/-m on every rank, and no "
        "parametrization that depends on the rank or the host"
    )
    return "\n".join(lines) if rank == 0 else lines[0]
