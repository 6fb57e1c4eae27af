"""Flight-recorder dumps (contract G6): a dstest run written in torch's dump format, read by torch's own
loader and by its analyzer (``python -m torch.distributed.flight_recorder.fr_trace``)."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import RankFailure, WorldTimeout
from dstest.trace import FR_PREFIX, write_flight_recorder
from dstest.trace.flight_recorder import _PROFILING_NAMES, analyzer_command, rank_dump, scalar_type
from dstest.trace.flight_recorder import _sizes as nccl_sizes
from dstest.trace.records import CallRecord
from dstest.worlds.core.c10d import COLLECTIVES, RECORDED_OPS
from dstest.worlds.torch_internals import gloo_has_list_all_to_all

pytestmark = pytest.mark.cpu

_NO_ANALYZER = "this torch has no flight-recorder analyzer (torch.distributed.flight_recorder.fr_trace)"


def _analyzer() -> Any:
    """torch's analyzer modules (loader, builder), or skip where this torch ships none."""
    try:
        from torch.distributed.flight_recorder.components import builder, loader
    except ImportError:
        pytest.skip(_NO_ANALYZER)
    return loader, builder


def _analyze(folder: Any) -> str:
    """What ``python -m torch.distributed.flight_recorder.fr_trace <folder> --prefix ...`` prints."""
    _analyzer()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder), "--prefix", FR_PREFIX],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _load(folder: Any) -> dict[int, dict[str, Any]]:
    """Every rank's dump as torch's loader reads it (in this process), by rank."""
    loader, _ = _analyzer()
    details, version = loader.read_dir(argparse.Namespace(trace_dir=str(folder), prefix=FR_PREFIX))
    assert version == "2.10"
    return {d["rank"]: d for d in details.values()}


def _build(folder: Any) -> Any:
    """The analyzer's database of the dumps (its matching of every collective across ranks), in-process."""
    loader, builder = _analyzer()
    args = argparse.Namespace(
        trace_dir=str(folder), prefix=FR_PREFIX, verbose=False, just_print_entries=False,
        allow_incomplete_ranks=False, mismatch_cap=10, selected_ranks=None, pg_filters=None,
        print_stack_trace=False, transform_ft=False, group_world_size=None, output=None,
    )  # fmt: skip
    details, version = loader.read_dir(args)
    return builder.build_db(details, args, version)


# -- desyncs: the analyzer names the collective -------------------------------------------------------
def _extra_all_reduce(ctx: Any) -> None:
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(4))  # rank 0 never joins this one


def _other_collective(ctx: Any) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)  # the same sequence number, another collective


def _failing_run(body: Any, world: str, folder: Any) -> tuple[str, str]:
    """Run ``body`` (it fails) with failure dumps asked for; (the failure report, the dumps' folder)."""
    with dstest.recording(flight_recorder=folder) as rec, pytest.raises(RankFailure) as err:
        dstest.run(body, 2, world=world, timeout=60)
    dumps = os.path.join(str(folder), "run-1")
    report = str(err.value)
    assert f"flight-recorder dumps of this run: {dumps} (read them with: {analyzer_command(dumps)})" in report
    assert sorted(os.listdir(dumps)) == [f"{FR_PREFIX}0", f"{FR_PREFIX}1"]
    assert len(rec.runs) == 1
    return report, dumps


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_analyzer_names_the_collective_a_rank_did_not_join(tmp_path: Any, world: str) -> None:
    _, dumps = _failing_run(_extra_all_reduce, world, tmp_path)
    seq = _load(dumps)[1]["entries"][1]["collective_seq_id"]  # a warm world group keeps counting from run to run
    out = _analyze(dumps)
    assert f"Not all ranks joining collective, sequence number: {seq}" in out, out
    assert "collective: nccl:all_reduce" in out and "missing ranks: {0}" in out, out
    assert "collective state: started" in out, out
    line = _extra_all_reduce.__code__.co_firstlineno + 3
    assert f"_extra_all_reduce at {__file__}:{line}" in out, out


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_analyzer_names_two_collectives_at_one_sequence_number(tmp_path: Any, world: str) -> None:
    _, dumps = _failing_run(_other_collective, world, tmp_path)
    seq = _load(dumps)[0]["entries"][1]["collective_seq_id"]
    out = _analyze(dumps)
    assert f"Collective sequence number: {seq} has errors" in out, out
    assert "collective: nccl:all_reduce" in out, out
    assert (
        "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' "
        "does not match found collective type: 'broadcast'"
    ) in out, out


