"""The conformance run (`dstest`): discovery, table, JSON and JUnit, exit codes, deviation vs failure."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from dstest import cli
from dstest.errors import RankFailure

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
    assert cli._classify(failure, third_party=True)[0] == "deviation"
    assert cli._classify(failure, third_party=False)[0] == "fail"
    crash = RankFailure("1 of 2 ranks failed", {0: "tb"}, {0: KeyError("adapter bug")})
    assert cli._classify(crash, third_party=True)[0] == "fail"


def test_bad_world_sizes_are_a_usage_error():
    with pytest.raises(SystemExit):
        cli.main(["--world-sizes", "0,2"])


def test_dstest_errors_are_never_deviations():
    """A bad input from dstest itself (InvalidArgument is a ValueError) is a failure, not a finding."""
    from dstest.errors import InvalidArgument

    failure = RankFailure("1 of 1 ranks failed", {0: "tb"}, {0: InvalidArgument("world_size=0")})
    assert cli._classify(failure, third_party=True)[0] == "fail"


def test_deviation_survives_pickling():
    """Rank errors cross process boundaries in the process world."""
    import pickle

    from dstest.errors import Deviation

    got = pickle.loads(pickle.dumps(Deviation("B4", 1.0, 3.5, "f times the mean")))
    assert (got.contract, got.expected, got.got, got.explanation) == ("B4", 1.0, 3.5, "f times the mean")


def test_each_target_has_a_default_world():
    assert cli._default_world("impl") == "threaded"
