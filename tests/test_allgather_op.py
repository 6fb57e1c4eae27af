"""The uneven-shard allgather and its compaction op (contract D5, D6).

The native ops (C++ on CPU, one CUDA kernel on GPU) are checked against the pure-torch references on
layouts hypothesis draws; the allgather itself runs on a real gloo group of spawned processes. Tests
that need the built extension take the session fixture ``native_ops``, so the build (about 30 s the
first time, cached on disk afterwards) happens once per session.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impl.ops import (
    AllgatherV,
    ExtensionInfo,
    GroupedAllgatherV,
    allgather_v,
    allgather_v_many,
    compact,
    compact_grouped,
    compact_grouped_reference,
    compact_reference,
    load_extension,
    shard_size,
)
from impl.ops._build import ENV_EXT_DIR, build_key, extension_dir

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Hypothesis: the op calls are fast, the layouts small; no deadline (a cold start may build).
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def native_ops() -> ExtensionInfo:
    """The native ops, built (first time only) and loaded once per session."""
    return load_extension()


def values(n: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """Deterministic, mostly distinct values that every dtype in DTYPES represents exactly."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + 3) % 251).to(dtype=dtype, device=device)


@st.composite
def single_layouts(draw: st.DrawFn) -> tuple[list[int], int, torch.dtype]:
    """(counts, shard size P >= max(counts), dtype) for W = 1..8 ranks, zero-size shards included."""
    world = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(0, 9) | st.integers(0, 300), min_size=world, max_size=world))
    pad = draw(st.sampled_from([0, 0, 1, 3]))
    return counts, max(counts) + pad, draw(st.sampled_from(DTYPES))


@st.composite
def grouped_layouts(draw: st.DrawFn) -> tuple[list[list[int]], list[int], torch.dtype]:
    """(counts_list, shard_sizes, dtype): T = 1..4 tensors over W = 1..6 ranks."""
    world = draw(st.integers(1, 6))
    tensors = draw(st.integers(1, 4))
    counts_list = [draw(st.lists(st.integers(0, 40), min_size=world, max_size=world)) for _ in range(tensors)]
    sizes = [max(c) + draw(st.sampled_from([0, 0, 2])) for c in counts_list]
    return counts_list, sizes, draw(st.sampled_from(DTYPES))


# --------------------------------------------------------------------------------------------------
# The build


@pytest.mark.cpu
def test_extension_loads_once_across_threads(native_ops: ExtensionInfo) -> None:
    """D5: every caller, threads included (threaded worlds), gets the one loaded extension."""
    with ThreadPoolExecutor(4) as pool:
        infos = list(pool.map(lambda _: load_extension(), range(8)))
    assert all(info is native_ops for info in infos)
    if torch.version.cuda is None:
        assert not native_ops.with_cuda  # a CPU build of torch never gets the CUDA sources
    assert native_ops.build_dir.name == build_key(native_ops.with_cuda)


@pytest.mark.cpu
def test_extension_dir_is_keyed_and_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """D5: the build cache is keyed by torch, CUDA and Python versions; DSTEST_EXT_DIR moves it."""
    key = build_key(with_cuda=False)
    assert key.startswith(f"torch-{torch.__version__}-cpu-")
    assert key.endswith(f"-py{sys.version_info.major}{sys.version_info.minor}")
    monkeypatch.setenv(ENV_EXT_DIR, str(tmp_path))
    assert extension_dir(with_cuda=False) == tmp_path / key
    monkeypatch.delenv(ENV_EXT_DIR)
    assert extension_dir(with_cuda=False) == Path.home() / ".cache" / "dstest" / "ext" / key


_HOLDER = """
import sys, time
from pathlib import Path
from impl.ops._build import build_lock
d = Path(sys.argv[1])
with build_lock(d):
    (d / "lock").touch()  # torch's baton, as during a build
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    (d / "lock").unlink()
"""


