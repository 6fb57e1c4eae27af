"""Counts and bytes per collective and group for assertions (contract G2): ``ctx.comm`` in every world.

Every expected value here is computed by hand from the shapes the body passes (what each collective
counts is the table in :mod:`dstest.trace`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import InvalidArgument, InvalidSpec, RankFailure
from dstest.worlds import torch_internals
from dstest.worlds.fake import FakeWorld
from dstest.worlds.request import RunRequest

pytestmark = pytest.mark.cpu

def _has_list_all_to_all(world: str) -> bool:
    """torch 2.11's gloo has no list all_to_all: the process world leaves it out there."""
    return world != "process" or torch_internals.gloo_has_list_all_to_all()


def _every_collective(ctx: Any) -> dict[str, Any]:
    """One call of each collective; returns what ctx.comm counted, per op."""
    W, r = ctx.world_size, ctx.rank
    with ctx.comm.window() as w:
        dist.all_reduce(torch.ones(5))  # 5 float32
        dist.broadcast(torch.ones(3, 2, dtype=torch.float64), src=0)  # 6 float64
        dist.reduce(torch.ones(7, dtype=torch.int32), dst=W - 1)  # 7 int32
        out = torch.empty(W * 4, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.ones(4, dtype=torch.bfloat16))  # W*4 bf16
        dist.all_gather([torch.empty(2) for _ in range(W)], torch.ones(2))  # W*2 float32
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * W))  # W*3 float32
        dist.reduce_scatter(torch.empty(1), [torch.ones(1) for _ in range(W)])  # W*1
        dist.all_to_all_single(torch.empty(2 * W), torch.ones(2 * W))  # 2W
        if _has_list_all_to_all(ctx.world):
            dist.all_to_all([torch.empty(1) for _ in range(W)], [torch.ones(1) for _ in range(W)])  # W
        dist.gather(torch.ones(2), [torch.empty(2) for _ in range(W)] if r == 0 else None, dst=0)  # W*2
        dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(W)] if r == 0 else None, src=0)  # W*3
        dist.barrier()
        if W > 1:
            if r == 0:
                dist.send(torch.ones(9, dtype=torch.int64), dst=1)  # 9 int64
            elif r == 1:
                dist.recv(torch.empty(9, dtype=torch.int64), src=0)
    return {
        "counts": w.counts(),
        "numel": {op: w.numel(op) for op in w.counts()},
        "bytes": {op: w.bytes(op) for op in w.counts()},
        "total": (w.count(), w.bytes()),
    }


def _expected(W: int, rank: int, world: str) -> dict[str, Any]:
    numel = {
        "all_reduce": 5,
        "broadcast": 6,
        "reduce": 7,
        "all_gather_into_tensor": W * 4,
        "all_gather": W * 2,
        "reduce_scatter_tensor": W * 3,
        "reduce_scatter": W,
        "all_to_all_single": 2 * W,
        "all_to_all": W,
        "gather": W * 2,
        "scatter": W * 3,
        "barrier": 0,
    }
    if not _has_list_all_to_all(world):
        del numel["all_to_all"]
    size = dict.fromkeys(numel, 4) | {"broadcast": 8, "all_gather_into_tensor": 2, "barrier": 0}
    if W > 1 and rank in (0, 1):
        op = "send" if rank == 0 else "recv"
        numel[op], size[op] = 9, 8
    nbytes = {op: numel[op] * size[op] for op in numel}
    return {
        "counts": dict.fromkeys(numel, 1),
        "numel": numel,
        "bytes": nbytes,
        "total": (len(numel), sum(nbytes.values())),
    }


