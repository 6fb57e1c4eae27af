"""The conformance report as one HTML page (`dstest --html`, `--dstest-html`), checked in a real browser.

One `dstest` run against a small third-party target writes the JSON and the HTML of the same results;
its bugs give every outcome: A1 and A2 at W <= 2 pass, A3 deviates (a ValueError whose message holds
`</script>` and markup), A2 at W >= 3 and A4 fail (a KeyError, not a contract failure), A5 skips.

The browser tests drive Debian's Chromium (`apt-get install chromium`) through Playwright (`pip install
playwright`, no browser download): the page loads without a console error, the counts it shows equal
the JSON's, and the filters count what they show. They skip where either is missing, unless
DSTEST_REQUIRE_BROWSER=1 (CI sets it), where they fail instead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstest import cli
from dstest.report import Result
from dstest.report.html import render, reproduce

pytestmark = pytest.mark.cpu

TARGET_MODULE = "dstest_html_report_target"
TARGET_SOURCE = '''
import torch.distributed as dist

EVIDENCE = "one-rank group </script><script>window.injected = 1</script> & <b>bold</b>"


class BuggyTarget:
    """is_parallel with two bugs: a one-rank subgroup raises ValueError (a deviation), a non-member KeyError."""

    name = "buggy"
    third_party = True
    default_world = "threaded"
    config_errors = (ValueError,)

    def supports(self, feature):
        return feature == "is_parallel"

    def is_parallel(self, group):
        if group is None:
            return False
        size = dist.get_world_size(group)
        if size == 1 and dist.get_world_size() > 1:
            raise ValueError(EVIDENCE)
        if size == -1:
            raise KeyError("non-member")
        return size > 1


def pytest_dstest_targets():
    return {"buggy": BuggyTarget}
'''
EVIDENCE = "one-rank group </script><script>window.injected = 1</script> & <b>bold</b>"
SELECTION = "A1 or A2 or A3 or A4 or A5"
OUTCOMES = ("pass", "fail", "deviation", "skip")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One `dstest --json --html` run of the buggy target: the JSON rows and the page's path."""
    folder = tmp_path_factory.mktemp("html")
    (folder / f"{TARGET_MODULE}.py").write_text(TARGET_SOURCE)
    out_json, out_html = folder / "r.json", folder / "r.html"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        code = cli.main(
            [
                "-p",
                TARGET_MODULE,
                "--target",
                "buggy",
                "-k",
                SELECTION,
                "--json",
                str(out_json),
                "--html",
                str(out_html),
            ]
        )
    assert code == 1  # the KeyErrors are failures
    rows = json.loads(out_json.read_text())
    yield {"rows": rows, "html": out_html, "page": out_html.read_text(encoding="utf-8")}


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in rows) for s in OUTCOMES}


# -- the page as text (no browser) -------------------------------------------------------------------------
def test_the_run_has_every_outcome(run: dict[str, Any]) -> None:
    assert all(n > 0 for n in _counts(run["rows"]).values()), _counts(run["rows"])


def test_every_result_is_one_case_of_the_matrix(run: dict[str, Any]) -> None:
    page = run["page"]
    assert len(re.findall(r'<span class="case ', page)) == len(run["rows"])
    for status, n in _counts(run["rows"]).items():
        assert f'<span data-count="{status}">{n}</span>' in page


def test_run_text_is_escaped_and_only_the_pages_own_script_may_run(run: dict[str, Any]) -> None:
    page = run["page"]
    assert EVIDENCE not in page and "&lt;/script&gt;&lt;script&gt;window.injected = 1" in page
    assert page.count("<script>") == 1 and "<b>bold</b>" not in page
    script = page[page.index("<script>") + len("<script>") : page.index("</script>")]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)
    assert policy is not None and f"script-src 'sha256-{digest}'" in policy.group(1)
    assert "default-src 'none'" in policy.group(1)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing is fetched


def test_each_finding_has_its_evidence_and_command(run: dict[str, Any]) -> None:
    import html

    page = run["page"]
    findings = [r for r in run["rows"] if r["status"] in ("fail", "deviation")]
    assert page.count('<article class="finding') == len(findings)
    for r in findings:
        result = Result(**r)
        assert html.escape(reproduce(result, [TARGET_MODULE])) in page
        for text in r["ranks"].values():
            assert html.escape(text) in page


def test_the_reproduce_command_selects_the_case(capsys: pytest.CaptureFixture[str]) -> None:
    """The command shown for a case reruns that case: its spec, parameters, world and world size."""
    case = Result(
        spec="test_b4_sparse_gradients_mean_and_sum", contract="B4", params="0-False-mean-1.0", target="impl",
        world="threaded", world_size=2, status="fail", seconds=0.1,
    )  # fmt: skip
    command = reproduce(case)
    assert command == (
        "dstest --target impl --world threaded --world-sizes 2 -k "
        "'test_b4_sparse_gradients_mean_and_sum and 0-False-mean-1.0'"
    )
    assert cli.main([*shlex.split(command)[1:], "--list"]) == 0
    assert capsys.readouterr().out.split() == [
        "B4",
        "test_b4_sparse_gradients_mean_and_sum[0-False-mean-1.0]",
        "ws=[2]",
    ]
    quoted = Result(**{**case.__dict__, "spec": "test_b1_reduce_op_values", "params": "'MEAN'"})
    assert reproduce(quoted).endswith("-k test_b1_reduce_op_values")  # -k takes no quotes: every parameter


def test_an_html_path_in_a_missing_directory_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere" / "r.html"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--html", str(missing)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"--html={str(missing)!r}" in err and f"the directory {str(missing.parent)!r} does not exist" in err
    with pytest.raises(SystemExit):
        cli.main(["--html", str(tmp_path)])
    assert "is a directory" in capsys.readouterr().err


