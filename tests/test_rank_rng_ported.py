"""Issue 42's acceptance corpus (contract E5 with E14): torch's own distributed tests that seed torch's default
generator (the same seed on every rank, or one per rank) and draw from it after collectives give the same
verdict and the same values on the threaded world as on the process world, at W = 2, 3 and 4.

Rank threads once shared torch's one default CPU generator: a body that seeded and then drew after a collective
got numbers interleaved with the other ranks' draws, so ranks that must agree on a tensor (a replicated input,
a global batch, a weight) did not, and torch's assertions failed on threads only. Each body here is written anew
after the torch test named in the comment above it (read from pytorch/pytorch's test/distributed tree), with
that test's seeding exactly as torch's harness and the test do it, its draws where the test makes them, and its
assertions in the same meaning (as asserts and ``torch.testing.assert_close``, which has ``assertEqual``'s
tolerances), on a CPU mesh. Each returns what the rank ends with (local shards, gradients, losses), so that
``dstest.crosscheck`` compares the values, the verdict and the collective trace of both worlds.

torch's harness (``MultiProcessTestCase.run_test``) seeds every rank's process with ``common_utils.SEED``
(1234) before a test runs; the bodies that rely on it start with ``torch.manual_seed(HARNESS_SEED)``. Where a
test loops over subtests (``run_subtests``), the bodies do too, in one run, as torch does; loops are shortened
where the comment says so, to keep this file's run short.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dstest

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # DTensor's, FSDP's and DDP's advice on CPU
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

#: What torch's MultiProcessTestCase seeds each rank's process with before a test (common_utils.SEED).
HARNESS_SEED = 1234

assert_close = torch.testing.assert_close


def _mesh(ctx: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ctx.world_size,))


def _comm_counts() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


_funcol = torch.ops.c10d_functional


# -- DTensor: test/distributed/tensor/test_math_ops.py ------------------------------------------------------------


# torch: test/distributed/tensor/test_math_ops.py, DistMathOpsTest.test_linear_op_reductions
# (each op's input is drawn after the previous op's all-gathers; every rank must draw the same tensor; each dim
# is reduced with one of keepdim True, False and not given, in turn, not with all three)
def linear_op_reductions(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    out = []
    for op_str in ("all", "sum", "prod", "max", "min", "any", "amax", "amin"):
        tensor = torch.randn(12, 8, 8)
        if op_str in ("any", "all"):
            tensor = tensor < 0
        dtensor = distribute_tensor(tensor, mesh, [Shard(0)])
        op, op_dt = getattr(tensor, op_str), getattr(dtensor, op_str)
        for dim, keep_dim in zip(range(tensor.ndim), (True, False, None)):
            args = (dim, keep_dim) if keep_dim is not None else (dim,)
            want, got = op(*args), op_dt(*args)
            if op_str in ("max", "min"):  # a (values, indices) pair when a dim is given
                want, got = want[0], got[0]
            assert_close(got.full_tensor(), want)
        full = op_dt().full_tensor()
        assert_close(full, op())
        out.append((dtensor.to_local(), full))
    return out


# torch: test/distributed/tensor/test_math_ops.py, DistMathOpsTest.test_layer_norm_bwd
# (each config's input is drawn after the last one's collectives; 6 of the 18 configs, each setting taken)
def layer_norm_bwd(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor._ops.utils import is_tensor_partial

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    batch, sentence_length, embedding_dim = 20, 5, 10

    def replicate_params(name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in module.named_parameters():
            if pname in ("weight", "bias"):
                module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()])))

    out = []
    configs = [(shard_dim, norm_idx, (shard_dim + norm_idx) % 2 == 0) for shard_dim in (0, 1, 2) for norm_idx in (0, 2)]
    for shard_dim, norm_idx, elementwise_affine in configs:
        x = torch.rand(batch, sentence_length, embedding_dim, requires_grad=True)
        layer_norm = nn.LayerNorm(x.shape[norm_idx:], elementwise_affine=elementwise_affine)
        layer_norm_local = copy.deepcopy(layer_norm)
        layer_norm_dist = distribute_module(layer_norm, mesh, replicate_params)
        if elementwise_affine:
            assert_close(layer_norm_local.weight, layer_norm_dist.weight.full_tensor())
            assert_close(layer_norm_local.bias, layer_norm_dist.bias.full_tensor())
        x_local = x.detach().clone().requires_grad_(True)
        x_dist = distribute_tensor(x, mesh, [Shard(shard_dim)])
        assert_close(x_local, x_dist.full_tensor())
        y_local = layer_norm_local(x_local)
        comm_mode = _comm_counts()
        with comm_mode:
            y_dist = layer_norm_dist(x_dist)
            y_dist.sum().backward()
        expected_comm = 0 if shard_dim < norm_idx else 1
        assert sum(comm_mode.comm_module_counts["Global"]["forward"].values()) == expected_comm
        assert_close(y_local, y_dist.full_tensor())
        y_local.sum().backward()
        assert sum(comm_mode.comm_module_counts["Global"]["backward"].values()) == expected_comm
        if elementwise_affine:
            needs_reduction = any(x_dist._spec.dim_map[d] >= 0 for d in range(norm_idx))
            assert is_tensor_partial(layer_norm_dist.weight.grad._spec) == needs_reduction
            assert is_tensor_partial(layer_norm_dist.bias.grad._spec) == needs_reduction
            assert_close(layer_norm_local.weight.grad, layer_norm_dist.weight.grad.full_tensor())
            assert_close(layer_norm_local.bias.grad, layer_norm_dist.bias.grad.full_tensor())
        assert_close(x_local.grad, x_dist.grad.full_tensor())
        out.append((y_dist.to_local().detach(), x_dist.grad.to_local()))
    return out


# torch: test/distributed/tensor/test_math_ops.py, DistMathOpsTest.test_layer_norm_bwd_req_grad
# (each subtest builds its models and draws its tokens after the previous subtest's collectives; 5 subtests of 20)
def layer_norm_bwd_req_grad(ctx):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    batch, seq_len, embedding_dim, vocab_size = 8, 8, 10, 32

    class LnTpBlock(nn.Module):
        def __init__(self, normalized_shape: tuple[int, ...], elementwise_affine: bool) -> None:
            super().__init__()
            self.preln_embeddings = nn.Embedding(vocab_size, embedding_dim)
            self.layer_norm = nn.LayerNorm(normalized_shape, elementwise_affine=elementwise_affine)
            self.postln_linear = nn.Linear(embedding_dim, embedding_dim)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.postln_linear(self.layer_norm(self.preln_embeddings(tokens)))

    def check_grads(local: nn.Module, dist_model: nn.Module) -> None:
        named = dict(local.named_parameters())
        for name, param in dist_model.named_parameters():
            want, got = named[name].grad, param.grad
            if isinstance(got, DTensor):
                got = got.redistribute(got.device_mesh, [Replicate()]).to_local()
            assert_close(got, want)

    configs = [
        cfg
        for cfg in itertools.product((False, True), repeat=5)
        if not (cfg[3] and not cfg[1]) and any(cfg[2:])  # ln_req_grad needs an affine norm; something trains
    ][::4]  # every fourth of torch's 20 subtests, to keep the run short
    out = []
    for multidim_norm, elementwise_affine, emb_req_grad, ln_req_grad, out_req_grad in configs:
        normalized_shape = (seq_len, embedding_dim) if multidim_norm else (embedding_dim,)
        model = LnTpBlock(normalized_shape, elementwise_affine)
        model_local = copy.deepcopy(model)
        model_dist = parallelize_module(
            model,
            mesh,
            {
                "preln_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "layer_norm": SequenceParallel(),
                "postln_linear": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
        req_grad = {"preln_embeddings": emb_req_grad, "postln_linear": out_req_grad, "layer_norm": ln_req_grad}
        for target in (model_local, model_dist):
            for n, p in target.named_parameters():
                if not req_grad.get(n.rpartition(".")[0], False):
                    p.requires_grad_(False)
        x = torch.randint(vocab_size, (batch, seq_len))
        output_local = model_local(x.detach().clone())
        comm_mode = _comm_counts()
        with comm_mode:
            output_dist = model_dist(x)
        assert_close(output_local, output_dist)
        assert comm_mode.comm_module_counts["Global"]["forward"] == {
            _funcol.reduce_scatter_tensor: 1,
            _funcol.all_gather_into_tensor: 2,
        }
        output_local.sum().backward()
        comm_mode = _comm_counts()
        with comm_mode:
            output_dist.sum().backward()
        check_grads(model_local, model_dist)
        if out_req_grad and not (emb_req_grad or ln_req_grad):
            expected_bwd: dict[Any, int] = {}
        elif ln_req_grad and not (emb_req_grad or multidim_norm):
            expected_bwd = {_funcol.reduce_scatter_tensor: 1}
        elif multidim_norm:
            expected_bwd = {_funcol.all_reduce: 1, _funcol.all_gather_into_tensor: 2 if emb_req_grad else 1}
        else:
            expected_bwd = {_funcol.reduce_scatter_tensor: 1, _funcol.all_gather_into_tensor: 1}
        assert comm_mode.comm_module_counts["Global"]["backward"] == expected_bwd
        out.append(output_dist.detach())
    return out


# torch: test/distributed/tensor/test_math_ops.py, DistMathOpsTest.test_dist
# (the partial-placement inputs are drawn after the p-norm loop's all-reduces)
def dist_p_norms(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    tensor_a, tensor_b = torch.randn(12, 8), torch.randn(12, 8)
    out = []
    for p in (1, 2, float("inf")):
        ref_dist = torch.dist(tensor_a, tensor_b, p)
        dtensor_a = distribute_tensor(tensor_a, mesh, [Shard(0)])
        dtensor_b = distribute_tensor(tensor_b, mesh, [Shard(0)])
        dtensor_dist = torch.dist(dtensor_a, dtensor_b, p)
        assert dtensor_dist.placements[0].is_partial()
        result = dtensor_dist.full_tensor()
        assert_close(result, ref_dist)
        rep_a = distribute_tensor(tensor_a, mesh, [Replicate()])
        rep_b = distribute_tensor(tensor_b, mesh, [Replicate()])
        assert_close(torch.dist(rep_a, rep_b, p).full_tensor(), ref_dist)
        out.append(result)
    tensor_c, tensor_d = torch.randn(12, 8), torch.randn(12, 8)
    partial_c = distribute_tensor(tensor_c, mesh, [Shard(0)]).sum(dim=0, keepdim=True)
    partial_d = distribute_tensor(tensor_d, mesh, [Shard(0)]).sum(dim=0, keepdim=True)
    assert partial_c.placements[0].is_partial() and partial_d.placements[0].is_partial()
    dist_partial = torch.dist(partial_c, partial_d, 2)
    ref_partial = torch.dist(partial_c.full_tensor(), partial_d.full_tensor(), 2)
    assert_close(dist_partial.full_tensor(), ref_partial)
    out.append((tensor_c, tensor_d, dist_partial.full_tensor()))
    return out


# torch: test/distributed/tensor/test_math_ops.py, DistMathOpsTest.test_partial_reduction_ops
# (seeded per rank; the second and third local tensors are drawn after a redistribute's all-reduce)
def partial_reduction_ops(ctx):
    from torch.distributed.tensor import DTensor, Partial, Replicate

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    torch.manual_seed(dist.get_rank())
    out = []
    for reduction in (torch.norm, torch.max, torch.min):
        local_tensor = torch.rand(3, dtype=torch.float32)
        dt = DTensor.from_local(local_tensor, device_mesh=mesh, placements=[Partial("sum")])
        out_without_redistribute = reduction(dt)
        dt = dt.redistribute(dt.device_mesh, placements=[Replicate()])
        out_with_redistribute = reduction(dt)
        assert_close(out_without_redistribute.full_tensor(), out_with_redistribute.full_tensor())
        out.append((local_tensor, out_with_redistribute.to_local()))
    return out


# -- DTensor: test/distributed/tensor/test_redistribute.py --------------------------------------------------------


def _sizes_and_shard_dims(w: int) -> list[tuple[tuple[int, int], int]]:
    return [
        ((w * 3, 3), 0),
        ((w * 3 + 1, 3), 0),
        ((w * 3 + 2, 3), 0),
        ((3, w * 3), 1),
        ((3, w * 3 + 1), 1),
        ((3, w * 3 + 2), 1),
    ]


def _shard_to_replicate_forward_backward(ctx: Any, dtype: torch.dtype) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    comm_mode = _comm_counts()
    out = []
    for input_size, shard_dim in _sizes_and_shard_dims(ctx.world_size):
        shard_spec = [Shard(shard_dim)]
        expected_tensor = torch.randn(input_size, requires_grad=True, dtype=dtype)
        dtensor = distribute_tensor(expected_tensor, mesh, shard_spec)
        with comm_mode:
            reshard_dtensor = dtensor.redistribute(mesh, [Replicate()])
        assert reshard_dtensor.size() == torch.Size(input_size)
        assert_close(expected_tensor, reshard_dtensor.to_local())
        assert comm_mode.get_comm_counts()[_funcol.all_gather_into_tensor] == 1
        with comm_mode:
            reshard_dtensor.backward(torch.ones_like(reshard_dtensor))
        grad_input = dtensor.grad
        assert list(grad_input.placements) == shard_spec
        assert_close(grad_input.to_local(), torch.ones(dtensor.to_local().size(), dtype=dtype))
        assert comm_mode.get_total_counts() == 0
        out.append((reshard_dtensor.to_local().detach(), grad_input.to_local()))
    return out


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_shard_to_replicate_forward_backward
# (dtype=torch.float32; each size's input is drawn after the previous size's all-gather)
def shard_to_replicate_forward_backward_float32(ctx):
    return _shard_to_replicate_forward_backward(ctx, torch.float32)


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_shard_to_replicate_forward_backward
# (dtype=torch.cfloat)
def shard_to_replicate_forward_backward_complex(ctx):
    return _shard_to_replicate_forward_backward(ctx, torch.cfloat)


# torch: test/distributed/tensor/test_redistribute.py, RedistributeTest.test_replicate_to_shard_forward_backward
def replicate_to_shard_forward_backward(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    comm_mode = _comm_counts()
    out = []
    for input_size, shard_dim in _sizes_and_shard_dims(ctx.world_size):
        shard_spec = [Shard(shard_dim)]
        local_replica = torch.randn(input_size, requires_grad=True)
        local_tensor = list(torch.chunk(local_replica, ctx.world_size, dim=shard_dim))[ctx.rank]
        replica_tensor = distribute_tensor(local_replica, mesh, [Replicate()])
        with comm_mode:
            reshard_tensor = replica_tensor.redistribute(mesh, shard_spec)
        assert reshard_tensor.size() == replica_tensor.size()
        assert list(reshard_tensor.placements) == shard_spec
        assert_close(reshard_tensor.to_local(), local_tensor)
        assert comm_mode.get_total_counts() == 0
        with comm_mode:
            reshard_tensor.backward(torch.ones_like(reshard_tensor))
        grad_input = replica_tensor.grad
        assert list(grad_input.placements) == [Replicate()]
        assert_close(grad_input.to_local(), torch.ones(input_size))
        assert comm_mode.get_total_counts() == 1
        assert comm_mode.get_comm_counts()[_funcol.all_gather_into_tensor] == 1
        out.append((reshard_tensor.to_local().detach(), grad_input.to_local()))
    return out


_FORWARD_DTYPES = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
_FORWARD_DTYPES += [None, None]
_BACKWARD_DTYPES = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, None, None]
_BACKWARD_DTYPES += [torch.bfloat16, torch.float32]


# torch: test/distributed/tensor/test_redistribute.py,
# RedistributeTest.test_replicate_to_replicate_forward_backward_datatype_conversion
def replicate_to_replicate_datatype_conversion(ctx):
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    comm_mode = _comm_counts()
    out = []
    for forward_dtype, backward_dtype in zip(_FORWARD_DTYPES, _BACKWARD_DTYPES):
        local_tensor = torch.randn(12, 3, requires_grad=True)  # drawn after the last pair's broadcast
        replica_tensor = distribute_tensor(local_tensor, mesh, [Replicate()])
        with comm_mode:
            reshard = replica_tensor.redistribute(
                mesh, [Replicate()], forward_dtype=forward_dtype, backward_dtype=backward_dtype
            )
        assert replica_tensor.size() == local_tensor.size()
        assert_close(replica_tensor.to(forward_dtype).to_local(), reshard.to_local())
        assert comm_mode.get_total_counts() == 0
        with comm_mode:
            reshard.backward(torch.ones_like(reshard))
        grad_input = replica_tensor.grad
        assert list(grad_input.placements) == [Replicate()]
        assert_close(grad_input.to_local(), torch.ones(12, 3))
        assert comm_mode.get_total_counts() == 0
        out.append((reshard.to_local().detach(), grad_input.to_local()))
    return out


# torch: test/distributed/tensor/test_redistribute.py,
# RedistributeTest.test_shard_to_replicate_forward_backward_datatype_conversion (each dtype pair on one of the
# six sizes in turn, not on all six)
def shard_to_replicate_datatype_conversion(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    comm_mode = _comm_counts()
    out = []
    sizes = _sizes_and_shard_dims(ctx.world_size)
    for i, (forward_dtype, backward_dtype) in enumerate(zip(_FORWARD_DTYPES, _BACKWARD_DTYPES)):
        for input_size, shard_dim in [sizes[i % len(sizes)]]:
            shard_spec = [Shard(shard_dim)]
            expected_tensor = torch.randn(input_size, requires_grad=True)
            dtensor = distribute_tensor(expected_tensor, mesh, shard_spec)
            with comm_mode:
                reshard = dtensor.redistribute(
                    mesh, [Replicate()], forward_dtype=forward_dtype, backward_dtype=backward_dtype
                )
            assert reshard.size() == torch.Size(input_size)
            assert_close(expected_tensor.to(forward_dtype), reshard.to_local())
            assert comm_mode.get_comm_counts()[_funcol.all_gather_into_tensor] == 1
            with comm_mode:
                reshard.backward(torch.ones_like(reshard))
            grad_input = dtensor.grad
            assert list(grad_input.placements) == shard_spec
            assert_close(grad_input.to_local(), torch.ones(dtensor.to_local().size()))
            assert comm_mode.get_total_counts() == 0
        out.append((reshard.to_local().detach(), grad_input.to_local()))
    return out


# -- tensor parallel: test/distributed/tensor/parallel/test_tp_examples.py ----------------------------------------


class _MLPModule(nn.Module):
    """torch's test MLP (10 -> 16 -> 10), which seeds torch's generator with 5 as it is built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _check_module(m1: nn.Module, m2: nn.Module, check_grad: bool = False) -> None:
    """m2's parameters (or grads), replicated where they are DTensors, equal m1's."""
    from torch.distributed.tensor import DTensor, Replicate

    named = dict(m1.named_parameters())
    for name, param_m2 in m2.named_parameters():
        assert name in named
        param_m1 = named[name]
        if check_grad:
            param_m1, param_m2 = param_m1.grad, param_m2.grad
        if isinstance(param_m2, DTensor):
            param_m2 = param_m2.redistribute(device_mesh=param_m2.device_mesh, placements=[Replicate()]).to_local()
        assert_close(param_m2, param_m1)


