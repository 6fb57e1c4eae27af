"""The trace's C records (:mod:`dstest.trace.native`, issue 44 item 3) against the pure-Python ones.

Contracts: G1 (every world records each rank's collectives: group, op, sequence number, shapes, bytes, times,
and where the call was made; failure reports show each rank's last calls) and G2 (exact counts and bytes).
Both implementations must give the same records, field for field: a C record that differs would put a wrong
site, a wrong error text or a wrong time into a report, with nothing else failing. So every field and hook is
compared on random inputs, the call-site walk on random stacks of files that are and are not skipped, and a
whole threaded run's records under each implementation, in fresh interpreters. The fallback (no compiler, a
failed build, ``DSTEST_NATIVE=0``) is tested here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstest.trace import native
from dstest.trace import records as R

pytestmark = pytest.mark.cpu

NATIVE = R.CallRecord if R.CallRecord is not R.PyCallRecord else None
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"the C records are not in use here: {native.status().why}")
IMPLS = [R.PyCallRecord, pytest.param(NATIVE, marks=needs_native, id="native")]
ROOT = Path(__file__).resolve().parents[1]

ops = st.sampled_from(["all_reduce", "send", "recv", "broadcast", "all_gather", "barrier", "sendx", "", "Send"])
ints = st.integers(min_value=-(2**70), max_value=2**70)
small_text = st.text(max_size=12)
shapes = st.lists(st.lists(st.integers(0, 2**40), max_size=4).map(tuple), max_size=5).map(tuple)
args = st.tuples(ints, ops, small_text, st.none() | ints, small_text, shapes, ints, ints)


def _without_times(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("t_")}


def test_the_c_records_are_in_use_where_a_compiler_is() -> None:
    """This machine has a C++ compiler, so the suite runs on the C records (and the fallback tests below run
    the Python ones): a build that silently fell back would leave the C records untested."""
    if native.compiler() is None or os.environ.get(native.ENV_NATIVE, "auto") in ("0", "off"):
        pytest.skip("no C++ compiler here (or DSTEST_NATIVE=0): the Python records are in use")
    assert NATIVE is not None, native.status().why
    assert native.status().native


@needs_native
def test_a_warm_server_watches_the_records_source_not_the_library() -> None:
    """The loaded library names ``records.cpp`` as what it was built from: a warm server's staleness check
    (contract F3) watches the source, so an edit of it makes the next run cold, and a library the cold run
    built just before the server started does not."""
    from dstest.pytest.warm.staleness import BUILT_FROM, imported_files

    library = R._native
    source = str(Path(native.__file__).with_name("records.cpp"))
    assert library is not None and getattr(library, BUILT_FROM) == (source,)
    files = imported_files()
    assert source in files and library.__file__ not in files


@needs_native
@given(args)
@settings(max_examples=300, deadline=None)
def test_a_new_record_has_the_same_fields_in_both(a: tuple[Any, ...]) -> None:
    before = time.perf_counter_ns()
    py, c = R.PyCallRecord(*a), NATIVE(*a)  # type: ignore[misc]
    after = time.perf_counter_ns()
    assert _without_times(c.as_dict()) == _without_times(py.as_dict())
    assert list(c.as_dict()) == list(R.FIELDS)
    for rec in (py, c):
        assert before <= rec.t_post <= after  # one clock: the process world merges records across processes
        assert rec.t_done is None and rec.t_wait is None and rec.t_waited is None
    assert c.kind == ("p2p" if a[1] in ("send", "recv") else "collective")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_record_takes_eight_arguments_or_none(impl: Any) -> None:
    with pytest.raises(TypeError):
        impl(0, "all_reduce")
    empty = impl.from_dict({})
    assert all(v is None for v in empty.as_dict().values())


class _Boom(Exception):
    pass


@needs_native
@given(st.text(max_size=400), st.sampled_from([ValueError, RuntimeError, _Boom, KeyError]), st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_finished_keeps_the_first_error_as_the_python_record_does(message: str, cls: type, second: str) -> None:
    recs = [
        R.PyCallRecord(0, "all_reduce", "world", 1, "float32", ((2,),), 2, 8),
        NATIVE(0, "all_reduce", "world", 1, "float32", ((2,),), 2, 8),
    ]  # type: ignore[misc]
    for rec in recs:
        rec.finished(cls(message))
        first_done = rec.t_done
        rec.finished(RuntimeError(second))  # a later error keeps the first, and the first time
        rec.finished(None)
        assert rec.t_done == first_done
    assert recs[1].error == recs[0].error == R.error_text(cls(message))
    assert len(recs[1].error) <= 200 and "\n" not in recs[1].error


@pytest.mark.parametrize("impl", IMPLS)
def test_the_hooks_set_their_times_once(impl: Any) -> None:
    rec = impl(3, "broadcast", "world", 7, "int64", ((4,),), 4, 32)
    rec.finished(None)
    rec.waiting(None)
    rec.waited()
    first = (rec.t_done, rec.t_wait, rec.t_waited)
    assert None not in first and rec.t_post <= first[0] and first[1] <= first[2]
    rec.finished(None)
    rec.waiting(None)
    rec.waited()
    assert (rec.t_done, rec.t_wait, rec.t_waited) == first
    assert rec.error is None and rec.status() == "done"


class _Log:
    def __init__(self, last: Any) -> None:
        self.last = last


def _wait_from_here(rec: Any, log: Any) -> None:
    rec.waiting(log)  # as Rendezvous.wait calls it: the wait site is this function's caller


@pytest.mark.parametrize("impl", IMPLS)
def test_a_blocking_call_waits_where_it_was_made_and_a_later_wait_names_its_own_site(impl: Any) -> None:
    blocking = impl(0, "all_reduce", "world", 1, "float32", ((1,),), 1, 4)
    blocking.site = ("user.py", 10, "step")
    _wait_from_here(blocking, _Log(blocking))
    assert blocking.sync is True and blocking.wait_site == ("user.py", 10, "step")

    later = impl(0, "all_reduce", "world", 2, "float32", ((1,),), 1, 4)
    later.site = ("user.py", 11, "step")
    line = sys._getframe().f_lineno + 1
    _wait_from_here(later, _Log(blocking))
    assert later.sync is False
    assert later.wait_site == (__file__, line, sys._getframe().f_code.co_name)


# -- the call-site walk -----------------------------------------------------------------------------------
def _chain(skips: list[bool]) -> Any:
    """Functions f0 -> f1 -> ... each in a file of its own (f0 outermost); the innermost returns what both
    walks give at every depth. ``skips[i]``: whether f_i's file is skipped."""
    names = [f"/dstest-fake-site/{i}/mod_{i}.py" for i in range(len(skips))]
    for name, skipped in zip(names, skips):
        R._SKIPPED_FILES[name] = skipped
    env: dict[str, Any] = {"R": R}
    last = len(skips) - 1
    for i in reversed(range(len(skips))):
        body = (
            "    return [(R.py_call_site(d), R.call_site(d)) for d in range(1, depth)]\n"
            if i == last
            else f"    return f{i + 1}(depth)\n"
        )
        code = compile("\n" * i + f"def f{i}(depth):\n" + body, names[i], "exec")
        exec(code, env)
    return env["f0"]