@pytest.mark.cpu
def test_a_build_killed_mid_way_does_not_block_the_next_and_a_live_one_is_waited_for(tmp_path: Path) -> None:
    """D5: torch's build lock is a plain file a killed build leaves behind; the next build removes it
    (and would otherwise wait forever), while a live build in another process is waited for, not raced."""
    import subprocess
    import time

    from impl.ops._build import build_lock

    def holder(seconds: float) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(tmp_path), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    live = holder(1.0)
    start = time.monotonic()
    with build_lock(tmp_path) as stale:
        waited = time.monotonic() - start
    assert live.wait(10) == 0
    live.stdout.close()  # type: ignore[union-attr]
    assert not stale and waited > 0.5, (stale, waited)

    killed = holder(60.0)
    killed.kill()
    killed.wait(10)
    killed.stdout.close()  # type: ignore[union-attr]
    assert (tmp_path / "lock").exists()
    with build_lock(tmp_path) as stale:
        assert stale and not (tmp_path / "lock").exists()


# --------------------------------------------------------------------------------------------------
# The CPU op against the reference


@pytest.mark.cpu
@FAST
@given(layout=single_layouts(), offset=st.integers(0, 3))
def test_cpu_compact_equals_reference(
    native_ops: ExtensionInfo, layout: tuple[list[int], int, torch.dtype], offset: int
) -> None:
    """D5: the C++ CPU op equals the pure-torch reference on every drawn layout, odd offsets too."""
    counts, p, dtype = layout
    base = values(offset + len(counts) * p, dtype)
    padded = base[offset:]  # a storage offset makes the copies unaligned
    got = compact(padded, counts)
    want = compact_reference(padded, counts)
    assert got.dtype == dtype and got.shape == (sum(counts),)
    assert torch.equal(got, want)
    assert torch.equal(compact(padded, counts, impl="reference"), want)


@pytest.mark.cpu
@FAST
@given(layout=grouped_layouts())
def test_cpu_compact_grouped_equals_reference(
    native_ops: ExtensionInfo, layout: tuple[list[list[int]], list[int], torch.dtype]
) -> None:
    """D6: the grouped op (one launch for all tensors' segments) equals the reference per tensor."""
    counts_list, sizes, dtype = layout
    padded = values(len(counts_list[0]) * sum(sizes), dtype)
    got = compact_grouped(padded, counts_list, sizes)
    want = compact_grouped_reference(padded, counts_list, sizes)
    assert [g.shape for g in got] == [(sum(c),) for c in counts_list]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # The default shard sizes are max(counts) per tensor: the single-gather formula.
    tight = values(len(counts_list[0]) * sum(max(c) for c in counts_list), dtype)
    got_tight = compact_grouped(tight, counts_list)
    want_tight = compact_grouped_reference(tight, counts_list)
    assert all(torch.equal(g, w) for g, w in zip(got_tight, want_tight, strict=True))


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_cpu_compact_large_and_strided(native_ops: ExtensionInfo, dtype: torch.dtype) -> None:
    """D5: shards spanning many 64 KiB pieces (the threaded path) and a non-contiguous input."""
    counts = [300_001, 0, 123_457, 1, 0, 299_999]
    p = max(counts) + 5
    padded = values(len(counts) * p, dtype)
    assert torch.equal(compact(padded, counts), compact_reference(padded, counts))
    strided = values(2 * len(counts) * p, dtype)[::2]
    assert not strided.is_contiguous()
    assert torch.equal(compact(strided, counts), compact_reference(strided, counts))


@pytest.mark.cpu
def test_cpu_compact_out_variant(native_ops: ExtensionInfo) -> None:
    """D6: compact_grouped writes into a given ``out`` and returns views of it."""
    counts_list = [[2, 0, 3], [1, 1, 0]]
    padded = values(3 * 4, torch.float32)
    out = torch.full((7,), -1.0)
    parts = compact_grouped(padded, counts_list, out=out)
    assert all(part.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for part in parts)
    assert torch.equal(torch.cat(parts), torch.cat(compact_grouped_reference(padded, counts_list)))
    assert torch.equal(out, torch.cat(parts))


# --------------------------------------------------------------------------------------------------
# opcheck, fake and meta


def _opcheck_cases() -> list[tuple[str, tuple[object, ...]]]:
    padded = values(4 * 5, torch.float32)
    counts = [5, 0, 2, 3]
    flat = [2, 0, 1, 3, 1, 0]  # two tensors over three ranks: counts [2, 0, 1] and [3, 1, 0]
    return [
        ("compact", (padded, counts)),
        ("compact", (values(7, torch.int64), [7])),
        ("compact", (values(0, torch.float16), [0, 0])),
        ("compact_grouped", (values(3 * 6, torch.bfloat16), flat, [3, 3])),
        ("compact_grouped_out", (values(3 * 6, torch.float32), flat, [3, 3], torch.empty(7))),
    ]