@pytest.mark.parametrize("world", ["threaded", "process", "fake"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_counts_its_hand_computed_bytes(world: str, world_size: int) -> None:
    got = dstest.run(_every_collective, world_size, world=world)
    ranks = range(world_size) if world != "fake" else sorted({0, world_size - 1})
    assert len(got) == len(ranks)
    for rank, result in zip(ranks, got):
        assert result == _expected(world_size, rank, world), f"rank {rank}"


def _groups_and_windows(ctx: Any) -> dict[str, Any]:
    W = ctx.world_size
    evens = dist.new_group(list(range(0, W, 2)))
    dist.all_reduce(torch.ones(10))  # before the window
    with ctx.comm.window() as w:
        dist.all_reduce(torch.ones(3))
        if ctx.rank % 2 == 0:
            dist.all_reduce(torch.ones(6), group=evens)
            dist.all_reduce(torch.ones(6), group=evens)
    return {
        "run": ctx.comm.counts(),
        "window": w.counts(),
        "world_bytes": w.bytes(group=dist.group.WORLD),
        "world_by_label": w.bytes(group="world"),
        "evens_bytes": w.bytes("all_reduce", group=evens) if ctx.rank % 2 == 0 else None,
        "by_group": w.by_group(),
        "calls": [(c.op, c.group, c.numel) for c in w.calls],
    }


@pytest.mark.parametrize("world", ["threaded", "process"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_counts_per_group_and_window(world: str, world_size: int) -> None:
    evens = f"1 {list(range(0, world_size, 2))}"
    for rank, got in enumerate(dstest.run(_groups_and_windows, world_size, world=world)):
        member = rank % 2 == 0
        assert got["run"] == {"all_reduce": 2 + 2 * member}
        assert got["window"] == {"all_reduce": 1 + 2 * member}
        assert got["world_bytes"] == got["world_by_label"] == 12
        want = {"world": {"all_reduce": (1, 12)}} | ({evens: {"all_reduce": (2, 48)}} if member else {})
        assert got["by_group"] == want
        assert got["calls"] == [("all_reduce", "world", 3)] + [("all_reduce", evens, 6)] * 2 * member
        if member:
            assert got["evens_bytes"] == 48


class _Bias(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.sum()


class _Sizes(torch.nn.Sequential):
    """One parameter per module: each module's forward gathers its own (one padded all-gather each)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(*(_Bias(n) for n in sizes))


def _zero3_forward(ctx: Any, sizes: list[int]) -> dict[str, Any]:
    from dstest.conformance._helpers import config

    torch.manual_seed(0)
    engine = ctx.target.initialize(_Sizes(sizes), config(3, "mean"))
    with ctx.comm.window() as fwd:
        engine(torch.ones(2))
    return {"counts": fwd.counts(), "numel": fwd.numel("all_gather_into_tensor")}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero3_forward_gathers_each_parameter_once(world_size: int) -> None:
    """impl's ZeRO-3 forward all-gathers each parameter once: W x P elements for P = ceil(N / W).

    (Several parameters of one module are gathered in one grouped all-gather of W x sum(P), D6; here
    every module owns one.)"""
    W = world_size
    sizes = [1, W - 1 or 1, W + 1, 7, 13]
    for got in dstest.run(_zero3_forward, W, args=(sizes,)):
        assert got["counts"] == {"all_gather_into_tensor": len(sizes)}, got
        assert got["numel"] == sum(W * math.ceil(n / W) for n in sizes), got


def test_fake_world_counts_at_65536_ranks() -> None:
    """Shape-exact accounting with no data: a ZeRO-3-style gather and a gradient reduce-scatter."""
    W, P = 65_536, 3

    def body(ctx: Any) -> dict[str, Any]:
        shard = torch.zeros(P, dtype=torch.bfloat16)
        full = torch.empty(W * P, dtype=torch.bfloat16)
        pair = dist.new_group([0, W - 1])
        with ctx.comm.window() as w:
            dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(torch.empty(P), torch.zeros(W * P))
            dist.all_reduce(torch.zeros(1), group=pair)
        return {
            "counts": w.counts(),
            "gather": (w.numel("all_gather_into_tensor"), w.bytes("all_gather_into_tensor")),
            "scatter": (w.numel("reduce_scatter_tensor"), w.bytes("reduce_scatter_tensor")),
            "pair": w.bytes(group=pair),
            "groups": sorted(w.by_group()),
        }

    got = FakeWorld().run(RunRequest(body, W))
    assert len(got) == 2  # ranks 0 and 65,535
    for result in got:
        assert result["counts"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1}
        assert result["gather"] == (196_608, 393_216)  # W*P bf16 elements, 2 bytes each
        assert result["scatter"] == (196_608, 786_432)  # W*P float32 elements, 4 bytes each
        assert result["pair"] == 4
        assert result["groups"] == ["1 [0, 65535]", "world"]


def test_long_rank_lists_are_abbreviated_in_group_labels() -> None:
    def body(ctx: Any) -> list[str]:
        g = dist.new_group(list(range(0, ctx.world_size, 2)))
        if ctx.rank % 2 == 0:
            dist.all_reduce(torch.zeros(1), group=g)
        return sorted(ctx.comm.by_group())

    assert FakeWorld(ranks=[0]).run(RunRequest(body, 1024)) == [["1 [0, 2, 4, ..., 1022] (512 ranks)"]]


def test_bad_op_name_is_a_clear_error() -> None:
    def body(ctx: Any) -> None:
        ctx.comm.count("allreduce")

    with pytest.raises(RankFailure) as err:
        dstest.run(body, 2)
    assert "op='allreduce' is not a collective or transfer dstest records; allowed: ['all_reduce'" in str(err.value)
    with pytest.raises(RankFailure, match="InvalidArgument"):
        dstest.run(body, 2, world="fake")


def test_recording_gives_counts_from_outside_the_run() -> None:
    def body(ctx: Any) -> None:
        dist.broadcast(torch.ones(2), src=0)
        rest = dist.new_group(list(range(1, ctx.world_size)))
        if ctx.rank > 0:
            dist.all_reduce(torch.ones(3, dtype=torch.float64), group=rest)

    with dstest.recording() as rec:
        dstest.run(body, 3)
        dstest.run(body, 2, world="fake")
    assert [rec.comm(r, run=0).count() for r in range(3)] == [1, 2, 2]
    assert rec.comm(1).bytes() == 2 * 4 + 3 * 8  # the last run (fake): its rank 1 is rank N-1
    assert len(rec.runs) == 2
    with pytest.raises(InvalidArgument, match="no world ran inside the recording block"):
        with dstest.recording() as empty:
            pass
        empty.comm(0)


def test_ctx_comm_without_a_recorder_is_a_clear_error() -> None:
    ctx = dstest.RankContext(rank=0, world_size=1, world="myworld", device=torch.device("cpu"))
    with pytest.raises(InvalidSpec, match=r"ctx\.comm on rank 0 of the 'myworld' world: this world records no"):
        ctx.comm.counts()


def test_collectives_issued_falls_back_to_the_targets_count() -> None:
    """In a world that records nothing (the launched world's plain gloo/NCCL) the bundled specs count
    with the target's own counter of its last step."""
    from types import SimpleNamespace

    from dstest.conformance._helpers import collectives_issued

    target = SimpleNamespace(name="t", supports=lambda feature: True)
    engine = SimpleNamespace(collective_counts=lambda: {"all_reduce": 2})
    ctx = SimpleNamespace(records_comm=False, target=target)
    with collectives_issued(ctx, engine) as issued:
        assert issued == {}
    assert issued == {"all_reduce": 2}

    def body(ctx: Any) -> dict[str, int]:
        with collectives_issued(ctx, None) as issued:
            dist.all_reduce(torch.ones(1))
        return issued

    assert dstest.run(body, 2) == [{"all_reduce": 1}] * 2