@needs_native
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(2, 16))
@settings(max_examples=200, deadline=None)
def test_the_c_walk_finds_the_site_the_python_walk_finds(skips: list[bool], depth: int) -> None:
    """On stacks of files of every skip pattern and from every start depth (1: the caller, in both), both
    name the same (file, line, function): the first frame not skipped, the test's own at the latest."""
    pairs = _chain(skips)(depth)
    for py_site, c_site in pairs:
        assert c_site == py_site


@needs_native
def test_a_file_the_walk_has_not_seen_is_classified_once_and_stored() -> None:
    name = "/dstest-fake-site/unseen/mod.py"
    R._SKIPPED_FILES.pop(name, None)
    code = compile("def f():\n    return R.call_site(1)\n", name, "exec")
    env: dict[str, Any] = {"R": R}
    exec(code, env)
    assert env["f"]() == (name, 2, "f")
    assert R._SKIPPED_FILES[name] is False


@needs_native
def test_the_c_walk_rejects_a_depth_below_one() -> None:
    with pytest.raises(ValueError, match="depth must be at least 1"):
        R.call_site(0)


@pytest.mark.parametrize("impl", IMPLS)
def test_records_round_trip_through_dicts_and_are_not_tracked_by_the_collector(impl: Any) -> None:
    import gc

    rec = impl(1, "send", "g [0, 1]", None, "float32", ((3, 2),), 6, 24)
    rec.peer, rec.tag, rec.site, rec.callers = 0, 5, ("a.py", 1, "f"), (("b.py", 2, "g"),)
    rec.finished(ValueError("no"))
    back = impl.from_dict(rec.as_dict())
    assert back.as_dict() == rec.as_dict() and back.describe() == rec.describe()
    assert back.issued_at() == rec.issued_at() == "a.py:1 (f) <- b.py:2 (g)"
    if impl is not R.PyCallRecord:
        assert not gc.is_tracked(rec)  # the hundreds of records a run keeps cost the collector nothing


# -- the choice between them, and the fallback ------------------------------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
        check=False,
    )


_WHICH = """
    import warnings, json
    warnings.simplefilter("always")
    from dstest.trace import native, records
    print(json.dumps([records.CallRecord is records.PyCallRecord, native.status().why]))
"""