def _stall(ctx: Any) -> None:
    dist.all_reduce(torch.ones(6))
    if ctx.rank == 1:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # a Python loop: the world's timeout interrupts it
            pass
    dist.all_reduce(torch.ones(6))


def test_a_timeout_writes_the_pending_call_as_started(tmp_path: Any) -> None:
    with dstest.recording(flight_recorder=tmp_path), pytest.raises(WorldTimeout) as err:
        dstest.run(_stall, 2, timeout=1.0)
    dumps = os.path.join(str(tmp_path), "run-1")
    assert f"flight-recorder dumps of this run: {dumps}" in str(err.value)
    rank0 = _load(dumps)[0]["entries"]
    assert [e["state"] for e in rank0] == ["completed", "started"]
    out = _analyze(dumps)
    assert f"Not all ranks joining collective, sequence number: {rank0[1]['collective_seq_id']}" in out, out
    assert "missing ranks: {1}" in out, out


def test_no_dumps_unless_asked_for() -> None:
    with pytest.raises(RankFailure) as err:
        dstest.run(_extra_all_reduce, 2)
    assert "flight-recorder" not in str(err.value)


# -- healthy runs: every collective matched and completed ----------------------------------------------
def _every_op(ctx: Any) -> None:
    w, r = ctx.world_size, ctx.rank
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    dist.reduce(t, dst=0)
    dist.all_gather([torch.empty(3) for _ in range(w)], t)
    dist.all_gather_into_tensor(torch.empty(3 * w), t)
    dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(w)])
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * w))
    dist.all_to_all_single(torch.empty(2 * w), torch.ones(2 * w))
    if ctx.world == "process" and not gloo_has_list_all_to_all():  # torch 2.11's gloo: single only
        dist.all_to_all_single(torch.empty(2 * w), torch.ones(2 * w))
    else:
        dist.all_to_all([torch.empty(2) for _ in range(w)], [torch.ones(2) for _ in range(w)])
    dist.gather(t, [torch.empty(3) for _ in range(w)] if r == 0 else None, dst=0)
    dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(w)] if r == 0 else None, src=0)
    sub = dist.new_group([0, 2])
    if r in (0, 2):
        dist.all_reduce(torch.ones(5, dtype=torch.int64), group=sub)
    dist.barrier()


_PROFILING = [
    "all_reduce", "broadcast", "reduce", "all_gather", "_all_gather_base", "reduce_scatter", "_reduce_scatter_base",
    "all_to_all", "all_to_all", "gather", "scatter", "all_reduce", "all_reduce_barrier",
]  # fmt: skip