def _mlp_training_e2e(ctx: Any, is_seq_parallel: bool) -> Any:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(ctx.rank if is_seq_parallel else 0)  # every TP rank has the same input unless sequence-parallel
    inp = torch.rand(8, 10)
    model = _MLPModule()
    model_tp = copy.deepcopy(model)
    _check_module(model, model_tp)
    mesh = _mesh(ctx)
    plan = {
        "net1": ColwiseParallel(input_layouts=Shard(0)) if is_seq_parallel else ColwiseParallel(),
        "net2": RowwiseParallel(output_layouts=Shard(0)) if is_seq_parallel else RowwiseParallel(),
    }
    model_tp = parallelize_module(model_tp, mesh, plan)
    optim = torch.optim.SGD(model.parameters(), lr=0.25)
    optim_tp = torch.optim.SGD(model_tp.parameters(), lr=0.25)
    output = model(inp)
    output.sum().backward()
    comm_mode = _comm_counts()
    with comm_mode:
        output_tp = model_tp(inp)
        output_tp.sum().backward()
    assert_close(output, output_tp)
    if is_seq_parallel:
        assert comm_mode.get_comm_counts()[_funcol.all_gather_into_tensor] == 2
        assert comm_mode.get_comm_counts()[_funcol.reduce_scatter_tensor] == 1
        for p in (model.net1.weight, model.net1.bias, model.net2.weight, model.net2.bias):
            dist.all_reduce(p.grad)  # the ranks' inputs differ: sum their gradients
    else:
        assert comm_mode.get_comm_counts()[_funcol.all_reduce] == 1
    _check_module(model, model_tp, check_grad=True)
    optim.step()
    optim_tp.step()
    _check_module(model, model_tp)
    inp = torch.rand(8, 10)  # drawn after the step's collectives
    output, output_tp = model(inp), model_tp(inp)
    assert_close(output, output_tp)
    return output_tp.detach(), [p.to_local().detach() for p in model_tp.parameters()]