@pytest.mark.cpu
@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(native_ops: ExtensionInfo, case: int) -> None:
    """D5: schema, fake implementation, autograd registration and AOT dispatch pass opcheck."""
    name, args = _opcheck_cases()[case]
    torch.library.opcheck(getattr(torch.ops.dstest_impl, name).default, args)


@pytest.mark.cpu
def test_fake_and_meta_shapes(native_ops: ExtensionInfo) -> None:
    """D5: the fake (meta) implementations give the exact output shape, with no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        padded = torch.empty(4 * 6, dtype=torch.bfloat16)
        out = compact(padded, [6, 0, 1, 5])
        assert out.shape == (12,) and out.dtype == torch.bfloat16
        parts = compact_grouped(padded, [[3, 0], [9, 8]], [3, 9])
        assert [p.shape for p in parts] == [(3,), (17,)]
    meta = torch.empty(3 * 4, device="meta")
    assert torch.ops.dstest_impl.compact(meta, [4, 0, 2]).shape == (6,)
    assert torch.ops.dstest_impl.compact_grouped(meta, [1, 2, 3, 0, 0, 1], [3, 1]).shape == (7,)


# --------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("counts", "numel", "match"),
    [
        ([], 0, r"counts=\[\] must have one entry per rank"),
        ([2, -1], 4, r"counts\[1\]=-1 must be >= 0"),
        ([2, 3], 5, r"padded.numel\(\)=5 must be a multiple of len\(counts\)=2"),
        ([2, 4], 6, r"counts\[1\]=4 exceeds the shard size .* = 3"),
        ([2, True], 4, r"counts\[1\]=True must be an int >= 0, not a bool"),
        ("ab", 4, r"counts='ab' must be a sequence"),
    ],
)
def test_compact_bad_input(counts: Sequence[int], numel: int, match: str) -> None:
    """D5: bad layouts are ValueErrors naming the argument, the value and what is allowed."""
    padded = torch.zeros(numel)
    for impl in ("native", "reference"):
        with pytest.raises(ValueError, match=match):
            compact(padded, counts, impl=impl)


@pytest.mark.cpu
def test_compact_bad_impl() -> None:
    """D5: an unknown impl names the allowed ones."""
    with pytest.raises(ValueError, match=r"impl='cuda' must be one of \['native', 'reference'\]"):
        compact(torch.zeros(2), [1, 1], impl="cuda")  # type: ignore[arg-type]


@pytest.mark.cpu
def test_native_op_checks_name_argument_and_value(native_ops: ExtensionInfo) -> None:
    """D5: the C++ checks (reached when the op is called directly) name the op, argument and value."""
    ops = torch.ops.dstest_impl
    with pytest.raises(RuntimeError, match=r"dstest_impl::compact: .*counts\[1\]=5 .*shard size 3"):
        ops.compact(torch.zeros(9), [2, 5, 1])
    with pytest.raises(RuntimeError, match=r"padded.numel\(\)=9 must be a multiple of len\(counts\)=2"):
        ops.compact(torch.zeros(9), [1, 1])
    with pytest.raises(RuntimeError, match=r"len\(counts\)=3 must be len\(shard_sizes\)=2 times"):
        ops.compact_grouped(torch.zeros(8), [1, 1, 1], [2, 2])
    with pytest.raises(RuntimeError, match=r"shard_sizes\[0\]=-2 must be >= 0"):
        ops.compact_grouped(torch.zeros(8), [1, 1], [-2])
    with pytest.raises(RuntimeError, match=r"out.numel\(\)=3 must equal sum\(counts\)=2"):
        ops.compact_grouped_out(torch.zeros(4), [1, 1], [2], torch.empty(3))
    with pytest.raises(RuntimeError, match=r"out.dtype=Double must equal padded.dtype=Float"):
        ops.compact_grouped_out(torch.zeros(4), [1, 1], [2], torch.empty(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"out must be contiguous"):
        ops.compact_grouped_out(torch.zeros(4), [2, 2], [2], torch.empty(4, 2)[:, 0])


@pytest.mark.cpu
def test_allgather_v_bad_input_without_group() -> None:
    """D5: wrong local size, negative counts and a count list of the wrong length are ValueErrors."""
    with pytest.raises(ValueError, match=r"local.numel\(\)=3 must equal counts\[0\]=2"):
        allgather_v(torch.zeros(3), [2])
    with pytest.raises(ValueError, match=r"counts\[0\]=-2 must be >= 0"):
        allgather_v(torch.zeros(3), [-2])
    with pytest.raises(ValueError, match=r"counts have 2 entries per tensor but group=None has 1 ranks"):
        allgather_v(torch.zeros(3), [3, 1])
    with pytest.raises(ValueError, match=r"out.numel\(\)=2 must equal the total count 3"):
        allgather_v(torch.zeros(3), [3], out=torch.empty(2))
    with pytest.raises(ValueError, match=r"locals\[1\] is torch.float64 on cpu but locals\[0\] is"):
        allgather_v_many([torch.zeros(1), torch.zeros(2, dtype=torch.float64)], [[1], [2]])
    with pytest.raises(ValueError, match=r"counts_list\[1\] has 2 entries but counts_list\[0\] has 1"):
        allgather_v_many([torch.zeros(1), torch.zeros(2)], [[1], [2, 0]])
    with pytest.raises(ValueError, match=r"got 1 local tensors but counts_list describes 2"):
        allgather_v_many([torch.zeros(1)], [[1], [2]])


@pytest.mark.cpu
def test_shard_size() -> None:
    """D5, D6: the padded shard is max(counts), 0 when every shard is empty."""
    assert shard_size([3, 0, 7, 1]) == 7
    assert shard_size([0, 0]) == 0
    assert shard_size([5]) == 5
    with pytest.raises(ValueError, match=r"counts=\[\] must have one entry per rank"):
        shard_size([])


# --------------------------------------------------------------------------------------------------
# The allgather: single rank in-process, several ranks on gloo


@pytest.mark.cpu
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_allgather_v_single_rank(native_ops: ExtensionInfo, impl: str) -> None:
    """D5: W = 1 (group=None, contract A1) issues no collective; zero-size shards and out= work."""
    local = values(6, torch.float32).view(2, 3)
    assert torch.equal(allgather_v(local, [6], impl=impl), local.reshape(-1))  # type: ignore[arg-type]
    assert allgather_v(torch.empty(0), [0]).shape == (0,)
    gathered = allgather_v(torch.ones(3, requires_grad=True), [3])  # parameters gather as data
    assert not gathered.requires_grad and torch.equal(gathered, torch.ones(3))
    out = torch.empty(6)
    result = allgather_v(local.t(), [6], out=out)  # a non-contiguous local
    assert result.data_ptr() == out.data_ptr() and torch.equal(out, local.t().reshape(-1))
    parts = allgather_v_many([local, torch.empty(0), values(1, torch.float32)], [[6], [0], [1]])
    assert [p.shape for p in parts] == [(6,), (0,), (1,)]
    g = AllgatherV([6])
    assert (g.world_size, g.rank, g.shard_size, g.total) == (1, 0, 6, 6)
    g(local)
    assert g.buffer_allocations == 0  # no padded buffers at W = 1: nothing to gather


def _gloo_worker(rank: int, world: int, store_path: str) -> None:
    """One rank of test_allgather_v_gloo; asserts raise in the child and fail the spawn."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        assert group is not None

        def shard(r: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return (torch.arange(n, dtype=torch.int64) + 100 * r + 1).to(dtype)

        # One gather: exact concatenation, zero-size shard on rank 1.
        counts = [5, 0, 7]
        want = torch.cat([shard(r, c) for r, c in enumerate(counts)])
        assert torch.equal(allgather_v(shard(rank, counts[rank]), counts, group), want)
        assert torch.equal(allgather_v(shard(rank, counts[rank]), counts, group, impl="reference"), want)

        # Bad input on every rank raises before any collective (a stray collective would desync the
        # gathers below and fail or time out).
        bad: list[tuple[list[int], int]] = [([5, 0, 7], counts[rank] + 1), ([5, -1, 7], counts[rank])]
        bad.append(([5, 0], counts[rank]))
        for bad_counts, n in bad:
            try:
                allgather_v(shard(rank, n), bad_counts, group)
            except ValueError:
                pass
            else:
                raise AssertionError(f"rank {rank}: no ValueError for counts={bad_counts}, numel={n}")

        # Fixed counts, reused buffers: one allocation per (dtype, device), none after the first.
        g = AllgatherV(counts, group)
        assert (g.world_size, g.rank, g.shard_size, g.total) == (world, rank, 7, 12)
        for step in range(3):
            got = g(shard(rank, counts[rank]) + step)
            assert torch.equal(got, want + step)
        assert g.buffer_allocations == 1
        out = torch.empty(12, dtype=torch.float64)
        assert g(shard(rank, counts[rank], torch.float64), out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out, want.double())
        assert g.buffer_allocations == 2

        # Every shard empty: no collective needed, all ranks agree on that from the counts.
        assert allgather_v(torch.empty(0), [0, 0, 0], group).shape == (0,)

        # D6: several tensors in one gather, non-contiguous and int64 locals.
        counts_list = [[3, 0, 1], [0, 0, 0], [4, 6, 2]]
        locals_ = [
            shard(rank, counts_list[0][rank], torch.int64),
            torch.empty(0, dtype=torch.int64),
            shard(rank, 2 * counts_list[2][rank], torch.int64)[::2],
        ]
        many = GroupedAllgatherV(counts_list, group)
        assert many.shard_sizes == (3, 0, 6)
        for _ in range(2):
            parts = many(locals_)
            want_parts = [
                torch.cat([shard(r, c, torch.int64) for r, c in enumerate(counts_list[0])]),
                torch.empty(0, dtype=torch.int64),
                torch.cat([shard(r, 2 * c, torch.int64)[::2] for r, c in enumerate(counts_list[2])]),
            ]
            assert all(torch.equal(p, w) for p, w in zip(parts, want_parts, strict=True))
        assert many.buffer_allocations == 1
        assert all(
            torch.equal(p, w) for p, w in zip(allgather_v_many(locals_, counts_list, group), want_parts, strict=True)
        )

        # Singleton groups gather nothing; a non-member is told so before any collective.
        singles, _ = dist.new_subgroups(group_size=1)
        assert torch.equal(allgather_v(shard(rank, 2), [2], singles), shard(rank, 2))
        pair = dist.new_group([0, 1])
        if rank < 2:
            got = allgather_v(shard(rank, rank + 1), [1, 2], pair)
            assert torch.equal(got, torch.cat([shard(0, 1), shard(1, 2)]))
        else:
            try:
                allgather_v(shard(rank, 1), [1, 2], pair)
            except ValueError as exc:
                assert "not a member" in str(exc), exc
            else:
                raise AssertionError("non-member rank got no ValueError")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.cpu
def test_allgather_v_gloo(native_ops: ExtensionInfo, tmp_path: Path) -> None:
    """D5, D6: allgather_v over three gloo processes: exact concatenation with a zero-size shard,
    errors before any collective, buffer reuse, grouped gathers, singleton and non-member groups."""
    world = 3
    mp.start_processes(
        _gloo_worker,
        args=(world, str(tmp_path / "store")),
        nprocs=world,
        join=True,
        start_method="spawn",
    )


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA kernel against the reference


def _cuda_check(padded: torch.Tensor, counts_list: list[list[int]], sizes: list[int]) -> None:
    got = compact_grouped(padded, counts_list, sizes)
    want = compact_grouped_reference(padded.cpu(), counts_list, sizes)
    assert all(g.is_cuda for g in got)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


@pytest.mark.gpu
@needs_cuda
@FAST
@given(layout=single_layouts(), offset=st.integers(0, 17), out_offset=st.integers(0, 3))
def test_cuda_compact_equals_reference(
    native_ops: ExtensionInfo,
    layout: tuple[list[int], int, torch.dtype],
    offset: int,
    out_offset: int,
) -> None:
    """D5: the single CUDA kernel equals the reference on every drawn layout, unaligned included."""
    counts, p, dtype = layout
    padded = values(offset + len(counts) * p, dtype, "cuda")[offset:]
    got = compact(padded, counts)
    assert got.is_cuda and torch.equal(got.cpu(), compact_reference(padded.cpu(), counts))
    out = torch.empty(out_offset + sum(counts), dtype=dtype, device="cuda")[out_offset:]
    compact_grouped(padded, [counts], [p], out=out)
    assert torch.equal(out.cpu(), compact_reference(padded.cpu(), counts))


@pytest.mark.gpu
@needs_cuda
@FAST
@given(layout=grouped_layouts())
def test_cuda_compact_grouped_equals_reference(
    native_ops: ExtensionInfo, layout: tuple[list[list[int]], list[int], torch.dtype]
) -> None:
    """D6: the grouped CUDA launch equals the reference per tensor."""
    counts_list, sizes, dtype = layout
    _cuda_check(values(len(counts_list[0]) * sum(sizes), dtype, "cuda"), counts_list, sizes)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_cuda_large_and_many_segments(native_ops: ExtensionInfo, dtype: torch.dtype) -> None:
    """D5, D6: multi-chunk shards, and more segments than fit in the kernel parameters (128)."""
    counts = [3_000_001, 0, 1_234_567, 1, 0, 2_999_999, 17, 65_536]
    _cuda_check(values(len(counts) * max(counts), dtype, "cuda"), [counts], [max(counts)])
    many = [[(r * 37 + t * 11) % 23 for r in range(64)] for t in range(5)]  # 320 segments
    sizes = [max(c) for c in many]
    _cuda_check(values(64 * sum(sizes), dtype, "cuda"), many, sizes)


@pytest.mark.gpu
@needs_cuda
def test_cuda_one_kernel_launch(native_ops: ExtensionInfo) -> None:
    """D5: one compaction is exactly one kernel launch on the current stream, nothing else."""
    from torch.profiler import ProfilerActivity, profile

    counts_list = [[1000, 0, 333, 4096], [7, 7, 0, 1]]
    sizes = [4096, 7]
    padded = values(4 * sum(sizes), torch.float32, "cuda")
    out = torch.empty(sum(map(sum, counts_list)), device="cuda")
    flat = [c for counts in counts_list for c in counts]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.dstest_impl.compact_grouped_out(padded, flat, sizes, out)
        torch.cuda.synchronize()
    device_events = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(device_events) == 1 and "compact_kernel" in device_events[0], device_events


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture(native_ops: ExtensionInfo) -> None:
    """D5: the compaction captures into a CUDA graph (segment table by value) and replays right; a
    layout too wide for the kernel parameters is refused under capture instead of replaying stale data."""
    counts_list = [[5, 0, 9], [2, 2, 2]]
    sizes = [9, 2]
    padded = values(3 * 11, torch.float16, "cuda")
    out = torch.empty(20, dtype=torch.float16, device="cuda")
    flat = [c for counts in counts_list for c in counts]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        torch.ops.dstest_impl.compact_grouped_out(padded, flat, sizes, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dstest_impl.compact_grouped_out(padded, flat, sizes, out)
    padded.copy_(values(3 * 11, torch.float16, "cuda").flip(0))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.cat(compact_grouped_reference(padded.cpu(), counts_list, sizes))
    assert torch.equal(out.cpu(), want)

    # Beyond 128 segments the table goes through host memory, which a graph cannot replay: refused.
    wide = values(64 * 2, torch.float16, "cuda")
    wide_out = torch.empty(64, dtype=torch.float16, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        wide_out.zero_()  # keeps the captured graph non-empty
        with pytest.raises(RuntimeError, match=r"192 segments .* cannot be captured in a CUDA graph"):
            torch.ops.dstest_impl.compact_grouped_out(wide, [1] * 64 + [0] * 128, [1, 1, 0], wide_out)


@pytest.mark.gpu
@needs_cuda
def test_cuda_allgather_v_single_rank(native_ops: ExtensionInfo) -> None:
    """D5: W = 1 on CUDA (no collective) and the fake shapes of CUDA inputs."""
    local = values(10, torch.bfloat16, "cuda")
    assert torch.equal(allgather_v(local, [10]), local)
    parts = allgather_v_many([local, local[:3]], [[10], [3]])
    assert torch.equal(torch.cat(parts), torch.cat([local, local[:3]]))
    assert compact(torch.empty(9, device="cuda"), [3, 0, 2]).shape == (5,)