@pytest.mark.parametrize("world", ["threaded", "process"])
def test_a_healthy_run_loads_and_every_collective_matches(tmp_path: Any, world: str) -> None:
    with dstest.recording() as rec:
        dstest.run(_every_op, 3, world=world)
    paths = write_flight_recorder(tmp_path, rec.runs[0])
    assert [os.path.basename(p) for p in paths] == [f"{FR_PREFIX}{r}" for r in range(3)]
    dumps = _load(tmp_path)
    assert sorted(dumps) == [0, 1, 2]
    for rank, dump in dumps.items():
        names = [e["profiling_name"] for e in dump["entries"]]
        expected = [f"nccl:{n}" for i, n in enumerate(_PROFILING) if rank != 1 or i != 11]  # 11: the subgroup's
        assert names == expected, names
        assert all(e["state"] == "completed" and e["retired"] for e in dump["entries"])
        assert set(dump["pg_config"]) == ({"0", "1"} if rank != 1 else {"0"})
        assert dump["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}
    db = _build(tmp_path)
    assert len(db.collectives) == len(_PROFILING)
    assert all(c.pass_check and c.collective_state == "completed" and not c.missing_ranks for c in db.collectives)
    assert {g.size for g in db.groups} == {3, 2}
    out = _analyze(tmp_path)
    assert "has errors" not in out and "Not all ranks" not in out, out


def test_entries_hold_the_records(tmp_path: Any) -> None:
    """The fields of an entry, read back through torch's loader, against dstest's own records."""
    with dstest.recording() as rec:
        dstest.run(_every_op, 3)
    run = rec.runs[0]
    write_flight_recorder(tmp_path, run)
    dump = _load(tmp_path)[2]
    records = list(run.logs[2].records)
    assert len(dump["entries"]) == len(records)
    for i, (entry, record) in enumerate(zip(dump["entries"], records)):
        assert entry["record_id"] == i and entry["op_id"] >= 1
        assert entry["collective_seq_id"] == record.seq and entry["p2p_seq_id"] == 0 and entry["is_p2p"] is False
        assert entry["input_dtypes"] == [scalar_type(record.dtype)] * len(entry["input_sizes"])
        assert entry["frames"] == [{"name": "_every_op", "filename": __file__, "line": record.site[1]}]
        assert entry["time_created_ns"] <= entry["time_discovered_started_ns"] <= entry["time_discovered_completed_ns"]
    by_name = {e["profiling_name"]: e for e in dump["entries"]}
    gathered = by_name["nccl:all_gather"]
    assert gathered["input_sizes"] == [[3]] and gathered["output_sizes"] == [[3, 3]]
    assert gathered["input_dtypes"] == ["Float"] and by_name["nccl:_all_gather_base"]["output_sizes"] == [[9]]
    assert by_name["nccl:all_reduce_barrier"]["input_sizes"] == [] and by_name["nccl:all_reduce_barrier"]["input_dtypes"] == []
    sub = [e for e in dump["entries"] if e["process_group"] != ("0", "default_pg")]
    assert len(sub) == 1 and sub[0]["input_dtypes"] == ["Long"] and sub[0]["process_group"][1] == "undefined"
    with open(tmp_path / f"{FR_PREFIX}2", "rb") as f:
        status = pickle.load(f)["pg_status"]["0"]  # not among what the loader passes on
    assert status["last_enqueued_collective"] == status["last_completed_collective"] == records[-1].seq


def _transfers(ctx: Any) -> None:
    t = torch.ones(2)
    dist.all_reduce(t)
    if ctx.rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)


def test_transfers_are_named_as_nccl_names_them(tmp_path: Any) -> None:
    _, builder = _analyzer()
    from torch.distributed.flight_recorder.components.types import Op

    with dstest.recording() as rec:
        dstest.run(_transfers, 2)
    write_flight_recorder(tmp_path, rec.runs[0])
    dumps = _load(tmp_path)
    send, recv = dumps[0]["entries"][1], dumps[1]["entries"][1]
    assert send["profiling_name"] == "nccl:send 0->1" and recv["profiling_name"] == "nccl:recv 1<-0"
    assert (
        send["is_p2p"]
        and send["p2p_seq_id"] == 1
        and send["collective_seq_id"] == dumps[0]["entries"][0]["collective_seq_id"]
    )
    assert send["input_sizes"] == [[2]] and recv["output_sizes"] == [[2]]
    groups = builder.build_groups_memberships({r: d["pg_config"] for r, d in dumps.items()})
    guid = groups[4][("0", 0)]
    op_send, op_recv = Op(send, groups[3], guid), Op(recv, groups[3], guid)
    assert op_send.match(op_recv).state.name == "FULLY_MATCHED"


def test_a_pending_call_is_scheduled_or_started(tmp_path: Any) -> None:
    def body(ctx: Any) -> None:
        dist.all_reduce(torch.ones(1))
        if ctx.rank == 1:
            dist.all_reduce(torch.ones(1), async_op=True)  # posted, never waited
            dist.all_reduce(torch.ones(2))  # waited in, never completes

    with dstest.recording() as rec, pytest.raises(RankFailure):
        dstest.run(body, 2)
    entries = rank_dump(rec.runs[0], 1)["entries"]
    assert [e["state"] for e in entries] == ["completed", "scheduled", "started"]
    assert entries[1]["time_discovered_started_ns"] is None
    assert entries[2]["time_discovered_completed_ns"] is None and entries[2]["duration_ms"] is None