def test_the_pytest_option_refuses_a_missing_directory(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--dstest-html=nowhere/r.html")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dstest-html='nowhere/r.html': the directory * does not exist*"])


def test_the_pytest_route_writes_the_same_page_under_xdist(pytester: pytest.Pytester) -> None:
    """`pytest -n 1 --dstest-html`: a worker runs the specs, the controller writes every case with its evidence."""
    pytester.makepyfile(**{TARGET_MODULE: TARGET_SOURCE})
    page = pytester.path / "p.html"
    result = pytester.runpytest_subprocess(
        cli.specs_path(), "-p", TARGET_MODULE, "-p", "no:cacheprovider", "-n", "1", "--dstest-target=buggy",
        "--dstest-worlds=threaded", "-k", "A3 or A4", f"--dstest-html={page}",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    result.stdout.fnmatch_lines([f"*dstest HTML report: {page}*"])
    text = page.read_text(encoding="utf-8")
    shown = {s: int(n) for s, n in re.findall(r'<span data-count="(\w+)">(\d+)</span>', text)}
    assert shown == {
        "pass": outcomes.get("passed", 0),
        "fail": outcomes.get("failed", 0),
        "deviation": outcomes.get("deviation", 0),
        "skip": outcomes.get("skipped", 0),
    }
    assert shown["deviation"] > 0 and shown["fail"] > 0
    assert "&lt;/script&gt;" in text and "Traceback" in text  # details and rank tracebacks came from the workers


def test_an_empty_run_renders() -> None:
    page = render([])
    assert "0 of 0 runs shown" in page


# -- in a real browser -------------------------------------------------------------------------------------
def _chromium() -> str | None:
    found = os.environ.get("DSTEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and os.access(found, os.X_OK) else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    required = os.environ.get("DSTEST_REQUIRE_BROWSER") == "1"
    missing = []
    if _chromium() is None:
        missing.append("Chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("Playwright (pip install playwright)")
    if missing:
        reason = f"the browser tests need {' and '.join(missing)}"
        if required:
            pytest.fail(f"{reason}; DSTEST_REQUIRE_BROWSER=1 says they must run here")
        pytest.skip(reason)
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=_chromium())
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def problems() -> list[str]:
    """What went wrong in the tab: console errors, uncaught exceptions, dialogs, requests leaving the page."""
    return []


@pytest.fixture
def page(browser: Any, run: dict[str, Any], problems: list[str]) -> Iterator[Any]:
    """The report open in a fresh tab."""
    tab = browser.new_page()
    tab.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    tab.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
    tab.on("request", lambda req: None if req.url.startswith(("file:", "data:")) else problems.append(req.url))
    tab.goto(run["html"].as_uri())
    tab.wait_for_load_state("load")
    yield tab
    tab.close()


def _shown(tab: Any) -> dict[str, int]:
    """The counts the page shows, per outcome, read from the page as a person reads them."""
    return {s: int(tab.locator(f'[data-count="{s}"]').inner_text()) for s in OUTCOMES}


def _visible_cases(tab: Any) -> list[str]:
    return list(
        tab.locator(".case:not(.off)").evaluate_all(
            "els => els.filter(e => e.offsetParent !== null).map(e => e.dataset.outcome)"
        )
    )


def test_the_page_loads_and_shows_the_json_counts(page: Any, run: dict[str, Any], problems: list[str]) -> None:
    assert problems == []
    rows = run["rows"]
    assert _shown(page) == _counts(rows)
    assert page.locator("#shown").inner_text() == f"{len(rows)} of {len(rows)} runs shown"
    assert sorted(_visible_cases(page)) == sorted(r["status"] for r in rows)
    assert page.evaluate("window.injected") is None  # the evidence's script is text
    deviation = page.locator(".finding.dev").first
    assert EVIDENCE in deviation.locator("pre.detail").inner_text()
    assert deviation.locator("pre.cmd").inner_text().startswith("dstest --target buggy --world threaded --world-sizes ")


def test_filters_count_what_they_show(page: Any, run: dict[str, Any], problems: list[str]) -> None:
    rows = run["rows"]
    page.select_option("select[name=contract]", "A4")
    a4 = [r for r in rows if r["contract"] == "A4"]
    assert _shown(page) == _counts(a4) and sorted(_visible_cases(page)) == sorted(r["status"] for r in a4)
    assert page.locator("#shown").inner_text() == f"{len(a4)} of {len(rows)} runs shown"
    assert page.locator("tr.row:not([hidden])").count() == 1

    page.select_option("select[name=contract]", "")
    for status in ("pass", "fail", "skip"):
        page.uncheck(f"input[name=outcome][value={status}]")
    devs = [r for r in rows if r["status"] == "deviation"]
    assert _shown(page) == _counts(devs) and _visible_cases(page) == ["deviation"] * len(devs)
    assert page.locator(".finding:visible").count() == len(devs)
    assert page.locator(".finding.fail:visible").count() == 0

    page.click("button[type=reset]")
    page.fill("input[name=text]", "KeyError")
    keyed = [r for r in rows if "KeyError" in r["detail"]]
    assert keyed and _shown(page) == _counts(keyed)

    page.fill("input[name=text]", "")
    page.select_option("select[name=target]", "buggy")
    assert _shown(page) == _counts(rows)
    assert problems == []


def test_a_deviation_cell_links_to_its_evidence(page: Any, problems: list[str]) -> None:
    page.locator(".case.dev a").first.click()
    target = page.evaluate("location.hash")
    assert target.startswith("#f") and page.locator(f"{target}.finding.dev").is_visible()
    assert problems == []
