"""The collective trace (contract G1): Chrome-trace JSON of a run, and each rank's last calls in failure reports."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import RankFailure, WorldTimeout

pytestmark = pytest.mark.cpu

_PHASES = {"X", "M", "b", "e"}
_METADATA = {"process_name", "thread_name", "thread_sort_index"}


def check_chrome_trace(doc: Any) -> list[dict[str, Any]]:
    """Raise AssertionError unless ``doc`` is Chrome-trace JSON as chrome://tracing and Perfetto read it
    (the "JSON Object Format": ``{"traceEvents": [...]}``); returns the events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list), "no traceEvents list"
    events = doc["traceEvents"]
    open_spans: dict[tuple[Any, str], float] = {}
    named_threads: set[tuple[int, int]] = set()
    used_threads: set[tuple[int, int]] = set()
    for ev in events:
        assert isinstance(ev, dict), ev
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        assert ev.get("ph") in _PHASES, ev
        assert type(ev.get("pid")) is int and type(ev.get("tid")) is int, ev
        if "args" in ev:
            assert isinstance(ev["args"], dict), ev
        if ev["ph"] == "M":
            assert ev["name"] in _METADATA, ev
            key = "sort_index" if ev["name"] == "thread_sort_index" else "name"
            assert key in ev["args"], ev
            if ev["name"] == "thread_name":
                assert isinstance(ev["args"]["name"], str)
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert isinstance(ev.get("ts"), (int, float)) and ev["ts"] >= 0, ev
        assert isinstance(ev.get("cat"), str), ev
        used_threads.add((ev["pid"], ev["tid"]))
        if ev["ph"] == "X":
            assert isinstance(ev.get("dur"), (int, float)) and ev["dur"] >= 0, ev
        else:  # async begin / end pairs, matched by (cat, id)
            assert isinstance(ev.get("id"), str), ev
            key = (ev["cat"], ev["id"])
            if ev["ph"] == "b":
                assert key not in open_spans, f"async span {key} begun twice"
                open_spans[key] = ev["ts"]
            else:
                assert key in open_spans, f"async span {key} ends without a begin"
                assert ev["ts"] >= open_spans.pop(key), ev
    assert not open_spans, f"async spans never ended: {sorted(open_spans)}"
    assert used_threads <= named_threads, f"tracks without a name: {sorted(used_threads - named_threads)}"
    # Slices of one track nest or follow each other (what Perfetto's importer requires).
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for ev in events:
        if ev["ph"] == "X":
            by_track.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for track, spans in by_track.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, f"track {track}: slice {start}-{end} overlaps its parent"
            stack.append(end)
    return events


def _mixed(ctx: Any) -> None:
    """Blocking and async collectives and a point-to-point exchange on every rank."""
    t = torch.ones(3)
    dist.all_reduce(t)
    work = dist.all_reduce(torch.ones(5), async_op=True)
    out = torch.empty(2 * ctx.world_size)
    dist.all_gather_into_tensor(out, torch.ones(2))
    work.wait()
    peer = (ctx.rank + 1) % ctx.world_size
    src = (ctx.rank - 1) % ctx.world_size
    recv = torch.empty(4)
    ops = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, recv, src)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()


