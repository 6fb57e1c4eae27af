"""The differential check (contract E14): the same real-stack bodies on the threaded and on the process world
give the same per-rank results and the same collective trace, at W = 2, 3, 4 with uneven shapes.

The corpus is written after torch's own distributed tests (the comment above each names the test; the
bodies are written anew with the same checks, as asserts): DTensor redistribute, tensor parallel styles,
FSDP2, DCP and DeviceMesh. Each returns what a rank ends with (local shards, gradients, loaded values,
mesh coordinates), so that the values are compared too, bit for bit.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dstest
from dstest.crosscheck import difference
from dstest.errors import InvalidArgument, WorldsDiverge

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # DCP's and DTensor's advice on CPU
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sizes(w: int) -> list[tuple[tuple[int, int], int]]:
    return [((w * 3, 3), 0), ((w * 3 + 1, 3), 0), ((w * 3 + 2, 3), 0), ((3, w * 3 + 1), 1), ((3, w * 3 + 2), 1)]


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_shard_to_replicate_forward_backward
def shard_to_replicate_forward_backward(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = []
    comm_mode = CommDebugMode()
    for i, (size, dim) in enumerate(_sizes(ctx.world_size)):
        expected = _randn(*size, seed=i).requires_grad_()
        dtensor = distribute_tensor(expected, mesh, [Shard(dim)])
        with comm_mode:
            reshard = dtensor.redistribute(mesh, [Replicate()])
        assert reshard.size() == torch.Size(size)
        assert torch.equal(expected, reshard.to_local())
        assert comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor] == 1
        with comm_mode:
            reshard.backward(torch.ones_like(reshard))
        grad = dtensor.grad
        assert grad.placements == (Shard(dim),)
        assert torch.equal(grad.to_local(), torch.ones(dtensor.to_local().size()))
        assert comm_mode.get_total_counts() == 0
        out.append((dtensor.to_local().detach(), grad.to_local()))
    return out


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_replicate_to_shard_forward_backward
def replicate_to_shard_forward_backward(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = []
    comm_mode = CommDebugMode()
    for i, (size, dim) in enumerate(_sizes(ctx.world_size)):
        local_replica = _randn(*size, seed=10 + i).requires_grad_()
        mine = torch.chunk(local_replica, ctx.world_size, dim=dim)
        local = mine[ctx.rank] if ctx.rank < len(mine) else local_replica.narrow(dim, 0, 0)
        replica = distribute_tensor(local_replica, mesh, [Replicate()])
        with comm_mode:
            reshard = replica.redistribute(mesh, [Shard(dim)])
        assert reshard.size() == replica.size()
        assert reshard.placements == (Shard(dim),)
        assert torch.equal(reshard.to_local(), local)
        assert comm_mode.get_total_counts() == 0
        with comm_mode:
            reshard.backward(torch.ones_like(reshard))
        assert replica.grad.placements == (Replicate(),)
        assert torch.equal(replica.grad.to_local(), torch.ones(size))
        assert comm_mode.get_total_counts() == 1
        out.append(reshard.to_local().detach())
    return out


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_partial_to_replicate_forward_backward
def partial_to_replicate_forward_backward(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    partial_local = torch.ones(12, 3, requires_grad=True)
    partial = DTensor.from_local(partial_local, mesh, [Partial()])
    replicated = partial.redistribute(mesh, [Replicate()])
    assert partial.size() == partial_local.size()
    assert torch.equal(partial_local * ctx.world_size, replicated.to_local())
    replicated.backward(torch.ones_like(replicated))
    assert torch.equal(partial_local.grad, torch.ones_like(partial_local))
    return replicated.to_local().detach(), partial_local.grad


# torch: test/distributed/tensor/parallel/test_tp_examples.py, DistTensorParallelExampleTest.test_mlp_training
# (an MLP with ColwiseParallel / RowwiseParallel against the same MLP on one rank: outputs, grads, a step).
def tensor_parallel_mlp_training(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    w = ctx.world_size
    torch.manual_seed(0)
    hidden = 4 * w  # divisible: Rowwise takes its input as even shards
    ref = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 5))
    model = parallelize_module(
        nn.Sequential(*[m for m in _copy(ref)]), init_device_mesh("cpu", (w,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.25), torch.optim.SGD(ref.parameters(), lr=0.25)
    losses = []
    for step in range(2):
        x = _randn(8, 10, seed=100 + step)
        out, ref_out = model(x), ref(x)
        torch.testing.assert_close(out, ref_out)
        out.sum().backward()
        ref_out.sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(out.sum().detach())
    return losses, [p.to_local().detach() for p in model.parameters()]


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShardTraining (an MLP with
# uneven dims, per-layer and root fully_shard, against a replicated reference over the global batch).
def fsdp2_training_uneven(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model = _copy(ref)
    mesh = init_device_mesh("cpu", (w,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x, y = _randn(2 * w, 5, seed=200 + step), _randn(2 * w, 3, seed=300 + step)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(model(x[2 * r : 2 * r + 2]), y[2 * r : 2 * r + 2]).backward()
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor().detach() for p in model.parameters()]
    for got, want in zip(full, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    return full, [p.to_local().detach() for p in model.parameters()]


# torch: test/distributed/checkpoint/test_dtensor_checkpoint.py (save sharded, load into another layout).
def dcp_save_sharded_load_replicated(ctx, root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = torch.arange(float((ctx.world_size * 2 + 1) * 3)).reshape(-1, 3)  # uneven rows
    path = os.path.join(root, f"ws{ctx.world_size}")
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 7}, checkpoint_id=path)
    target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Replicate()]), "step": 0}
    dcp.load(target, checkpoint_id=path)
    assert torch.equal(target["w"].to_local(), full) and target["step"] == 7
    sharded = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])}
    dcp.load(sharded, checkpoint_id=path)
    assert torch.equal(sharded["w"].full_tensor(), full)
    return target["w"].to_local(), sharded["w"].to_local()


# torch: test/distributed/test_device_mesh.py, TestDeviceMesh / TestMeshEnv (coordinates, sub-meshes,
# group ranks), and the uneven 2-D round trip of the threaded world's DeviceMesh bug.
def device_mesh_2d(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    coordinate = list(mesh.get_coordinate())
    assert coordinate == [ctx.rank // (ctx.world_size // 2), ctx.rank % (ctx.world_size // 2)]
    assert (dp.size(), tp.size()) == (2, ctx.world_size // 2)
    x = torch.arange(45.0).reshape(9, 5)
    shards = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    assert torch.equal(shards.full_tensor(), x)
    ranks = (dist.get_process_group_ranks(dp.get_group()), dist.get_process_group_ranks(tp.get_group()))
    return coordinate, mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), ranks, shards.to_local()


CORPUS = [
    shard_to_replicate_forward_backward,
    replicate_to_shard_forward_backward,
    partial_to_replicate_forward_backward,
    tensor_parallel_mlp_training,
    fsdp2_training_uneven,
    dcp_save_sharded_load_replicated,
    device_mesh_2d,
]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("body", CORPUS, ids=lambda f: f.__name__)
def test_the_threaded_world_matches_the_process_world(body, world_size):
    if body is device_mesh_2d and world_size % 2:
        pytest.skip("a (2, W/2) mesh needs an even world size")
    kwargs = {}
    # gloo sums in the order of its own algorithm, the threaded world folds in rank order: training results
    # differ in the last bits of a float32 (seen: 3e-8 after FSDP2's reduce-scatters, 1.5e-5 on TP outputs)
    tol = {"rtol": 1e-4, "atol": 1e-5} if body in (tensor_parallel_mlp_training, fsdp2_training_uneven) else {}
    with tempfile.TemporaryDirectory() as root:
        if body is dcp_save_sharded_load_replicated:
            kwargs["root"] = root
        dstest.crosscheck(body, world_size, kwargs=kwargs, **tol)


# -- the check itself can fail, naming what differs ------------------------------------------------------------
def result_that_names_its_world(ctx):
    return {"world": ctx.world, "rank": ctx.rank}


def extra_call_on_threads(ctx):
    t = torch.ones(2)
    dist.all_reduce(t)
    if ctx.world == "threaded":
        dist.broadcast(t, src=1)
    return t


def fails_on_threads(ctx):
    assert ctx.world == "process", "planted: only the threaded world fails"


def tensors_that_differ_slightly(ctx):
    return torch.ones(3) + (1e-7 if ctx.world == "threaded" else 0.0)


def test_a_difference_in_results_is_named_with_the_rank_and_both_values():
    with pytest.raises(WorldsDiverge, match=r"rank 0's result\['world'\]: 'threaded' vs 'process'"):
        dstest.crosscheck(result_that_names_its_world, 2)


def test_a_difference_in_the_trace_names_the_call_on_each_world():
    with pytest.raises(WorldsDiverge, match=r"rank 0's call 2: threaded world broadcast\(float32\[2\], root=1\) on "
                       r"world \(seq 2\), process world no call"):
        dstest.crosscheck(extra_call_on_threads, 2)


def test_a_body_that_fails_on_one_world_only_is_a_divergence_with_that_worlds_failure():
    with pytest.raises(WorldsDiverge, match="passes on the process world and fails on the threaded world") as info:
        dstest.crosscheck(fails_on_threads, 2)
    assert "planted: only the threaded world fails" in str(info.value)


def test_tolerances_compare_floating_results_within_them():
    with pytest.raises(WorldsDiverge, match="tensors differ"):
        dstest.crosscheck(tensors_that_differ_slightly, 2)
    assert len(dstest.crosscheck(tensors_that_differ_slightly, 2, rtol=1e-5)) == 2


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(InvalidArgument, match="name two different worlds"):
        dstest.crosscheck(result_that_names_its_world, 2, worlds=["threaded", "threaded"])
    with pytest.raises(InvalidArgument, match=r"rtol=-1: must be a finite number >= 0"):
        dstest.crosscheck(result_that_names_its_world, 2, rtol=-1)


# -- results are compared by type, exactly (issue 40, finding 3) ------------------------------------------------
def _nan(bits: int) -> torch.Tensor:
    """A float64 NaN with the given bit pattern."""
    return torch.tensor([bits], dtype=torch.int64).view(torch.float64)


def same_nan_on_both(ctx):
    return {"loss": torch.tensor([1.0, float("nan")]), "nan": float("nan"), "payload": _nan(0x7FF8000000000123)}


def numpy_differs_in_the_middle(ctx):
    import numpy as np

    a = np.zeros(4000, dtype=np.float32)
    if ctx.world == "threaded" and ctx.rank == 1:
        a[2000] = 1.0
    return [a]


def negative_zero_on_threads(ctx):
    return torch.tensor([0.0, -0.0 if ctx.world == "threaded" else 0.0, 1.0])


def other_nan_payload_on_threads(ctx):
    return _nan(0x7FF8000000000001 if ctx.world == "threaded" else 0x7FF8000000000002)


def nested_difference(ctx):
    w = torch.arange(6.0).reshape(2, 3)
    if ctx.world == "threaded" and ctx.rank == 1:
        w[1, 0] = 7.0
    return [ctx.rank, {"w": w, "step": 3}]


def keys_differ(ctx):
    return {"a": 1, ("b" if ctx.world == "threaded" else "c"): 2}


class _ArrayLike:
    """== gives something that is not a bool (as numpy arrays and tensors do)."""

    def __eq__(self, other):
        return [True]

    __hash__ = None  # type: ignore[assignment]


def returns_an_array_like(ctx):
    return {"x": _ArrayLike()}


def test_identical_results_holding_nan_are_equal():
    results = dstest.crosscheck(same_nan_on_both, 2)
    assert torch.isnan(results[0]["loss"][1])


def test_numpy_arrays_are_compared_in_full():
    with pytest.raises(WorldsDiverge, match=r"rank 1's result\[0\]\[2000\]: float32 arrays differ: 1\.0 vs 0\.0"):
        dstest.crosscheck(numpy_differs_in_the_middle, 2)


def test_negative_zero_differs_from_zero_bit_for_bit_but_not_within_a_tolerance():
    with pytest.raises(WorldsDiverge, match=r"rank 0's result\[1\]: torch\.float32 tensors differ: -0\.0 vs 0\.0"):
        dstest.crosscheck(negative_zero_on_threads, 2)
    dstest.crosscheck(negative_zero_on_threads, 2, atol=1e-9)


def test_another_nan_payload_differs_bit_for_bit_and_the_bits_are_shown():
    with pytest.raises(WorldsDiverge, match=r"0x7ff8000000000001 vs 0x7ff8000000000002"):
        dstest.crosscheck(other_nan_payload_on_threads, 2)
    dstest.crosscheck(other_nan_payload_on_threads, 2, rtol=1e-6)  # within tolerances NaN equals NaN


def test_the_path_of_the_first_difference_is_named():
    with pytest.raises(WorldsDiverge, match=r"rank 1's result\[1\]\['w'\]\[1, 0\]: torch\.float32 tensors differ: "
                       r"7\.0 vs 3\.0 \(1 of 6 elements differ\) \(threaded world vs process world\)"):
        dstest.crosscheck(nested_difference, 2)


def test_missing_and_extra_keys_are_named():
    with pytest.raises(WorldsDiverge, match=r"rank 0's result: keys \['b'\] only on the threaded world, \['c'\] only "
                       r"on the process world"):
        dstest.crosscheck(keys_differ, 2)


def test_a_result_whose_equality_is_not_a_bool_is_refused_clearly():
    with pytest.raises(InvalidArgument, match=r"rank 0's result\['x'\]: _ArrayLike == _ArrayLike gave list, not "
                       r"True or False"):
        dstest.crosscheck(returns_an_array_like, 2)


def test_crosscheck_stays_callable_after_its_module_is_imported():
    """``from dstest.crosscheck import difference`` makes the package's ``crosscheck`` the module."""
    import subprocess
    import sys

    code = (
        "from dstest.crosscheck import difference\n"
        "import dstest\n"
        "assert difference(1, 2).why == '1 vs 2'\n"
        "dstest.crosscheck(print, 2, worlds=['threaded'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "crosscheck: worlds=['threaded']: name two different worlds" in done.stderr, done.stderr


def test_negative_and_conjugate_views_are_compared_by_their_bits():
    """torch's resolve_neg computes bfloat16 and half through float, which makes every NaN one NaN."""
    def bf16(bits):
        return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)

    nan_a, nan_b = bf16([0x7FC1]), bf16([0x7FC2])
    found = difference(torch._neg_view(nan_a), torch._neg_view(nan_b))
    assert found is not None and found.path == "[0]" and "0xffc1 vs 0xffc2" in found.why, found
    assert difference(torch._neg_view(nan_a), torch._neg_view(nan_a.clone())) is None
    assert difference(torch._neg_view(nan_a), nan_a.neg()) is not None  # -NaN by computing: the payload is lost
    z = torch.tensor([1 + 2j, float("nan") + 0j])
    assert difference(z.conj(), z.conj_physical()) is None  # a view and a copy of the same values
    assert difference(z.conj(), z).path == "[0]"