# torch: test/distributed/tensor/parallel/test_tp_examples.py, DistTensorParallelExampleTest.test_mlp_training
# (is_seq_parallel=False, recompute_activation=False)
def mlp_training(ctx):
    return _mlp_training_e2e(ctx, is_seq_parallel=False)


# torch: test/distributed/tensor/parallel/test_tp_examples.py, DistTensorParallelExampleTest.test_mlp_training
# (is_seq_parallel=True: seeded per rank)
def mlp_training_sequence_parallel(ctx):
    return _mlp_training_e2e(ctx, is_seq_parallel=True)


# torch: test/distributed/tensor/parallel/test_tp_examples.py, DistTensorParallelExampleTest.test_weight_tying
def weight_tying(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class TestModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)  # different weights for the embedding and fc
            self.embedding = nn.Embedding(16, 8)
            torch.manual_seed(2)
            self.fc = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.embedding(x))

    torch.manual_seed(HARNESS_SEED)
    model = TestModule()
    parallelize_module(model, _mesh(ctx), {"embedding": ColwiseParallel(), "fc": RowwiseParallel()})
    torch.manual_seed(0)
    inp = torch.randint(16, [5])
    assert not torch.allclose(model.embedding.weight.to_local(), model.fc.weight.to_local())
    model(inp).sum().backward()
    untied = (model.embedding.weight.grad.to_local(), model.fc.weight.grad.to_local())
    assert not torch.allclose(*untied)
    model.zero_grad()
    model.fc.weight = model.embedding.weight  # tie them
    assert model.fc.weight is model.embedding.weight
    output = model(inp)
    output.sum().backward()
    assert model.embedding.weight.grad is model.fc.weight.grad
    return inp, untied, output.detach(), model.fc.weight.grad.to_local()


