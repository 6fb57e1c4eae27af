"""The conformance run (`dstest`): discovery, table, JSON and JUnit, exit codes, deviation vs failure."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from dstest import cli
from dstest.errors import RankFailure
from dstest.report import classify

pytestmark = pytest.mark.cpu


def test_run_writes_table_json_and_junit(tmp_path, capsys):
    out_json, out_xml = tmp_path / "r.json", tmp_path / "r.xml"
    code = cli.main(["-k", "A1", "--json", str(out_json), "--junit", str(out_xml)])
    assert code == 0
    text = capsys.readouterr().out
    assert "test_a1_none_is_absent" in text and "passed, 0 failed" in text
    rows = json.loads(out_json.read_text())
    assert rows and all(r["contract"] == "A1" and r["status"] == "pass" for r in rows)
    suite = ET.parse(out_xml).getroot()
    assert int(suite.get("tests")) == len(rows) and suite.get("failures") == "0"


def test_specs_are_listed_in_spec_order(capsys):
    assert cli.main(["--list"]) == 0
    contracts = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    letters = [c[0] for c in contracts]
    assert letters == sorted(letters) and {"A", "B", "C", "D"} <= set(letters)


def test_no_match_is_exit_2(capsys):
    assert cli.main(["-k", "Z99"]) == 2
    assert "no bundled spec matches" in capsys.readouterr().err


def test_failures_on_third_party_targets_are_deviations():
    failure = RankFailure("1 of 2 ranks failed", {0: "tb"}, {0: AssertionError("sum is mean")})
    assert classify(failure, third_party=True)[0] == "deviation"
    assert classify(failure, third_party=False)[0] == "fail"
    crash = RankFailure("1 of 2 ranks failed", {0: "tb"}, {0: KeyError("adapter bug")})
    assert classify(crash, third_party=True)[0] == "fail"


def test_bad_world_sizes_are_a_usage_error():
    with pytest.raises(SystemExit):
        cli.main(["--world-sizes", "0,2"])


def test_dstest_errors_are_never_deviations():
    """A bad input from dstest itself (InvalidArgument is a ValueError) is a failure, not a finding."""
    from dstest.errors import InvalidArgument

    failure = RankFailure("1 of 1 ranks failed", {0: "tb"}, {0: InvalidArgument("world_size=0")})
    assert classify(failure, third_party=True)[0] == "fail"


def test_deviation_survives_pickling():
    """Rank errors cross process boundaries in the process world."""
    import pickle

    from dstest.errors import Deviation

    got = pickle.loads(pickle.dumps(Deviation("B4", 1.0, 3.5, "f times the mean")))
    assert (got.contract, got.expected, got.got, got.explanation) == ("B4", 1.0, 3.5, "f times the mean")


def test_each_target_has_a_default_world():
    assert cli._default_world("impl") == "threaded"
    assert cli._default_world("deepspeed") == "process"  # read from the class: DeepSpeed is not imported


def test_the_cli_only_translates_its_flags_to_pytest():
    args = cli.pytest_args("impl", ["threaded", "fake"], world_sizes=[1, 2], keyword="A1", timeout=30.0)
    assert args[0] == cli.specs_path() and args[0].endswith("conformance")
    assert {
        "--dstest-target=impl",
        "--dstest-worlds=threaded,fake",
        "--dstest-world-sizes=1,2",
        "--dstest-timeout=30.0",
    } <= set(args)
    assert args[args.index("-k") + 1] == "A1"
    assert "--dstest-specs=B*" in cli.pytest_args("impl", ["threaded"], keyword="B*")  # globs keep working


def test_glob_selects_by_contract(capsys):
    assert cli.main(["-k", "A[13]", "--world-sizes", "2", "--list"]) == 0
    contracts = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert contracts == {"A1", "A3"}


def _pytest_counts(pytester: pytest.Pytester, *args: str) -> dict[str, int]:
    result = pytester.runpytest_subprocess(cli.specs_path(), "-p", "no:cacheprovider", *args)
    return result.parseoutcomes()


@pytest.mark.parametrize("target", ["impl", "deepspeed"])
def test_cli_and_pytest_count_the_same(pytester: pytest.Pytester, capsys, target: str, tmp_path) -> None:
    """One route: `dstest` and `pytest --dstest-target=...` give identical pass/fail/deviation/skip counts.

    (DeepSpeed is not installed here: both routes then count its failures the same way, as failures.)
    """
    out = tmp_path / "r.json"
    cli.main(["--target", target, "--world", "threaded", "-k", "A1 or A3", "--json", str(out)])
    capsys.readouterr()
    rows = json.loads(out.read_text())
    mine = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "deviation", "skip")}
    theirs = _pytest_counts(pytester, f"--dstest-target={target}", "--dstest-worlds=threaded", "-k", "A1 or A3")
    assert mine["pass"] == theirs.get("passed", 0)
    assert mine["fail"] == theirs.get("failed", 0)
    assert mine["deviation"] == theirs.get("deviation", 0)
    assert mine["skip"] == theirs.get("skipped", 0)
    assert sum(mine.values()) == 6  # A1 at ws 1-3, A3 at ws 1-3
