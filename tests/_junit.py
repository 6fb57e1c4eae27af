"""Running pytest in a subprocess and reading each test's outcome back, for the tests of the compat plugins
(imported by name: ``tests/`` is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest


def run_with_outcomes(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, list[str]]]:
    """``pytest *args`` in a subprocess with a JUnit XML report; per test name, the tags among ``failure``,
    ``error`` and ``skipped`` its case holds, in their order (empty: it passed; no report: no tests)."""
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(f"--junitxml={junit}", *args, timeout=600)
    outcomes: dict[str, list[str]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcomes[case.get("name", "")] = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
    return result, outcomes