# torch: test/distributed/tensor/parallel/test_tp_examples.py, DistTensorParallelExampleTest.test_loss_parallel
# (the second setup's input and target are drawn after the first one's all-reduces)
def loss_parallel_cross_entropy(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    comm_mode = _comm_counts()
    channel_size, channel_dim = 16, 1
    weight = torch.rand(channel_size)
    out = []
    for input_ndim, input_size, target_size in ((2, (8, channel_size), (8,)), (3, (8, channel_size, 12), (8, 12))):
        x = torch.rand(*input_size, requires_grad=True)
        target = torch.randint(channel_size, target_size)
        for shard_dim, reduction in itertools.product(range(input_ndim), ("none", "mean", "sum")):
            dist_x = distribute_tensor(x, mesh, [Shard(shard_dim)])
            y = F.cross_entropy(x, target, weight, reduction=reduction)
            with loss_parallel():
                if shard_dim == channel_dim:
                    with comm_mode:
                        dist_y = F.cross_entropy(dist_x, target, weight, reduction=reduction)
                        assert comm_mode.get_total_counts() == 3
                        assert comm_mode.get_comm_counts()[_funcol.all_reduce] == 3
                        assert dist_y.placements[0].is_replicate()
                        assert_close(dist_y.to_local(), y)
                    with comm_mode:
                        if reduction == "none":
                            y.sum().backward()
                            dist_y.sum().backward()
                        else:
                            y.backward()
                            dist_y.backward()
                        assert comm_mode.get_total_counts() == 0
                        assert dist_x.grad.placements[0].is_shard(shard_dim)
                        assert_close(dist_x.grad.full_tensor(), x.grad)
                    out.append((dist_y.to_local().detach(), dist_x.grad.to_local()))
                    x.grad.zero_()
                else:
                    with pytest.raises(ValueError, match="loss_parallel"):
                        F.cross_entropy(dist_x, target, reduction=reduction)
    return out


# -- DTensor: test/distributed/tensor/test_dtensor.py --------------------------------------------------------------


class _DummyMLP(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.net1 = nn.Linear(5, 1024, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(1024, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(F.relu(self.net1(x)))

    def reset_parameters(self, *args: Any, **kwargs: Any) -> None:
        with torch.no_grad():
            self.net1.weight.fill_(0.5)
            self.net2.weight.fill_(1)
            self.net1.bias.fill_(1.5)
            self.net2.bias.fill_(1.2)


# torch: test/distributed/tensor/test_dtensor.py, DTensorTest.test_modules_w_meta_dtensor
def modules_with_meta_dtensor(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    model_tp = parallelize_module(_DummyMLP("meta"), mesh, plan)
    model_tp.to_empty(device="cpu")
    model_tp.reset_parameters()
    optim = torch.optim.SGD(model_tp.parameters(), lr=0.1)
    model_regular_tp = parallelize_module(_DummyMLP("cpu"), mesh, plan)
    optim_regular = torch.optim.SGD(model_regular_tp.parameters(), lr=0.1)
    model_regular_tp.reset_parameters()
    torch.manual_seed(0)
    inp = torch.randn(20, 5)
    output, output_regular = model_tp(inp), model_regular_tp(inp)
    assert_close(output, output_regular)
    output.sum().backward()
    output_regular.sum().backward()
    optim.step()
    optim_regular.step()
    torch.manual_seed(1)
    inp = torch.randn(20, 5)
    after = model_tp(inp)
    assert_close(after, model_regular_tp(inp))
    return output.detach(), after.detach()


# torch: test/distributed/tensor/test_dtensor.py, DTensorTest.test_metadata_consistency_check
# (the second and third local tensors are drawn after from_local's metadata check has run its collective)
def metadata_consistency_check(ctx):
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    placements = [Shard(0)]
    out = []

    def differs_on_rank_0(local_tensor: torch.Tensor) -> None:
        with pytest.raises(ValueError):
            DTensor.from_local(local_tensor, mesh, placements, run_check=True)
        DTensor.from_local(local_tensor, mesh, placements, run_check=False)  # no check, no error
        out.append(local_tensor.detach())

    local_tensor = torch.randn(3, 3, requires_grad=True, dtype=torch.float32)
    differs_on_rank_0(local_tensor.to(dtype=torch.float64) if ctx.rank == 0 else local_tensor)
    local_tensor = torch.randn(3, 3, requires_grad=True, dtype=torch.float32)
    if ctx.rank == 0:
        local_tensor.requires_grad = False
    differs_on_rank_0(local_tensor)
    local_tensor = torch.randn(3, 4, requires_grad=True, dtype=torch.float32)
    differs_on_rank_0(local_tensor.t() if ctx.rank == 0 else local_tensor)  # a transpose changes the stride
    return out


# -- DeviceMesh: test/distributed/test_device_mesh.py --------------------------------------------------------------


# torch: test/distributed/test_device_mesh.py, DeviceMeshCollectiveTest.test_scatter_1d
def scatter_1d(ctx):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._collective_utils import mesh_scatter

    torch.manual_seed(HARNESS_SEED)
    mesh = _mesh(ctx)
    scatter_tensor_shape = [3, 3, 3]
    out = []
    for scatter_dim in range(len(scatter_tensor_shape)):
        shard_placement = Shard(scatter_dim)
        scatter_tensor_shape[scatter_dim] *= ctx.world_size
        torch.manual_seed(0)  # the same seed on every rank
        global_tensor = torch.randn(scatter_tensor_shape)
        splitted_list, _ = shard_placement._split_tensor(global_tensor, mesh.size(), with_padding=True, contiguous=True)
        recv_tensor = torch.empty_like(splitted_list[mesh.get_rank()])
        mesh_scatter(recv_tensor, splitted_list, mesh, mesh_dim=0)  # dim > 0 scatters into a non-contiguous view
        assert_close(recv_tensor, splitted_list[mesh.get_rank()])
        out.append(recv_tensor)
    return out


# -- FSDP2: test/distributed/_composable/fsdp/ ---------------------------------------------------------------------


class _DoubleLinear(nn.Module):
    """Two outputs from one module (``use_second_linear=True``) or a module left unused (``False``)."""

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> Any:
        if self.use_second_linear:
            return self.relu(self.lin1(x)), self.relu(self.lin2(x))
        return self.relu(self.lin1(x))


class _MLP(nn.Module):
    def __init__(self, dim: int, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def _check_sharded_parity(ref: nn.Module, sharded: nn.Module, prefixes_to_ignore: tuple[str, ...] = ()) -> None:
    """Each sharded parameter (and gradient) equals the replicated one's shard on this rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for (ref_name, ref_param), (name, param) in zip(ref.named_parameters(), sharded.named_parameters(), strict=True):
        for prefix in prefixes_to_ignore:
            name = name.replace(prefix, "")
        assert ref_name == name, (ref_name, name)
        assert isinstance(param, DTensor)
        mesh, placements = param.device_mesh, param.placements
        assert_close(param.to_local(), distribute_tensor(ref_param, mesh, placements).to_local())
        if ref_param.grad is None:
            assert param.grad is None
            continue
        assert param.grad is not None
        assert_close(param.grad.to_local(), distribute_tensor(ref_param.grad, mesh, placements).to_local())


def _locals(module: nn.Module) -> list[torch.Tensor]:
    """A rank's parameters as it holds them: the local shard, or the whole tensor where FSDP left it unsharded."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in module.parameters()]


def _reduce_1d_partial_grads(module: nn.Module) -> None:
    for param in module.parameters():
        if param.grad is not None:
            param.grad.div_(dist.get_world_size())


def _reshard_choices(world_size: int, choices: tuple[bool | int, ...]) -> list[bool | int]:
    """torch runs these at W = 2 or 4; an int ``reshard_after_forward`` must divide the shard size, so at W = 3
    its subtest is left out (FSDP refuses it on both worlds alike)."""
    return [c for c in choices if isinstance(c, bool) or world_size % c == 0]


# torch: test/distributed/_composable/fsdp/test_fully_shard_autograd.py, TestFullyShardAutograd.
# test_unused_forward_output (a fixed seed on every rank; each step's global batch is drawn after the last
# step's all-gathers and reduce-scatters; 4 steps of 10)
def unused_forward_output(ctx):
    from torch.distributed.fsdp import fully_shard

    out = []
    for reshard_after_forward in _reshard_choices(ctx.world_size, (True, False, 2)):
        torch.manual_seed(42)
        local_batch_size = 2
        global_batch_size, dim = ctx.world_size * local_batch_size, 24
        model = _DoubleLinear(dim=dim, use_second_linear=True)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(4):
            global_inp = torch.rand((global_batch_size, dim))
            local_inp = global_inp[ctx.rank * local_batch_size : (ctx.rank + 1) * local_batch_size].detach()
            out1, out2 = model(local_inp)
            loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
            loss.backward()
            optim.step()
            ref_out1, ref_out2 = ref_model(global_inp)
            ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
            ref_loss.backward()
            _reduce_1d_partial_grads(ref_model)
            ref_optim.step()
            dist.all_reduce(loss)  # partial -> replicated
            assert_close(loss, ref_loss)
            optim.zero_grad(set_to_none=bool(iter_idx % 2))
            ref_optim.zero_grad(set_to_none=bool(iter_idx % 2))
            _check_sharded_parity(ref_model, model)
            out.append(loss.detach())
        out.append(_locals(model))
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_autograd.py, TestFullyShardAutograd.
# test_unused_forward_module (reshard_after_forward True and False of True, False and 2; 3 steps of 10)
def unused_forward_module(ctx):
    from torch.distributed.fsdp import fully_shard

    out = []
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        local_batch_size, dim = 2, 24
        model = _DoubleLinear(dim=dim, use_second_linear=False)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        out += _parity_steps(ctx, model, ref_model, 3, local_batch_size, dim)
        out.append(_locals(model))
    return out


def _parity_steps(
    ctx: Any, model: nn.Module, ref_model: nn.Module, steps: int, local_batch_size: int, dim: int
) -> list[Any]:
    """Upstream's parity loop: the same global batch on every rank (seed 1), the reference on all of it and
    the sharded model on this rank's slice, losses compared after an all-reduce, sharded parameters compared
    with the reference's after the reference's partial gradients are all-reduced; Adam on both."""
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    out = []
    for iter_idx in range(steps):
        global_inp = torch.rand((ctx.world_size * local_batch_size, dim))
        local_inp = global_inp[ctx.rank * local_batch_size : (ctx.rank + 1) * local_batch_size].detach()
        losses = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        _reduce_1d_partial_grads(ref_model)
        dist.all_reduce(losses[1])  # partial -> replicated
        assert_close(losses[0], losses[1])
        _check_sharded_parity(ref_model, model)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=bool(iter_idx % 2))
        out.append(losses[1].detach())
    return out


class _ContainerModule(nn.Module):
    """Runs on the tensor inside whatever container it is given and hands back the same container."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.lin2(self.relu(self.lin1(x))))

    def forward(self, inp: Any) -> Any:
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if isinstance(inp, tuple) and hasattr(inp, "_fields"):
            return type(inp)(self._forward(inp[0]), *inp[1:])
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        return {"x": self._forward(inp["x"])}


_NT = collections.namedtuple("_NT", "x y")


class _ToContainer(nn.Module):
    def __init__(self, container_type: str) -> None:
        super().__init__()
        self.container_type = container_type

    def forward(self, x: torch.Tensor) -> Any:
        return {"list": [x], "namedtuple": _NT(x, torch.ones_like(x)), "tuple": (x,), "dict": {"x": x}}[
            self.container_type
        ]


class _FromContainer(nn.Module):
    def __init__(self, container_type: str) -> None:
        super().__init__()
        self.container_type = container_type

    def forward(self, x: Any) -> torch.Tensor:
        return x["x"] if self.container_type == "dict" else x[0]


# torch: test/distributed/_composable/fsdp/test_fully_shard_autograd.py, TestFullyShardAutograd.
# test_nontensor_activations (the namedtuple and dict subtests of 4, 2 steps of 10)
def nontensor_activations(ctx):
    from torch.distributed.fsdp import fully_shard

    out = []
    for container_type in ("namedtuple", "dict"):
        torch.manual_seed(42)
        local_batch_size, dim = 2, 24
        model = nn.Sequential(
            _ToContainer(container_type),
            _ContainerModule(dim),
            _ContainerModule(dim),
            _ContainerModule(dim),
            _FromContainer(container_type),
        )
        ref_model = copy.deepcopy(model)
        for module in model:
            fully_shard(module)
        fully_shard(model)
        out += _parity_steps(ctx, model, ref_model, 2, local_batch_size, dim)
    return out


# Rank threads share module and class attributes; torch's threaded FSDP tests put barriers around a patch so
# that every rank reads the original, yet the last rank's patch then serves them all. Here one dispatcher
# stands in the attribute while any rank holds a hook, and calls the hook of the thread that calls it (as a
# process calls its own), the original elsewhere.
_HOOK_LOCK = threading.Lock()
_PATCHED: dict[tuple[int, str], tuple[Any, Any, int]] = {}  # (id(owner), name) -> (raw attribute, callable, users)
_HOOKS = threading.local()


@contextlib.contextmanager
def _rank_hook(owner: Any, name: str, hook: Callable[..., Any]) -> Iterator[None]:
    """On this thread, ``owner.name(*args, **kwargs)`` calls ``hook(original, *args, **kwargs)``."""
    key = (id(owner), name)
    with _HOOK_LOCK:
        if key in _PATCHED:
            raw, original, users = _PATCHED[key]
        else:
            raw, original, users = vars(owner)[name], getattr(owner, name), 0

            def dispatch(*args: Any, **kwargs: Any) -> Any:
                mine = getattr(_HOOKS, "by_key", {}).get(key)
                return mine(original, *args, **kwargs) if mine else original(*args, **kwargs)

            setattr(owner, name, dispatch)
        _PATCHED[key] = (raw, original, users + 1)
    hooks = _HOOKS.__dict__.setdefault("by_key", {})
    hooks[key] = hook
    try:
        yield
    finally:
        del hooks[key]
        with _HOOK_LOCK:
            raw, original, users = _PATCHED.pop(key)
            if users > 1:
                _PATCHED[key] = (raw, original, users - 1)
            else:
                setattr(owner, name, raw)


def _reduce_scatter_name() -> str:
    """The torch.distributed function FSDP2 reduce-scatters with: ``reduce_scatter_single`` where torch has it
    (2.13 does, 2.11 does not), else ``reduce_scatter_tensor``."""
    return "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


# torch: test/distributed/_composable/fsdp/test_fully_shard_frozen.py, TestFullyShardFrozen.
# test_train_mixed_requires_grad_per_group (seeded per rank; each step's input is drawn after the last step's
# collectives; two of the 12 subtests, reshard_after_forward=2 left out, 2 steps of 10)
def train_mixed_requires_grad_per_group(ctx):
    from torch.distributed._composable import checkpoint, replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction

    out = []
    # (reshard_after_forward, use_activation_checkpointing, freeze_after_init)
    subtests = [(False, False, True), (True, True, False)]
    for reshard_after_forward, use_activation_checkpointing, freeze_after_init in subtests:
        torch.manual_seed(42)
        num_mlps, lin_dim = 3, 32
        model = nn.Sequential(*[_MLP(lin_dim) for _ in range(num_mlps)])
        if not freeze_after_init:  # train biases only (as BitFit does)
            for param_name, param in model.named_parameters():
                if "bias" not in param_name:
                    param.requires_grad_(False)
        ref_model = replicate(copy.deepcopy(model), find_unused_parameters=freeze_after_init)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if freeze_after_init:
            for param_name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
                if "bias" not in param_name:
                    param.requires_grad_(False)
        expected_numel = sum(p._local_tensor.numel() for n, p in model[0].named_parameters() if "bias" in n)
        backward_count = 0

        def reduce_scatter_with_assert(
            orig: Callable[..., Any], *args: Any, expected: int = expected_numel, **kwargs: Any
        ) -> Any:
            output = args[0] if args else kwargs["output"]
            assert output.numel() == expected, (output.numel(), expected)
            return orig(*args, **kwargs)

        def backward_with_count(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            nonlocal backward_count
            backward_count += 1
            return orig(*args, **kwargs)

        torch.manual_seed(42 + ctx.rank + 1)
        with (
            _rank_hook(dist, _reduce_scatter_name(), reduce_scatter_with_assert),
            _rank_hook(RegisterPostBackwardFunction, "backward", backward_with_count),
        ):
            for iter_idx in range(2):
                inp = torch.randn((8, lin_dim))
                losses = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                _check_sharded_parity(ref_model, model)
                assert_close(losses[0], losses[1])
                # the post-backward hooks ran through autograd's backward, not the final callback (except
                # perhaps the first MLP's, whose input needs no grad)
                assert backward_count >= num_mlps - 1, backward_count
                out.append(losses[1].detach())
        out.append(_locals(model))
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_frozen.py, TestFullyShardFrozen.
# test_train_mixed_requires_grad_across_groups (seeded per rank after replicate's broadcast; the subtest with
# resharding and unfreezing of 6)
def train_mixed_requires_grad_across_groups(ctx):
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction

    num_linears, lin_dim = 6, 32
    out = []
    for reshard_after_forward, unfreeze_params in ((True, True),):
        torch.manual_seed(42)
        modules: list[nn.Module] = []
        for _ in range(num_linears):
            modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
        model = nn.Sequential(*modules)
        ref_model = replicate(copy.deepcopy(model), find_unused_parameters=True)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        backward_count = 0

        def set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
            for i in range(num_linears):
                if i % 2 == 0:  # torch's test indexes seq[i % 2], which is seq[0] each time
                    for param in seq[i % 2].parameters():
                        param.requires_grad_(requires_grad)

        def backward_with_count(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            nonlocal backward_count
            backward_count += 1
            return orig(*args, **kwargs)

        set_requires_grad(model, False)
        set_requires_grad(ref_model, False)
        num_iters, no_grad_iter_idx = 3, 1
        torch.manual_seed(42 + ctx.rank)
        inp = torch.randn((8, lin_dim))
        with _rank_hook(RegisterPostBackwardFunction, "backward", backward_with_count):
            for iter_idx in range(num_iters):
                losses = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    if unfreeze_params and iter_idx == num_iters - 1:
                        set_requires_grad(model, True)  # as torch's test does, for either model
                    if iter_idx == no_grad_iter_idx:
                        with torch.no_grad():
                            losses.append(_model(inp).sum())
                    else:
                        losses.append(_model(inp).sum())
                        losses[-1].backward()
                        _optim.step()
                        _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            assert_close(losses[0], losses[1])
            assert backward_count >= num_linears - 1, backward_count
        out.append((losses[1].detach(), _locals(model)))
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_frozen.py, TestFullyShardFrozen.
# test_multi_forward_mixed_requires_grad (a fixed seed on every rank; each step's input is drawn after the
# last step's collectives; reshard_after_forward True and False of True, False and 2; 2 steps of 10)
def multi_forward_mixed_requires_grad(ctx):
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard

    class MultiForwardModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_0 = nn.Linear(5, 5)
            self.layer_no_grad = nn.Linear(5, 5)
            self.layer_with_grad = nn.Linear(5, 5)
            self.layer_no_grad.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer_0(x)
            for _ in range(3):
                x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
                with torch.no_grad():  # the same layer again, with grad off
                    x += F.relu(self.layer_with_grad(x))
            return x

    out = []
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        for iter_idx in range(2):
            inp = torch.randn((8, 5))
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_close(losses[0], losses[1])
            out.append(losses[1].detach())
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShardSharedParams.
# test_train_shared_params_uneven_shard (seeded per rank; each step's ids are drawn after the last step's
# collectives; 3 steps of 10)
def train_shared_params_uneven_shard(ctx):
    from torch.distributed.fsdp import fully_shard

    hidden_size = 16
    vocab_size = ctx.world_size * 4 + 1  # not divisible by the world size: the last shard is padded

    class TiedModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
            self.output = nn.Linear(hidden_size, vocab_size, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.output(self.tok_embeddings(ids))

    out = []
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = TiedModel()
        fully_shard([model.tok_embeddings, model.output], reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        model.tok_embeddings.unshard()
        initial_weight = model.tok_embeddings.weight.detach().clone()
        model.tok_embeddings.reshard()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + ctx.rank)
        for _ in range(3):
            ids = torch.randint(0, vocab_size, (2, 8))
            logits = model(ids)
            loss = F.cross_entropy(logits.view(-1, vocab_size).float(), ids.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.tok_embeddings.unshard()
        final_weight = model.tok_embeddings.weight.detach().clone()
        for row in range(vocab_size):  # every row trained, the padded last shard's too
            assert not torch.equal(initial_weight[row], final_weight[row]), f"row {row} was not updated"
        model.tok_embeddings.reshard()
        out.append((loss.detach(), final_weight))
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShardHSDPTraining.
# test_train_parity_hsdp (seeded per rank; each microbatch is drawn after the last one's collectives; the
# subtest with resharding, gradient sync at the last microbatch only, mlp_dim=17, no activation checkpointing and CPU offload without pinned memory, 1 step of 5)
def train_parity_hsdp(ctx):
    from torch.distributed._composable import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    shard_size = 2 if ctx.world_size > 2 else 1
    global_mesh = init_device_mesh(
        "cpu", (ctx.world_size // shard_size, shard_size), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    out = []
    for reshard_after_forward, sync_gradients_at_last_batch in ((True, True),):
        mlp_dim, offload_policy = 17, CPUOffloadPolicy(pin_memory=False)
        torch.manual_seed(42)
        model = nn.Sequential(
            nn.LayerNorm(mlp_dim, bias=False), _MLP(mlp_dim, dim_multiplier=3), _MLP(mlp_dim), _MLP(mlp_dim, 3)
        )
        ref_model = copy.deepcopy(model)
        replicate(ref_model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            fully_shard(
                mlp, mesh=global_mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy
            )
        fully_shard(model, mesh=global_mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        _check_sharded_parity(ref_model, model)
        torch.manual_seed(42 + ctx.rank + 1)
        num_microbatches = 3
        for iter_idx in range(1):
            for microbatch_idx in range(num_microbatches):
                is_last_microbatch = microbatch_idx == num_microbatches - 1
                if sync_gradients_at_last_batch:
                    model.set_requires_gradient_sync(is_last_microbatch)
                inp = torch.randn((8, mlp_dim))
                losses = []
                for _model in (ref_model, model):
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                assert_close(losses[0], losses[1])
                out.append(losses[1].detach())
            _check_sharded_parity(ref_model, model)
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            _check_sharded_parity(ref_model, model)
    return out


class _Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class _TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = _Attention(dim, n_heads)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class _Transformer(nn.Module):
    """A small decoder after torch's test Transformer (``ModelArgs``' sizes: vocab 8, 16 positions, dim 16,
    4 heads), the output projection tied to the token embedding."""

    def __init__(self, n_layers: int = 3, vocab_size: int = 8, max_seq_len: int = 16, dim: int = 16) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(_TransformerBlock(dim, 4) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1)))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShardSharedParams.
# test_train_parity_with_shared_params (seeded per rank; each step's tokens are drawn after the last step's
# collectives; the subtest with resharding and activation checkpointing of 4, 2 layers of 3, 2 steps of 10)
def train_parity_with_shared_params(ctx):
    from torch.distributed._composable import checkpoint, replicate
    from torch.distributed.fsdp import fully_shard

    out = []
    for reshard_after_forward, use_activation_checkpointing in ((True, True),):
        torch.manual_seed(42)
        model = _Transformer(n_layers=2)
        ref_model = copy.deepcopy(model)
        replicate(ref_model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, _TransformerBlock):
                if use_activation_checkpointing:
                    checkpoint(module)
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + ctx.rank + 1)
        for iter_idx in range(2):
            inp = torch.randint(0, model.vocab_size, (2, 16))
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_close(losses[0], losses[1])
            out.append(losses[1].detach())
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShard1DTrainingCore.
# test_multi_forward_module (seeded per rank after replicate's broadcast; reshard_after_forward True and False
# of True, False and 2; 2 steps of 10)
def multi_forward_module(ctx):
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard

    class MultiForwardModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.outer = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(self.inner(x) + self.inner(x))

    out = []
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = copy.deepcopy(model)
        replicate(ref_model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + ctx.rank)
        inp = torch.randn((32, 4))
        for iter_idx in range(2):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_close(losses[0], losses[1])
            out.append(losses[1].detach())
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShard1DTrainingCore.
# test_train_parity_single_group_shard_dim0 (seeded per rank after replicate's broadcast; the two subtests of 3
# whose first weights, of 15 and 17 rows, shard unevenly at W = 2, 3 and 4; 2 steps of 10)
def train_parity_single_group_shard_dim0(ctx):
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard

    out = []
    for lin_shapes in ([(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
        ref_model = copy.deepcopy(model)
        replicate(ref_model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + ctx.rank + 1)
        inp = torch.randn((4, lin_shapes[0][0]))
        for iter_idx in range(2):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_close(losses[0], losses[1])
            out.append(losses[1].detach())
        out.append(_locals(model))
    return out


# torch: test/distributed/_composable/fsdp/test_fully_shard_training.py, TestFullyShard1DTrainingCore.
# test_non_root_forward_backward (seeded per rank after the model is built; torch's test sleeps on the device
# after the root's backward so that the non-root's must wait for its streams: on CPU nothing runs apart)
def non_root_forward_backward(ctx):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(42)
    lin_dim = 32
    model = nn.Sequential(*[_MLP(lin_dim) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + ctx.rank)
    inp = torch.randn((8, lin_dim))

    def average_ref_grads() -> None:
        for param in ref_model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.detach().div_(ctx.world_size)

    ref_root_loss = ref_model(inp).sum()
    ref_root_loss.backward()
    average_ref_grads()
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref_model[0](inp).sum()
    ref_nonroot_loss.backward()
    average_ref_grads()
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()

    assert_close(ref_root_loss, root_loss)
    assert_close(ref_nonroot_loss, nonroot_loss)
    final = model(inp).sum()
    assert_close(ref_model(inp).sum(), final)
    return root_loss.detach(), nonroot_loss.detach(), final.detach(), _locals(model)


CORPUS = [
    linear_op_reductions,
    layer_norm_bwd,
    layer_norm_bwd_req_grad,
    dist_p_norms,
    partial_reduction_ops,
    shard_to_replicate_forward_backward_float32,
    shard_to_replicate_forward_backward_complex,
    replicate_to_shard_forward_backward,
    replicate_to_replicate_datatype_conversion,
    shard_to_replicate_datatype_conversion,
    mlp_training,
    mlp_training_sequence_parallel,
    weight_tying,
    loss_parallel_cross_entropy,
    modules_with_meta_dtensor,
    metadata_consistency_check,
    scatter_1d,
    unused_forward_output,
    unused_forward_module,
    nontensor_activations,
    train_mixed_requires_grad_per_group,
    train_mixed_requires_grad_across_groups,
    multi_forward_mixed_requires_grad,
    train_shared_params_uneven_shard,
    train_parity_hsdp,
    train_parity_with_shared_params,
    multi_forward_module,
    train_parity_single_group_shard_dim0,
    non_root_forward_backward,
]

_EVEN_TP = "torch runs it at W=4: {what}, which torch's tensor parallel styles do not shard unevenly (at W=3 it fails alike on both worlds)"

#: Sizes a body cannot take, and why.
SKIPS: dict[tuple[Callable[..., Any], int], str] = {
    (train_parity_hsdp, 3): "torch's HSDP test shards over 2 ranks and replicates over W/2: W must be even",
    (mlp_training, 3): _EVEN_TP.format(what="16 hidden features"),
    (mlp_training_sequence_parallel, 3): _EVEN_TP.format(what="16 hidden features"),
    (weight_tying, 3): _EVEN_TP.format(what="an embedding of dim 8"),
    (modules_with_meta_dtensor, 3): _EVEN_TP.format(what="1024 hidden features"),
    (layer_norm_bwd_req_grad, 3): _EVEN_TP.format(what="a sequence of 8 (SequenceParallel all-gathers its shards)"),
    (train_mixed_requires_grad_per_group, 3): (
        "torch's reduce-scatter check expects the unpadded local numel of the biases (128 and 32 elements), which "
        "FSDP pads at W=3 (54 vs 52 on rank 2, alike on both worlds); torch runs it at W=2 or 4"
    ),
}

# gloo reduces in the order of its own algorithm, the threaded world folds in rank order, and FSDP and DDP divide
# gradients before or after the sum according to what the backend offers: results that pass through a float
# all-reduce or reduce-scatter differ in the last bits (seen: 1e-7 relative on TP outputs and FSDP losses, 6e-7
# on a transformer's loss after two Adam steps). A generator shared by rank threads gives other numbers
# altogether, far outside these tolerances.
_REDUCED = {"rtol": 1e-4, "atol": 1e-5}
TOLERANCES: dict[Callable[..., Any], dict[str, float]] = {
    body: _REDUCED
    for body in (
        dist_p_norms,
        partial_reduction_ops,
        mlp_training,
        mlp_training_sequence_parallel,
        weight_tying,
        loss_parallel_cross_entropy,
        modules_with_meta_dtensor,
        unused_forward_output,
        unused_forward_module,
        nontensor_activations,
        train_mixed_requires_grad_per_group,
        train_mixed_requires_grad_across_groups,
        multi_forward_mixed_requires_grad,
        train_shared_params_uneven_shard,
        train_parity_hsdp,
        train_parity_with_shared_params,
        multi_forward_module,
        train_parity_single_group_shard_dim0,
        non_root_forward_backward,
    )
}


def _cases() -> list[Any]:
    # linear_op_reductions also found a divergence of its own: DTensor's any() (torch 2.11-2.13) all-reduces its
    # partial result as a bool SUM, which gloo adds as bytes (0x02 at W=2) and the threaded world wrote as 0x01
    # (E1); fixed in collectives/base.py, checked by tests/test_bool_sums.py
    return [pytest.param(body, w, id=f"{body.__name__}-{w}") for body in CORPUS for w in (2, 3, 4)]


@pytest.mark.parametrize(("body", "world_size"), _cases())
def test_seeded_torch_tests_match_across_worlds(body, world_size):
    if (body, world_size) in SKIPS:
        pytest.skip(SKIPS[body, world_size])
    dstest.crosscheck(body, world_size, **TOLERANCES.get(body, {}))


def test_the_corpus_is_issue_42s():
    assert len(CORPUS) == len(set(CORPUS)) == 29
