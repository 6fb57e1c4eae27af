"""Desyncs in real stacks end in a ``RankFailure`` naming the pending call: never a crash, a dead worker or
the timeout, and the next run on the same threads or workers passes (contract E13).

A desync is one rank running its training loop differently from its peers: ``k`` more or fewer steps,
skipping the backward of step ``k``, returning at step ``k`` or raising there, at a step ``k >= 1`` (the
first steps of DDP differ from the later ones: bucket rebuilding, static-graph tracing). The stacks are
DDP (bucket sizes, ``no_sync``, ``static_graph``, ``find_unused_parameters``), FSDP2 (reshard after forward,
``set_requires_gradient_sync``), FSDP1, DTensor redistribute, tensor parallel and DCP save/load, written as
their users write them. A sample runs in ``-m cpu``; ``-m soak`` draws hundreds per world.

The crash this guards against: a failed bucket all_reduce handed to DDP's C++ reducer as a future torch
completed *successfully* with the exception as its value (``torch.futures.Future.set_exception``), which
the reducer read as a tensor list; a segfault in ``backward`` whenever the desync came at step 2 or later.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dstest
from dstest.errors import RankFailure

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # FSDP1 and DCP warn about CPU and storage choices
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WORLDS = ["threaded", "process"]
KINDS = ["more", "fewer", "skip_backward", "exit", "raise"]
STACKS = ["ddp", "fsdp2", "fsdp1", "dtensor", "tp", "dcp"]
_PENDING_CALL = re.compile(
    r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast|barrier|all_to_all\w*|gather|scatter|reduce|"
    r"send|recv)\("
)


#: What dstest reports of a desync: a rank finished while peers wait, calls that differ, or a deadlock.
_DESYNC = re.compile(r"finished its function|CollectiveMismatch|[Dd]eadlock")


#: Stacks that find a desync themselves when dstest cannot (the calls match op, group and shapes).
_LIBRARY_DETECTS = {"dcp": "CheckpointException"}


class PlantedError(Exception):
    """What a deviant rank raises in the ``raise`` desync."""


# -- the stacks: each returns ``step(i, backward)`` and whether every step communicates ------------------
def _mlp(seed: int = 0, hidden: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def _ddp(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    if cfg["unused"]:
        model.add_module("unused", nn.Linear(3, 3))  # never in the graph: find_unused_parameters' case
    ddp = DDP(
        model,
        bucket_cap_mb=cfg["bucket_cap_mb"],
        static_graph=cfg["static_graph"],
        find_unused_parameters=cfg["unused"],
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(i: int, backward: bool) -> None:
        quiet = cfg["no_sync"] and i % 2 == 1
        with ddp.no_sync() if quiet else contextlib.nullcontext():
            loss = ddp(torch.ones(2, 4) * (ctx.rank + 1)).sum()
            if backward:
                loss.backward()
        if not quiet:
            opt.step()
            opt.zero_grad()

    return step, not cfg["no_sync"]


def _fsdp2(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=cfg["reshard"])
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg["reshard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int, backward: bool) -> None:
        if cfg["accumulate"]:
            model.set_requires_gradient_sync(i % 2 == 1)  # accumulate on even steps, reduce on odd ones
        loss = model(torch.ones(2, 4) * (ctx.rank + 1)).sum()
        if backward:
            loss.backward()
        if not cfg["accumulate"] or i % 2 == 1:
            opt.step()
            opt.zero_grad()

    return step, True  # the forward all-gathers every step


def _fsdp1(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp = FSDP(_mlp(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)

    def step(i: int, backward: bool) -> None:
        loss = fsdp(torch.ones(2, 4) * (ctx.rank + 1)).sum()
        if backward:
            loss.backward()
        opt.step()
        opt.zero_grad()

    return step, True


def _dtensor(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = torch.arange(float(cfg["rows"] * 3)).reshape(cfg["rows"], 3)  # uneven rows at most sizes

    def step(i: int, backward: bool) -> None:
        x = distribute_tensor(full, mesh, [Shard(0)])
        y = x.redistribute(mesh, [Replicate()])
        if backward:  # the "second half" of a step: back to shards and a reduction
            y.redistribute(mesh, [Shard(1)]).sum().full_tensor()

    return step, True


def _tp(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    # hidden 6: tensor parallel's Rowwise input assumes even shards (from_local), at W = 2 and 3
    model = parallelize_module(_mlp(hidden=6), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int, backward: bool) -> None:
        loss = model(torch.ones(2, 4)).sum()
        if backward:
            loss.backward()
        opt.step()
        opt.zero_grad()

    return step, True


def _dcp(ctx: Any, cfg: dict[str, Any]) -> tuple[Any, bool]:
    import torch.distributed.checkpoint as dcp

    root = cfg["root"]

    def step(i: int, backward: bool) -> None:
        path = os.path.join(root, f"step{i}")
        state = {"w": torch.full((3,), float(i)), "step": i}
        dcp.save(state, checkpoint_id=path)
        if backward:  # the "second half": read it back
            loaded = {"w": torch.zeros(3), "step": -1}
            dcp.load(loaded, checkpoint_id=path)
            assert loaded["step"] == i

    return step, True


_BUILD = {"ddp": _ddp, "fsdp2": _fsdp2, "fsdp1": _fsdp1, "dtensor": _dtensor, "tp": _tp, "dcp": _dcp}


def desync_body(ctx: Any, scenario: dict[str, Any]) -> int:
    """The training loop of ``scenario["stack"]``; rank ``scenario["rank"]`` deviates at step ``k``."""
    step, _ = _BUILD[scenario["stack"]](ctx, scenario["cfg"])
    steps, k, kind = scenario["steps"], scenario["k"], scenario["kind"]
    deviant = ctx.rank == scenario["rank"]
    if deviant and kind == "more":
        steps += scenario["extra"]
    elif deviant and kind == "fewer":
        steps = k
    done = 0
    for i in range(steps):
        if deviant and i == k:
            if kind == "exit":
                return done
            if kind == "raise":
                raise PlantedError(f"rank {ctx.rank} raised at step {i}")
        step(i, backward=not (deviant and kind == "skip_backward" and i == k))
        done += 1
    return done


def healthy_body(ctx: Any) -> float:
    """A step of DDP and an all_reduce: what the next run on the same threads or workers must pass."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_mlp())
    for _ in range(2):
        ddp(torch.ones(2, 4)).sum().backward()
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


