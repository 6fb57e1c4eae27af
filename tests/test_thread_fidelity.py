"""The threaded world behaves as a world of processes where process-global state would couple rank threads
(contract E14): each case here passes on the threaded world as on the process world, or fails there with
dstest's error naming the cause; none gives a wrong value or a silent pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.errors import RankFailure

pytestmark = pytest.mark.cpu

WORLDS = ["threaded", "process"]


# -- groups a rank asks of gloo by name (Megatron's default for its gloo groups) ----------------------------
def gloo_group_op_mismatch(ctx):
    group = dist.new_group([0, 1], backend="gloo")
    t = torch.tensor([1.0 + ctx.rank, 3.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM if ctx.rank == 0 else dist.ReduceOp.MAX, group=group)
    return t.tolist()


def gloo_group_shape_mismatch(ctx):
    group = dist.new_group([0, 1], backend="gloo")
    dist.all_reduce(torch.ones(2 + ctx.rank), group=group)


def gloo_group_used(ctx):
    group = dist.new_group(list(range(ctx.world_size)), backend="gloo")
    t = torch.full((2,), float(ctx.rank))
    with ctx.comm.window() as w:
        dist.all_reduce(t, group=group)
    return dist.get_backend(group), t.tolist(), w.count("all_reduce", group=group)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("body", [gloo_group_op_mismatch, gloo_group_shape_mismatch])
def test_a_mismatch_on_a_group_made_with_backend_gloo_is_reported(world, body):
    """On the threaded world such a group was real gloo among threads: SUM on one rank and MAX on the other
    passed with both ranks at 3.0, and a size mismatch surfaced as gloo's "Connection closed by peer"."""
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        dstest.run(body, 2, world=world)


@pytest.mark.parametrize("world", WORLDS)
def test_a_group_made_with_backend_gloo_is_checked_recorded_and_still_says_gloo(world):
    got = dstest.run(gloo_group_used, 3, world=world)
    assert got == [("gloo", [3.0, 3.0], 1)] * 3


# -- ReduceOp.PREMUL_SUM, as NCCL runs it -------------------------------------------------------------------
def premul_sums(ctx):
    w, r = ctx.world_size, ctx.rank
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5 * (r + 1)))  # each rank its own factor
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * w) + 1, op=dist._make_nccl_premul_sum(torch.tensor([0.25])))
    return t.tolist(), out.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_premul_sum_scales_each_ranks_input_by_its_own_factor_then_sums(world_size):
    """NCCL's PREMUL_SUM (FSDP2 uses it after set_gradient_divide_factor, torchtitan's default)."""
    w = world_size
    got = dstest.run(premul_sums, w)
    want_t = sum(0.5 * (r + 1) * (r + 1) for r in range(w))
    for r, (t, out) in enumerate(got):
        assert t == [want_t] * 3
        assert out == [0.25 * w * (2 * r + 1), 0.25 * w * (2 * r + 2)]


def test_premul_sum_on_integers_is_refused_naming_the_dtype():
    def body(ctx):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0))

    with pytest.raises(RankFailure, match=r"premul_sum' on dtype=torch.int64: only floating-point"):
        dstest.run(body, 2)


def test_premul_sum_on_the_process_world_is_gloos_own_error_on_every_rank():
    """gloo has no PREMUL_SUM: the process world says so on every rank (and hangs none), as gloo does."""
    with pytest.raises(RankFailure) as info:
        dstest.run(premul_sums, 2, world="process")
    assert sorted(info.value.exceptions) == [0, 1]
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in str(info.value)


def fsdp2_divide_factor(ctx):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    model.set_gradient_divide_factor(3.0)
    model(torch.ones(2, 4) * (ctx.rank + 1)).sum().backward()
    return model.weight.grad.full_tensor()


def test_fsdp2_with_a_gradient_divide_factor_matches_the_reference():
    got = dstest.run(fsdp2_divide_factor, 2)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    sum(ref(torch.ones(2, 4) * (r + 1)).sum() for r in range(2)).backward()
    for g in got:
        torch.testing.assert_close(g, ref.weight.grad / 3.0)


# -- a CUDA mesh on a world without CUDA ---------------------------------------------------------------------
def cuda_mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cuda", (ctx.world_size,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("world", WORLDS)
def test_a_cuda_mesh_without_cuda_is_refused_at_once(world):
    """torch accepts it where no LOCAL_RANK is set (its cross-compilation mode) and fails later in
    fully_shard; a world of launched processes fails in set_device at once, and so do both worlds here."""
    with pytest.raises(RankFailure) as info:
        dstest.run(cuda_mesh, 2, world=world)
    assert sorted(info.value.exceptions) == [0, 1]
    if world == "threaded":
        assert "init_device_mesh(ctx.device.type" in str(info.value)