def test_files_are_plain_pickles_of_builtins(tmp_path: Any) -> None:
    """Only dicts, lists, tuples, strings, numbers, bools and None: any reader unpickles them, torch or not."""
    with dstest.recording() as rec:
        dstest.run(_transfers, 2)
    for path in write_flight_recorder(tmp_path, rec.runs[0]):
        with open(path, "rb") as f:
            data = f.read()

        class Builtins(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                raise AssertionError(f"a dump pickles {module}.{name}")

        import io

        assert Builtins(io.BytesIO(data)).load()["version"] == "2.10"


def test_a_prefix_ending_in_a_digit_is_refused(tmp_path: Any) -> None:
    with dstest.recording() as rec:
        dstest.run(_transfers, 2)
    with pytest.raises(ValueError, match="prefix='rank1'"):
        write_flight_recorder(tmp_path, rec.runs[0], prefix="rank1")


# -- the plugin ---------------------------------------------------------------------------------------
pytest_plugins = ["pytester"]

_PLUGIN_TESTS = """
import torch, torch.distributed as dist, dstest

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_passes(ctx):
    dist.all_reduce(torch.ones(2))

@dstest.spec(world_size=[2], worlds=["threaded"])
def test_desync(ctx):
    dist.all_reduce(torch.ones(2))
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(2))
"""


def test_trace_option_writes_dumps_beside_the_trace(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_specs=_PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("--dstest-trace=traces", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    for test in ("test_passes", "test_desync"):  # the test id made readable, then a digest of it
        (dumps,) = (pytester.path / "traces").glob(f"test_specs.py_{test}_threaded-ws2-{'[0-9a-f]' * 10}.fr")
        assert sorted(os.listdir(dumps / "run-1")) == [f"{FR_PREFIX}0", f"{FR_PREFIX}1"]
    result.stdout.fnmatch_lines([
        "*flight-recorder dumps of this run: traces/test_specs.py_test_desync_threaded-ws2-*.fr/run-1*",
        "*traces/test_specs.py_test_desync_threaded-ws2-*.fr/run-1 (flight-recorder dumps; read with: python -m*",
    ])  # fmt: skip


def test_flight_recorder_option_writes_failing_runs_only(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_specs=_PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("--dstest-flight-recorder=fr", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    (name,) = os.listdir(pytester.path / "fr")
    assert name.startswith("test_specs.py_test_desync_threaded-ws2-"), name
    dumps = pytester.path / "fr" / name / "run-1"
    result.stdout.fnmatch_lines(
        [f"*flight-recorder dumps of this run: fr/*/run-1 (read them with: python -m *{FR_PREFIX})"]
    )
    out = _analyze(dumps)
    assert "Not all ranks joining collective" in out and "missing ranks: {0}" in out, out


def test_flight_recorder_option_refuses_a_file(pytester: pytest.Pytester) -> None:
    pytester.makefile(".txt", notadir="x")
    result = pytester.runpytest_inprocess("--dstest-flight-recorder=notadir.txt")
    result.stderr.fnmatch_lines(["*--dstest-flight-recorder='notadir.txt': is a file; give a directory*"])


def test_a_large_fake_world_dumps_only_its_simulated_ranks(tmp_path: Any) -> None:
    def body(ctx: Any) -> None:
        dist.all_reduce(torch.ones(2))

    with dstest.recording() as rec:
        dstest.run(body, 4096, world="fake")
    paths = write_flight_recorder(tmp_path, rec.runs[0])
    assert [os.path.basename(p) for p in paths] == [f"{FR_PREFIX}0", f"{FR_PREFIX}4095"]
    dumps = _load(tmp_path)
    assert dumps[4095]["pg_config"]["0"]["ranks"] == str(list(range(4096)))
    assert [e["profiling_name"] for e in dumps[4095]["entries"]] == ["nccl:all_reduce"]


# Four failing tests whose ids the old file names could not keep apart: two share their first 210 characters
# (a name was the id cut to 200), two differ only in a character the file name replaces (" " and "_" both
# became "_"). Each desyncs on an all_reduce of its own size, so a dump says whose it is.
_LONG_IDS = """
import pytest, torch, torch.distributed as dist, dstest

LONG = "x" * 210

@pytest.mark.parametrize("n", [3, 5, 7, 9], ids=[LONG + "-one", LONG + "-two", "a b", "a_b"])
@dstest.spec(world_size=[2], worlds=["threaded"])
def test_desync(ctx, n):
    dist.all_reduce(torch.ones(n))
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(n))
"""


def _sizes(dumps: Any) -> set[int]:
    """The sizes of the all_reduces a run's dumps hold (each test of ``_LONG_IDS`` has its own)."""
    sizes = set()
    for name in os.listdir(dumps):
        with open(os.path.join(dumps, name), "rb") as f:
            sizes |= {size[0] for entry in pickle.load(f)["entries"] for size in entry["input_sizes"]}
    return sizes


def test_g6_every_test_id_has_its_own_dumps_and_trace(pytester: pytest.Pytester) -> None:
    """Contract G6: two test ids never share a dump directory or a trace file, however long or however
    alike once made a file name; each failure report names the dumps of its own test."""
    pytester.makepyfile(test_specs=_LONG_IDS)
    rec = pytester.inline_run("--dstest-flight-recorder=fr", "--dstest-trace=traces", "-p", "no:cacheprovider")
    failures = rec.getfailures()
    assert len(failures) == 4
    size_of = {"-one]": 3, "-two]": 5, "a b]": 7, "a_b]": 9}
    fr_dirs, trace_files = set(), set()
    for report in failures:
        n = next(size for end, size in size_of.items() if report.nodeid.endswith(end))
        text = report.longreprtext
        fr = next(line for line in text.splitlines() if "flight-recorder dumps of this run: fr/" in line)
        fr_run = fr.split("flight-recorder dumps of this run: ")[1].split(" (read them")[0]
        assert _sizes(pytester.path / fr_run) == {n}, (report.nodeid, fr_run)
        fr_dirs.add(os.path.dirname(fr_run))
        section = dict(report.sections)["Captured dstest trace call"]
        trace, dumps = (line.split(" (")[0] for line in section.splitlines())
        with open(pytester.path / trace, encoding="utf-8") as f:
            assert report.nodeid in f.read(), trace  # the run's label, the track names
        assert _sizes(pytester.path / dumps) == {n}, (report.nodeid, dumps)
        trace_files.add(trace)
        assert len(os.path.basename(trace)) <= 255 and len(os.path.basename(os.path.dirname(fr_run))) <= 255
    assert len(fr_dirs) == 4 and len(trace_files) == 4
    assert len(os.listdir(pytester.path / "fr")) == 4
    assert len([p for p in os.listdir(pytester.path / "traces") if p.endswith(".json")]) == 4


def test_every_op_of_the_c10d_table_has_its_nccl_sizes_and_no_other_op_passes_for_a_barrier() -> None:
    """G6: each op dstest records (the c10d table's collectives and transfers) is written with the sizes NCCL
    records; an op the dump does not know is refused, not written with a barrier's empty sizes; every op
    renamed to NCCL's profiling name is one of the table's."""
    for op in RECORDED_OPS:
        inputs, outputs = nccl_sizes(CallRecord(0, op, "world", 1, "float32", ((4,), (8,)), 4, 16), 2, True)
        assert (inputs, outputs) == ([], []) if op == "barrier" else inputs or outputs, op
    with pytest.raises(ValueError, match="no sizes for op 'allreduce'; the ops dstest records: \\['all_reduce'"):
        nccl_sizes(CallRecord(0, "allreduce", "world", 1, "float32", ((4,),), 4, 16), 2, True)
    assert set(_PROFILING_NAMES) <= set(COLLECTIVES)