@pytest.mark.parametrize("world", ["threaded", "process"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_trace_file_is_valid_chrome_trace(tmp_path: Any, world: str, world_size: int) -> None:
    with dstest.recording() as rec:
        dstest.run(_mixed, world_size, world=world)
    path = rec.write(tmp_path / "sub" / "run.json")
    with open(path) as f:
        events = check_chrome_trace(json.load(f))
    tracks = {ev["args"]["name"] for ev in events if ev["name"] == "thread_name"}
    assert tracks == {f"rank {r}" for r in range(world_size)}
    for rank in range(world_size):
        # A call waited right after it was posted is one slice; one waited later a zero-length "post"
        # slice, its flight (b/e) and its wait: the async all_reduce and the isend (the irecv, posted
        # last, is waited first).
        mine = [ev for ev in events if ev["tid"] == rank and ev["ph"] == "X" and not ev["name"].startswith("wait ")]
        flights = [ev["name"] for ev in events if ev["tid"] == rank and ev["ph"] == "b"]
        assert flights == ["all_reduce", "send"], flights
        ops = [ev["name"] for ev in mine]
        assert ops == ["all_reduce", "post all_reduce", "all_gather_into_tensor", "post send", "recv", "barrier"], ops
        gather = next(ev for ev in mine if ev["name"] == "all_gather_into_tensor")
        assert gather["args"]["bytes"] == 2 * world_size * 4 and gather["args"]["group"] == "world"
        assert gather["args"]["call site"].startswith("test_trace.py:"), gather["args"]
        send = next(ev for ev in mine if ev["name"] == "post send")
        assert send["args"]["peer"] == (rank + 1) % world_size and send["args"]["bytes"] == 16


def test_the_schema_check_rejects_broken_traces() -> None:
    good = {"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rank 0"}},
        {"name": "all_reduce", "cat": "collective", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 0, "args": {}},
    ]}  # fmt: skip
    check_chrome_trace(good)
    broken = [
        {"events": []},
        {"traceEvents": [{**good["traceEvents"][1], "dur": -1}]},
        {"traceEvents": [good["traceEvents"][1]]},  # an unnamed track
        {"traceEvents": [*good["traceEvents"], {**good["traceEvents"][1], "ts": 2.0, "dur": 5.0}]},  # overlap
        {"traceEvents": [*good["traceEvents"], {**good["traceEvents"][1], "ph": "b", "id": "1"}]},  # never ends
    ]
    for doc in broken:
        with pytest.raises(AssertionError):
            check_chrome_trace(doc)


def _mismatch(ctx: Any) -> None:
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(3), src=0)
    dist.all_reduce(torch.ones(4 + ctx.rank))  # a different shape on every rank


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_mismatch_report_shows_each_ranks_last_calls(world: str) -> None:
    with pytest.raises(RankFailure) as err:
        dstest.run(_mismatch, 3, world=world)
    text = str(err.value)
    assert "collective mismatch" in text
    timeline = text[text.index("last calls of each rank") :]
    for rank in range(3):
        block = timeline.split(f"  rank {rank}:")[1].split("  rank ")[0]
        lines = [ln for ln in block.splitlines() if ln.strip()]
        assert len(lines) == 3, block
        # (a warm world group keeps counting sequence numbers from run to run)
        assert re.search(r"all_reduce\(float32\[2\], op=sum\) on world seq \d+, 8 B.*: done;", lines[0]), lines[0]
        assert re.search(r"broadcast\(float32\[3\], root=0\) on world seq \d+, 12 B.*: done;", lines[1]), lines[1]
        assert re.search(rf"all_reduce\(float32\[{4 + rank}\], op=sum\) on world seq \d+, {4 * (4 + rank)} B", lines[2])
        assert "done" not in lines[2].split(": ")[-1].split(";")[0], lines[2]  # failed or not completed
        line = _mismatch.__code__.co_firstlineno + 3
        assert f"called at test_trace.py:{line} (_mismatch)" in lines[2], lines[2]


def _deadlock(ctx: Any) -> None:
    dist.all_reduce(torch.ones(1))
    if ctx.rank == 0:
        dist.recv(torch.empty(2), src=1)  # rank 1 never sends: every rank waits for another
    else:
        dist.barrier()


def test_deadlock_report_shows_the_pending_calls() -> None:
    with pytest.raises(RankFailure) as err:
        dstest.run(_deadlock, 2)
    text = str(err.value)
    assert "deadlock" in text and "last calls of each rank" in text
    timeline = text[text.index("last calls of each rank") :]
    assert re.search(r"rank 0:\n.*all_reduce.*: done;.*\n.*recv\(float32\[2\], from rank 1\) on world, 8 B.*failed", timeline)
    assert re.search(r"rank 1:\n.*all_reduce.*: done;.*\n.*barrier\(\) on world seq \d+, 0 B.*failed", timeline)


