"""Contract E5 on rank threads: each rank draws from a CPU generator of its own, as each process of a world does.

Rank threads of one process shared torch's one default generator: a body that seeds per rank and draws after a
collective got other numbers than its process would, and torch's own tests failed on values (issue 42). Each
body here is compared with a single-process reference of each rank's stream (the same calls, in one thread, on
torch's own generator), on the threaded world, the process world and the fake world, at several sizes and
steps.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dstest
from dstest.context import rank_seed
from dstest.errors import RankFailure

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]


def _draws(step: int) -> list[list[float]]:
    """One step's draws through every path that reaches the default generator: factories, in-place
    samplers, dropout, nn.init, multinomial, a saved and restored state, fork_rng."""
    out = [
        torch.randn(3).tolist(),
        torch.rand(2, 2).flatten().tolist(),
        torch.randint(0, 100, (4,)).float().tolist(),
        torch.randperm(6).float().tolist(),
        torch.empty(3).normal_(1.0, 2.0).tolist(),
        torch.empty(3).uniform_(-1, 1).tolist(),
        torch.empty(4).bernoulli_(0.5).tolist(),
        torch.empty(2).exponential_().tolist(),
        torch.normal(torch.zeros(2), torch.ones(2)).tolist(),
        F.dropout(torch.ones(8), 0.5).tolist(),
        nn.Linear(3, 2).weight.flatten().tolist(),
        nn.init.kaiming_uniform_(torch.empty(2, 2)).flatten().tolist(),
        torch.multinomial(torch.ones(5), 3).float().tolist(),
        torch.randn_like(torch.zeros(2)).tolist(),
        torch.rand_like(torch.zeros(2)).tolist(),
        torch.randint_like(torch.zeros(3), 0, 50).tolist(),
        torch.randint(5, 60, (3,)).float().tolist(),
    ]
    state = torch.get_rng_state()
    first = torch.rand(2).tolist()
    torch.set_rng_state(state)
    assert torch.rand(2).tolist() == first  # set_rng_state restored this rank's generator
    with torch.random.fork_rng():
        torch.rand(7 + step)  # drawn and forgotten
    out.append(torch.rand(2).tolist())
    return out


def seeded_per_rank_draws_around_collectives(ctx, steps: int):
    """torch's tests' pattern (``torch.manual_seed(42 + self.rank)``), drawing before and after collectives."""
    torch.manual_seed(42 + ctx.rank)
    out = [_draws(-1)]
    for step in range(steps):
        t = torch.ones(2)
        dist.all_reduce(t)
        out.append(_draws(step))
        dist.barrier()
        if step % 2:
            torch.manual_seed(1000 * step + ctx.rank)  # seeding again mid-run
    return out, torch.initial_seed()


def _reference(rank: int, steps: int) -> tuple[list[list[list[float]]], int]:
    """What the rank's own process draws: the same calls in one thread, on torch's own generator."""
    state = torch.get_rng_state()
    try:
        torch.manual_seed(42 + rank)
        out = [_draws(-1)]
        for step in range(steps):
            out.append(_draws(step))
            if step % 2:
                torch.manual_seed(1000 * step + rank)
        return out, torch.initial_seed()
    finally:
        torch.set_rng_state(state)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_draws_its_own_processs_stream(world, world_size, steps):
    got = dstest.run(seeded_per_rank_draws_around_collectives, world_size, world=world, args=(steps,))
    for rank in range(world_size):
        assert got[rank] == _reference(rank, steps), f"rank {rank} drew other numbers than its process"


def seeded_draws_under_a_dispatch_mode(ctx, mode_name: str):
    """The same draws while a dispatch mode watches: ``CommDebugMode`` (as torch's DTensor tests count
    collectives) or a mode that only passes every operator on."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with CommDebugMode() if mode_name == "comm" else Passing():
        return seeded_per_rank_draws_around_collectives(ctx, 2)


@pytest.mark.parametrize("mode_name", ["comm", "passing"])
@pytest.mark.parametrize("world", WORLDS)
def test_draws_under_a_dispatch_mode_are_the_ranks_own(world, mode_name):
    """Inside a mode's handler torch excludes dstest's key: factories that call their generator overload
    from their own kernel (``randn``, ``rand``, ``randint``, ``randperm``, ``*_like``) drew from the
    process-wide generator on rank threads (``torch.randn`` after ``manual_seed(0)`` gave other numbers)."""
    got = dstest.run(seeded_draws_under_a_dispatch_mode, 2, world=world, args=(mode_name,))
    for rank in range(2):
        assert got[rank] == _reference(rank, 2), f"rank {rank} drew other numbers than its process"


def test_the_fake_world_draws_each_ranks_stream_too():
    got = dstest.run(seeded_per_rank_draws_around_collectives, 3, world="fake", args=(2,))  # ranks 0 and 2
    assert got == [_reference(0, 2), _reference(2, 2)]