# -- torch's debug modes register process-wide module hooks ---------------------------------------------------
def comm_debug_mode_on_tensor_parallel(ctx):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    mode = CommDebugMode()
    with mode:
        model(torch.ones(2, 4)).sum().backward()
    counts = {str(op): n for op, n in mode.get_comm_counts().items()}
    return mode.get_total_counts(), counts, sorted(mode.get_parameter_info())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # torch's, on input without grad
@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_debug_mode_counts_each_ranks_own_modules_as_on_the_process_world(world_size):
    """CommDebugMode's module tracker hooks are process-wide in torch: on rank threads each rank's mode saw
    every rank's modules ("Module hierarchy tracking is wrong", KeyError 'Sequential.2')."""
    want = dstest.run(comm_debug_mode_on_tensor_parallel, world_size, world="process")
    for _ in range(3):
        assert dstest.run(comm_debug_mode_on_tensor_parallel, world_size) == want
    assert want[0][0] == 1 and want[0][2] == ["Sequential.0", "Sequential.2"]


def test_a_module_hook_registered_outside_the_world_still_runs_on_every_rank():
    import torch.nn as nn
    from torch.nn.modules.module import register_module_forward_hook

    seen: list[int] = []
    handle = register_module_forward_hook(lambda module, args, out: seen.append(1))
    try:
        dstest.run(lambda ctx: nn.Linear(2, 2)(torch.ones(1, 2)), 3)
    finally:
        handle.remove()
    assert len(seen) == 3
    nn.Linear(2, 2)(torch.ones(1, 2))
    assert len(seen) == 3  # removed


# -- torch's global RNG: one per rank thread, as one per process (more in test_rank_rng.py) -----------------
def seed_once_draw_after_a_collective(ctx):
    torch.manual_seed(0)
    dist.barrier()
    got = torch.randn(4)
    torch.manual_seed(0)  # the reference: what this rank's own process would draw after its seed
    want = torch.randn(4)
    torch.testing.assert_close(got, want)


def seed_the_shared_generator_itself(ctx):
    torch.default_generator.manual_seed(ctx.rank)  # the process-wide object, not torch.manual_seed
    dist.barrier()
    raise AssertionError("an unrelated failure")


def seed_and_draw_then_fail(ctx):
    torch.manual_seed(0)
    got = torch.randn(4)
    dist.barrier()
    assert ctx.rank >= 0 and got.shape == (4,)
    raise AssertionError("an unrelated failure")


def test_seeding_once_and_drawing_after_a_collective_passes_on_threads_as_on_processes():
    """torch's own tests seed once and draw after a collective: rank threads shared one generator, their draws
    interleaved, and this failed with "Tensor-likes are not close!" (issue 42); each rank draws from its own."""
    for world in ("threaded", "process"):
        assert dstest.run(seed_once_draw_after_a_collective, 2, world=world) == [None, None]


def test_a_failure_after_seeding_the_shared_generator_itself_says_so():
    state = torch.default_generator.get_state()
    try:
        with pytest.raises(RankFailure) as info:
            dstest.run(seed_the_shared_generator_itself, 2)
    finally:
        torch.default_generator.set_state(state)
    text = str(info.value)
    assert "an unrelated failure" in text
    assert "torch.default_generator" in text and 'worlds=["process"]' in text


def test_a_failure_with_per_rank_draws_has_no_rng_note():
    with pytest.raises(RankFailure) as info:
        dstest.run(seed_and_draw_then_fail, 2)
    assert "an unrelated failure" in str(info.value) and "default_generator" not in str(info.value)