def _stall(ctx: Any) -> None:
    dist.all_reduce(torch.ones(6))
    if ctx.rank == 1:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # a Python loop: the world's timeout interrupts it
            pass
    dist.all_reduce(torch.ones(6))


def test_timeout_report_shows_the_pending_calls() -> None:
    with pytest.raises(WorldTimeout) as err:
        dstest.run(_stall, 2, timeout=1.0)
    timeline = str(err.value)[str(err.value).index("last calls of each rank") :]
    rank0 = timeline.split("  rank 0:")[1].split("  rank 1:")[0]
    rank1 = timeline.split("  rank 1:")[1]
    # rank 0 waits in its second all_reduce until the timeout aborts it
    assert rank0.count("all_reduce(float32[6]") == 2, rank0
    assert "failed: WorldAborted: world of 2 ranks ran past its timeout" in rank0.strip().splitlines()[1], rank0
    assert rank1.count("all_reduce(float32[6]") == 1, rank1


def test_fake_world_records_its_simulated_ranks(tmp_path: Any) -> None:
    def body(ctx: Any) -> None:
        dist.all_reduce(torch.ones(2))

    with dstest.recording() as rec:
        dstest.run(body, 4096, world="fake")
    events = check_chrome_trace(rec.trace())
    assert {ev["tid"] for ev in events if ev["ph"] == "X"} == {0, 4095}


pytest_plugins = ["pytester"]

_PLUGIN_TESTS = """
import torch, torch.distributed as dist, dstest

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_passes(ctx):
    dist.all_reduce(torch.ones(2))

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_fails(ctx):
    dist.all_reduce(torch.ones(2 + ctx.rank))

def test_plain():
    pass
"""


def test_option_writes_a_trace_per_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_specs=_PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("--dstest-trace=traces", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    files = sorted(f for f in os.listdir(pytester.path / "traces") if f.endswith(".json"))
    # the test id made readable, then a digest of the whole id (G6: no two ids share a file)
    readable = [f[:-16] for f in files]
    assert readable == ["test_specs.py_test_fails_threaded-ws2", "test_specs.py_test_passes_threaded-ws2"]
    assert all(re.fullmatch(r"-[0-9a-f]{10}\.json", f[-16:]) for f in files), files
    # beside each trace, the flight-recorder dumps of its runs (tests/test_flight_recorder.py reads them)
    assert sorted(os.listdir(pytester.path / "traces")) == sorted([*files, *(f[:-5] + ".fr" for f in files)])
    for name in files:
        with open(pytester.path / "traces" / name) as f:
            events = check_chrome_trace(json.load(f))
        assert [ev["name"] for ev in events if ev["ph"] == "X" and ev["tid"] == 0] == ["all_reduce"]
    result.stdout.fnmatch_lines(["*last calls of each rank*", "*dstest trace*", "*traces/test_specs.py_test_fails*"])


def test_a_failing_test_leaves_its_trace_in_the_cache(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_specs=_PLUGIN_TESTS)
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(passed=2, failed=1)
    folder = pytester.path / ".pytest_cache" / "d" / "dstest-traces"
    (name,) = os.listdir(folder)
    assert re.fullmatch(r"test_specs\.py_test_fails_threaded-ws2-[0-9a-f]{10}\.json", name), name


def test_trace_option_refuses_a_file(pytester: pytest.Pytester) -> None:
    pytester.makefile(".txt", notadir="x")
    result = pytester.runpytest_inprocess("--dstest-trace=notadir.txt")
    result.stderr.fnmatch_lines(["*--dstest-trace='notadir.txt': is a file; give a directory*"])