# -- scenarios -----------------------------------------------------------------------------------------
def _cfg(draw: Any, stack: str) -> dict[str, Any]:
    if stack == "ddp":
        return {
            "bucket_cap_mb": draw(st.sampled_from([25.0, 1e-4])),  # one bucket, or one per parameter
            "static_graph": draw(st.booleans()),
            "unused": draw(st.booleans()),
            "no_sync": draw(st.booleans()),
        }
    if stack == "fsdp2":
        return {"reshard": draw(st.booleans()), "accumulate": draw(st.booleans())}
    if stack == "dtensor":
        return {"rows": draw(st.integers(1, 9))}
    return {}


@st.composite
def scenarios(draw: Any, stacks: list[str] = STACKS) -> dict[str, Any]:
    stack = draw(st.sampled_from(stacks))
    world_size = draw(st.integers(2, 3))
    steps = draw(st.integers(2, 4))
    return {
        "stack": stack,
        "cfg": _cfg(draw, stack),
        "world_size": world_size,
        "rank": draw(st.integers(0, world_size - 1)),
        "kind": draw(st.sampled_from(KINDS)),
        "steps": steps,
        "k": draw(st.integers(1, steps - 1)),  # k >= 1: not only the first step
        "extra": draw(st.integers(1, 2)),
    }


def check_desync(world: str, scenario: dict[str, Any]) -> None:
    """The scenario fails as a desync must (or passes where no collective differs), then a healthy run passes."""
    scenario = {**scenario, "cfg": dict(scenario["cfg"])}
    with tempfile.TemporaryDirectory() as root:
        scenario["cfg"]["root"] = root
        failure: RankFailure | None = None
        try:
            dstest.run(desync_body, scenario["world_size"], world=world, kwargs={"scenario": scenario}, timeout=60)
        except RankFailure as err:  # anything else (WorkerDied, WorldTimeout, a crash) fails the test
            failure = err
    text = str(failure)
    if scenario["kind"] == "raise":
        assert failure is not None and "PlantedError" in text, text
    elif scenario["kind"] != "skip_backward" and _communicates(scenario):
        # a whole step more or less: the ranks' collective sequences differ in length
        assert failure is not None, f"a desync passed: {scenario}"
        assert _DESYNC.search(text), f"the failure is not the desync's: {text[:3000]}"
        assert _PENDING_CALL.search(text), f"the failure names no pending call: {text[:2000]}"
    elif failure is not None:
        # A skipped backward changes the calls only where the backward communicates (tensor parallel's does
        # not here: its input needs no gradient); where the calls still match, what follows is the stack's own
        # business: DCP's object collectives of equal size match, and DCP finds the plans differ.
        own = _LIBRARY_DETECTS.get(scenario["stack"])
        assert _DESYNC.search(text) or (own is not None and own in text), f"not the desync's failure: {text[:3000]}"
    assert "timed out" not in text and "WorkerDied" not in text, text[:2000]
    # The same threads or warm workers run the next world, and it passes.
    assert dstest.run(healthy_body, scenario["world_size"], world=world) == [float(scenario["world_size"])] * scenario[
        "world_size"
    ]