def unseeded_draws(ctx):
    dist.barrier()
    return torch.randn(4).tolist(), nn.Linear(2, 2).weight.flatten().tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_unseeded_draws_are_the_process_worlds_rank_by_rank(world_size):
    """Both worlds seed a rank's generator with rank_seed(seed, rank) at each run (E5): the same numbers."""
    threaded = dstest.run(unseeded_draws, world_size, seed=7)
    assert threaded == dstest.run(unseeded_draws, world_size, world="process", seed=7)
    assert threaded == dstest.run(unseeded_draws, world_size, seed=7)  # run after run (a warm crew)
    g = torch.Generator().manual_seed(rank_seed(7, 1))
    assert threaded[1][0] == torch.randn(4, generator=g).tolist()
    assert threaded[0] != threaded[1]


def helper_thread_draws(ctx):
    """A thread a rank starts (a data loader's) draws from its rank's generator, as a process's threads do."""
    torch.manual_seed(5 + ctx.rank)
    before = torch.rand(2).tolist()
    box: dict[str, list[float]] = {}
    t = threading.Thread(target=lambda: box.setdefault("x", torch.rand(3).tolist()))
    t.start()
    t.join()
    dist.barrier()
    return before, box["x"], torch.rand(2).tolist()


def test_a_thread_a_rank_starts_shares_the_ranks_generator():
    got = dstest.run(helper_thread_draws, 2)
    for rank in range(2):
        g = torch.Generator().manual_seed(5 + rank)
        want = (torch.rand(2, generator=g).tolist(), torch.rand(3, generator=g).tolist(), torch.rand(2, generator=g))
        assert got[rank] == (want[0], want[1], want[2].tolist())


def explicit_generators(ctx):
    torch.manual_seed(ctx.rank)
    own = torch.Generator().manual_seed(11)
    mine = torch.randn(3, generator=own).tolist()  # the caller's generator is the caller's
    return mine, torch.randn(3).tolist()


def test_a_generator_the_caller_gives_is_used_as_given():
    got = dstest.run(explicit_generators, 2)
    for rank in range(2):
        assert got[rank][0] == torch.randn(3, generator=torch.Generator().manual_seed(11)).tolist()
        assert got[rank][1] == torch.randn(3, generator=torch.Generator().manual_seed(rank)).tolist()


def draws_on_rank_threads(ctx):
    torch.manual_seed(ctx.rank)
    for _ in range(50):
        torch.randn(100)
    dist.barrier()


def test_draws_on_rank_threads_leave_the_process_wide_generator_alone():
    state = torch.default_generator.get_state()
    dstest.run(draws_on_rank_threads, 3)
    assert torch.equal(torch.default_generator.get_state(), state)
    a = torch.randn(3)  # the main thread draws from torch's own generator, as always
    torch.default_generator.set_state(state)
    assert torch.equal(torch.randn(3), a)


def meta_and_autograd(ctx):
    torch.manual_seed(3)
    meta = nn.Linear(4, 4, device="meta")  # nn.init on meta tensors draws nothing
    assert meta.weight.is_meta
    x = torch.ones(2, 4, requires_grad=True)
    y = F.dropout(x, 0.5)
    y.sum().backward()
    return y.detach().tolist(), x.grad.tolist()


def test_meta_tensors_and_dropouts_backward_work_on_rank_threads():
    got = dstest.run(meta_and_autograd, 2)
    torch.manual_seed(3)
    x = torch.ones(2, 4, requires_grad=True)
    state = torch.get_rng_state()
    try:
        y = F.dropout(x, 0.5)
        y.sum().backward()
    finally:
        torch.set_rng_state(state)
    assert got == [(y.detach().tolist(), x.grad.tolist())] * 2


def checkpointed_dropout(ctx):
    """Activation checkpointing saves and restores the RNG state (torch.get_rng_state) to recompute dropout."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(ctx.rank)
    x = torch.ones(4, 8, requires_grad=True)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    dist.barrier()
    out = checkpoint(layer, x, use_reentrant=False)
    dist.barrier()
    out.sum().backward()
    return out.detach().tolist(), x.grad.tolist()


def test_activation_checkpointing_recomputes_each_ranks_dropout():
    got = dstest.run(checkpointed_dropout, 2)
    for rank in range(2):
        torch.manual_seed(rank)
        x = torch.ones(4, 8, requires_grad=True)
        layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
        out = layer(x)
        out.sum().backward()
        assert got[rank] == (out.detach().tolist(), x.grad.tolist())
    torch.manual_seed(torch.Generator().initial_seed())


def seeded_then_failing(ctx):
    torch.manual_seed(ctx.rank)
    dist.barrier()
    assert torch.rand(1).item() < 0, "planted"


def test_a_failing_run_still_leaves_the_next_run_its_fresh_seeds():
    with pytest.raises(RankFailure):
        dstest.run(seeded_then_failing, 2)
    assert dstest.run(unseeded_draws, 2, seed=7) == dstest.run(unseeded_draws, 2, world="process", seed=7)