# -- a library that keeps its groups in module globals (Megatron's parallel_state, in its own pattern) --------
_TENSOR_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size: int) -> None:
    """parallel_state.initialize_model_parallel's pattern: every rank makes every group, keeps its own."""
    global _TENSOR_MODEL_PARALLEL_GROUP
    assert _TENSOR_MODEL_PARALLEL_GROUP is None, "tensor model parallel group is already initialized"
    world, rank = dist.get_world_size(), dist.get_rank()
    for start in range(0, world, tensor_model_parallel_size):
        ranks = list(range(start, start + tensor_model_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def destroy_model_parallel() -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP
    _TENSOR_MODEL_PARALLEL_GROUP = None


def megatron_style_training_setup(ctx):
    try:
        initialize_model_parallel(2)
        t = torch.ones(1)
        dist.all_reduce(t, group=_TENSOR_MODEL_PARALLEL_GROUP)
        return t.item()
    finally:
        destroy_model_parallel()


def test_groups_kept_in_module_globals_fail_naming_the_global_and_the_process_world():
    """On rank threads the second rank finds the first rank's group in the global (Megatron's own "already
    initialized"); the report names the module global that holds a rank's group and says world="process",
    where the same code runs (each process has its own globals)."""
    assert dstest.run(megatron_style_training_setup, 4, world="process") == [2.0] * 4
    with pytest.raises(RankFailure) as info:
        dstest.run(megatron_style_training_setup, 4)
    text = str(info.value)
    # Named either by the global that held a rank's group when dstest looked, or by the failing function of
    # the module that makes the groups (a rank that fails at once may have cleared the global already). Which
    # rank fails first varies: Megatron's own "already initialized", or dstest's refusal of a rank using
    # another rank's group from the global.
    assert "_TENSOR_MODEL_PARALLEL_GROUP (rank " in text or "the rank failed in test_thread_fidelity." in text, text
    assert 'world="process"' in text
    assert "already initialized" in text or "belongs to rank" in text


_MODEL_PARALLEL_GROUPS: list[object] = []
_A_LARGE_TABLE = list(range(100_000))  # a module's data: not a place groups are kept


def groups_kept_in_a_module_list(ctx):
    _A_LARGE_TABLE[-1] = dist.new_group(list(range(ctx.world_size)))  # past the items looked at
    _MODEL_PARALLEL_GROUPS.append(dist.new_group(list(range(ctx.world_size))))
    dist.barrier()
    raise RuntimeError(f"rank {ctx.rank} fails after making its groups")


def test_groups_kept_in_a_module_list_are_named_and_large_tables_are_looked_at_only_in_part():
    """A group in a list of a module's globals is named (the list holds one rank's groups for every rank);
    of a large table only the first items are looked at (thread_shared.LOOK_AT): walking a module's data on
    every rank's every new group costs W x groups x its length."""
    from dstest.worlds.threaded.thread_shared import LOOK_AT

    assert len(_A_LARGE_TABLE) > LOOK_AT
    try:
        with pytest.raises(RankFailure) as info:
            dstest.run(groups_kept_in_a_module_list, 2)
    finally:
        _MODEL_PARALLEL_GROUPS.clear()
        _A_LARGE_TABLE[-1] = len(_A_LARGE_TABLE) - 1
    text = str(info.value)
    assert "test_thread_fidelity._MODEL_PARALLEL_GROUPS (rank " in text, text
    assert "_A_LARGE_TABLE" not in text, text


# -- process-wide tables torch's stacks add to and remove from (found by the audit of torch's caches) ---------
def loss_parallel_cross_entropy(ctx):
    """torch.distributed.tensor.parallel.loss_parallel: its handlers go into DTensor's one dispatcher table
    on entry and come out on exit; the first rank thread to leave took them from the others (a KeyError at
    their exit, or a backward without them: an all_gather the first rank never joined)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 4 * ctx.world_size, generator=g, requires_grad=True)
    target = torch.randint(4 * ctx.world_size, (4,), generator=g)
    dlogits = distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel():
        loss = F.cross_entropy(dlogits, target, reduction="mean")
        loss.backward()
    want = F.cross_entropy(logits.detach(), target, reduction="mean")
    torch.testing.assert_close(loss.full_tensor(), want)
    return loss.full_tensor(), dlogits.grad.to_local()


@pytest.mark.parametrize("world_size", [2, 3])
def test_loss_parallel_on_rank_threads_matches_the_process_world(world_size):
    for _ in range(3):
        dstest.crosscheck(loss_parallel_cross_entropy, world_size, rtol=1e-6, atol=1e-6)


def optimizer_step_hooks(ctx):
    import torch.nn as nn
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {"mine": 0, "others": 0}

    def count(optimizer, args, kwargs):
        seen["mine" if optimizer is opt else "others"] += 1

    handle = register_optimizer_step_post_hook(count)
    dist.barrier()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    dist.barrier()
    handle.remove()
    return seen


def test_a_global_optimizer_hook_a_rank_registers_sees_that_ranks_optimizers_only():
    """register_optimizer_step_post_hook is one table per process (MemTracker uses it): each rank's hook ran
    for every rank's optimizer step, and MemTracker counted other ranks' optimizer states."""
    assert dstest.run(optimizer_step_hooks, 3) == [{"mine": 1, "others": 0}] * 3
    dstest.crosscheck(optimizer_step_hooks, 3)