@pytest.mark.skipif(np.finfo(np.longdouble).nmant != 63, reason="long double is x87 extended precision only on x86")
def test_long_double_arrays_are_compared_by_value_not_by_their_padding():
    a = np.array([1.5, -0.0, np.nan], dtype=np.longdouble)
    raw = bytearray(a.tobytes())
    for e in range(3):  # the bytes after the 10 of each value's x87 format: padding, never read
        raw[e * a.itemsize + 10 : (e + 1) * a.itemsize] = b"\xab" * (a.itemsize - 10)
    b = np.frombuffer(bytes(raw), dtype=np.longdouble)
    assert difference(a, b) is None
    found = difference(a, np.array([1.5, 0.0, np.nan], dtype=np.longdouble))
    assert found is not None and found.path == "[1]", found


def test_structured_arrays_are_compared_field_by_field_not_by_their_padding():
    dtype = np.dtype([("step", np.int8), ("loss", np.float64)], align=True)  # 7 bytes of padding after step
    a = np.zeros(4, dtype=dtype)
    a["loss"] = [0.5, np.nan, -0.0, 2.0]
    raw = bytearray(a.tobytes())
    for e in range(4):
        raw[e * dtype.itemsize + 1 : e * dtype.itemsize + 8] = b"\xcd" * 7
    assert difference(a, np.frombuffer(bytes(raw), dtype=dtype)) is None
    b = a.copy()
    b["loss"][2] = 0.0
    found = difference(a, b)
    assert found is not None and found.path == "['loss'][2]" and "-0.0 vs 0.0" in found.why, found


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # torch 2.13 deprecates the creators
def test_quantized_tensors_are_compared_by_their_integers_and_quantization():
    """They crashed the process (torch.equal on their bytes): now their integers and parameters are compared."""
    q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 1.5]), 0.5, 2, torch.quint8)
    same = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 1.5]), 0.5, 2, torch.quint8)
    assert difference(q, same) is None
    other = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 2.0]), 0.5, 2, torch.quint8)
    assert "[2]" in str(difference(q, other))
    rescaled = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 1.5]), 0.25, 2, torch.quint8)
    assert "of other quantization" in str(difference(q, rescaled))
    assert str(difference({"w": q}, {"w": rescaled})).startswith("['w']: quantized")  # at its path
    per_channel = torch.quantize_per_channel(
        torch.ones(2, 2), torch.tensor([0.5, 1.0], dtype=torch.float64), torch.tensor([0, 1]), 0, torch.qint8
    )
    assert difference(per_channel, per_channel.clone()) is None
    scales = torch.tensor([0.5, 1.0], dtype=torch.float64)
    affine = torch.quantize_per_channel(torch.ones(2, 2), scales, torch.tensor([0, 0]), 0, torch.quint8)
    float_qparams = torch.quantize_per_channel(torch.ones(2, 2), scales, torch.tensor([0.0, 0.0]), 0, torch.quint8)
    assert torch.equal(affine.int_repr(), float_qparams.int_repr())  # the same integers, zero points 0 and 0.0
    assert "per_channel_affine_float_qparams" in str(difference(affine, float_qparams))  # another scheme


def test_a_negative_view_that_is_not_contiguous_is_read_in_its_own_order():
    """``conj().imag`` of a transposed complex matrix is a negative view with strides of its own: its stored
    values are read through those strides (not as if contiguous), then their sign bits flipped."""
    z = torch.complex(torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 12.0).reshape(2, 3)).t()
    view = z.conj().imag
    assert view.is_neg() and not view.is_contiguous()
    plain = -torch.arange(6.0, 12.0).reshape(2, 3).t().contiguous()
    assert difference(view, plain) is None
    assert "[2, 1]" in str(difference(view, plain.index_put((torch.tensor(2), torch.tensor(1)), torch.tensor(0.0))))