def test_dstest_native_0_chooses_the_python_records() -> None:
    done = _python(_WHICH, DSTEST_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [True, "DSTEST_NATIVE=0"]


def test_a_bad_dstest_native_value_names_what_is_allowed() -> None:
    done = _python(_WHICH, DSTEST_NATIVE="yes")
    assert done.returncode != 0
    assert "DSTEST_NATIVE='yes': expected auto (the default), 1 (the C records) or 0 (Python's)" in done.stderr


def _fallback(**env: str) -> tuple[str, str]:
    """Which records a fresh interpreter chose under ``env`` (the Python ones, or the test fails), and its stderr.
    The choice is the default one (``auto``) unless ``env`` says otherwise, whatever this session's setting."""
    done = _python(_WHICH, **{"DSTEST_NATIVE": "auto", **env})
    assert done.returncode == 0, done.stderr
    python, why = json.loads(done.stdout)
    assert python, why
    return why, done.stderr


def test_without_a_compiler_the_python_records_are_chosen_and_said_so(tmp_path: Path) -> None:
    why, stderr = _fallback(CXX="/nonexistent/c++", DSTEST_EXT_DIR=str(tmp_path))
    assert "no C++ compiler: /nonexistent/c++ is not on PATH" in why
    assert "RuntimeWarning" not in stderr  # no compiler is an expected setup, not a failure

    required = _python(_WHICH, CXX="/nonexistent/c++", DSTEST_EXT_DIR=str(tmp_path), DSTEST_NATIVE="1")
    assert required.returncode != 0
    assert "DSTEST_NATIVE=1, but the C records could not be built or loaded" in required.stderr


def test_a_failed_build_falls_back_with_a_warning_naming_the_compiler_and_the_directory(tmp_path: Path) -> None:
    why, stderr = _fallback(CXX="false", DSTEST_EXT_DIR=str(tmp_path))
    assert str(tmp_path) in why and "false -O2" in why
    assert "RuntimeWarning" in stderr and "DSTEST_NATIVE=0 silences this" in stderr


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")
def test_a_fresh_cache_builds_once_and_later_processes_load_the_library(tmp_path: Path) -> None:
    first = _python(_WHICH, DSTEST_EXT_DIR=str(tmp_path), DSTEST_NATIVE="1")
    second = _python(_WHICH, DSTEST_EXT_DIR=str(tmp_path), DSTEST_NATIVE="1")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout)[1].startswith(f"built in {tmp_path}")
    assert json.loads(second.stdout)[1].startswith(f"from {tmp_path}")


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")
def test_the_source_compiles_without_a_warning(tmp_path: Path) -> None:
    """Users' builds do not use -Werror (a newer compiler's new warning must not cost them the C records);
    here every warning of -Wall -Wextra is an error."""
    cxx = native.compiler()
    assert cxx is not None
    native._compile(tmp_path, cxx, ("-Wall", "-Wextra", "-Werror"))
    assert native._library(tmp_path).is_file()


# -- a whole run's records under each -----------------------------------------------------------------------
_RUN = """
    import json, torch, torch.distributed as dist
    import dstest
    from dstest.trace import records

    def body(ctx):
        t = torch.ones(3) * (ctx.rank + 1)
        for step in range(3):
            dist.all_reduce(t)
            work = dist.broadcast(t, src=step % ctx.world_size, async_op=True)
            work.wait()
        if ctx.rank == 0:
            dist.send(t, 1)
        elif ctx.rank == 1:
            dist.recv(t, 0)
        sub = dist.new_group([0, 1])
        if ctx.rank < 2:
            dist.all_gather_into_tensor(torch.empty(6), torch.ones(3), group=sub)
        return t.tolist()

    with dstest.recording() as rec:
        values = dstest.run(body, 3, world="threaded")
    (run,) = rec.runs
    out = {"python": records.CallRecord is records.PyCallRecord, "values": values, "ranks": {}}
    for rank, log in sorted(run.logs.items()):
        calls = [{k: v for k, v in r.as_dict().items() if not k.startswith("t_")} for r in log.records]
        times_ordered = all(r.t_post <= (r.t_done or r.t_post) for r in log.records)
        out["ranks"][rank] = {"calls": calls, "times": times_ordered, "totals": sorted(map(list, log.totals.by_key.items()))}
    print(json.dumps(out, default=list))
"""


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")
def test_a_threaded_run_records_the_same_calls_and_sites_under_both() -> None:
    runs = {mode: _python(_RUN, DSTEST_NATIVE=mode) for mode in ("0", "1")}
    for mode, done in runs.items():
        assert done.returncode == 0, f"DSTEST_NATIVE={mode}: {done.stderr[-3000:]}"
    py, c = (json.loads(runs[m].stdout) for m in ("0", "1"))
    assert py["python"] is True and c["python"] is False
    assert py["values"] == c["values"]
    assert c["ranks"] == py["ranks"]
    sites = {tuple(call["site"]) for rank in c["ranks"].values() for call in rank["calls"]}
    assert all(site[0] == "<string>" for site in sites)  # the body's own lines, never dstest's or torch's
    assert all(rank["times"] for rank in c["ranks"].values())