def _communicates(scenario: dict[str, Any]) -> bool:
    cfg = scenario["cfg"]
    return not (scenario["stack"] == "ddp" and cfg["no_sync"])


# -- the reported reproducer: DDP, a rank one step ahead, from step 2 on ---------------------------------
def ddp_one_step_ahead(ctx: Any, base: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(nn.Linear(4, 2))
    for _ in range(base + ctx.rank):  # rank 1 runs one more step than rank 0
        ddp(torch.ones(2, 4)).sum().backward()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("base", [1, 2, 3])
def test_ddp_rank_one_step_ahead_is_a_rank_failure_three_times_in_a_row(world, base):
    """The ten-line DDP desync (2 vs 3 and 3 vs 4 steps crashed the interpreter): a RankFailure naming the
    pending all_reduce (or the bucket-rebuild broadcast at 1 vs 2), three runs in a row, then a healthy run."""
    for _ in range(3):
        with pytest.raises(RankFailure) as info:
            dstest.run(ddp_one_step_ahead, 2, world=world, kwargs={"base": base})
        text = str(info.value)
        assert "rank 0 finished its function" in text
        assert ("broadcast(" if base == 1 else "all_reduce(") in text
    assert dstest.run(healthy_body, 2, world=world) == [2.0, 2.0]


def test_a_failed_work_future_is_failed_for_cpp_consumers_too():
    """What DDP's reducer reads: a work whose collective failed hands out a future that is failed in C++
    (``wait`` raises), not one completed with the exception as its value."""
    from dstest.worlds import torch_internals

    source, handed_out = torch_internals.linked_future()
    source.set_exception(PlantedError("the peer finished"))
    assert handed_out.done()
    with pytest.raises(RuntimeError, match="PlantedError: the peer finished"):
        handed_out.wait()
    source, handed_out = torch_internals.linked_future()
    source.set_result([torch.ones(2)])
    assert torch.equal(handed_out.wait()[0], torch.ones(2))


# -- the generator --------------------------------------------------------------------------------------
# A fixed sample of every stack and kind in -m cpu (each at a step k >= 1), then hypothesis' draws.
_SAMPLE = [
    {"stack": "ddp", "cfg": {"bucket_cap_mb": 1e-4, "static_graph": True, "unused": False, "no_sync": False},
     "world_size": 3, "rank": 2, "kind": "skip_backward", "steps": 3, "k": 2, "extra": 1},
    {"stack": "ddp", "cfg": {"bucket_cap_mb": 25.0, "static_graph": False, "unused": True, "no_sync": True},
     "world_size": 2, "rank": 0, "kind": "fewer", "steps": 4, "k": 2, "extra": 1},
    {"stack": "fsdp2", "cfg": {"reshard": True, "accumulate": True}, "world_size": 3, "rank": 1,
     "kind": "more", "steps": 2, "k": 1, "extra": 1},
    {"stack": "fsdp2", "cfg": {"reshard": False, "accumulate": False}, "world_size": 2, "rank": 1,
     "kind": "skip_backward", "steps": 3, "k": 1, "extra": 1},
    {"stack": "fsdp1", "cfg": {}, "world_size": 2, "rank": 0, "kind": "exit", "steps": 3, "k": 2, "extra": 1},
    {"stack": "dtensor", "cfg": {"rows": 5}, "world_size": 3, "rank": 0, "kind": "raise", "steps": 3, "k": 1,
     "extra": 1},
    {"stack": "tp", "cfg": {}, "world_size": 2, "rank": 1, "kind": "more", "steps": 2, "k": 1, "extra": 2},
    {"stack": "dcp", "cfg": {}, "world_size": 2, "rank": 1, "kind": "fewer", "steps": 3, "k": 1, "extra": 1},
]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stack", STACKS)
def test_every_stack_runs_clean_without_a_desync(world, stack):
    """The control: each stack's loop, no rank deviating (k past the last step), passes at W = 3."""
    cfg = next(s["cfg"] for s in _SAMPLE if s["stack"] == stack)
    with tempfile.TemporaryDirectory() as root:
        scenario = {"stack": stack, "cfg": {**cfg, "root": root}, "world_size": 3, "rank": 0, "kind": "exit",
                    "steps": 3, "k": 3, "extra": 0}
        assert dstest.run(desync_body, 3, world=world, kwargs={"scenario": scenario}) == [3, 3, 3]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", _SAMPLE, ids=lambda s: f"{s['stack']}-{s['kind']}-k{s['k']}")
def test_desync_sample(world, scenario):
    check_desync(world, scenario)


@pytest.mark.parametrize("world", WORLDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(scenario=scenarios())
def test_desync_drawn(world, scenario):
    check_desync(world, scenario)


@pytest.mark.soak
@pytest.mark.parametrize("world", WORLDS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_desync_soak(world, scenario):
    check_desync(world, scenario)
