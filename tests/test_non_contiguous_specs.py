"""The non-contiguous call-site specs (dstest/conformance/non_contiguous.py, contract A7 at the call sites of A6).

They run against impl in the conformance suite (tests/test_conformance_abc.py). Here: their layouts really
are views that are not contiguous, and each spec goes red on the bug it exists for, a reduction whose result
lands in a contiguous copy that is then dropped, which the contiguous specs of A6 let through.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dstest
from dstest.conformance import non_contiguous as nc
from dstest.conformance import optional_groups as a
from dstest.errors import RankFailure

pytestmark = pytest.mark.cpu


_SHAPES = [(6, 5), (2, 3, 11), (2, 2, 3), (0, 4, 5)]


@pytest.mark.parametrize(
    ("layout", "shape"), [(k, s) for k in nc.LAYOUTS for s in _SHAPES if k != "permuted" or len(s) == 3]
)
def test_a_layout_is_a_view_equal_to_the_full_tensor(layout: str, shape: tuple[int, ...]) -> None:
    """The permuted layout is for tensors of 3 dimensions (sequence-first batches)."""
    full = torch.randn(shape, dtype=torch.float64)
    stored = nc._store(full, layout)
    view = nc._view(stored, layout)
    assert stored.is_contiguous() and torch.equal(view, full)
    if full.numel():
        assert view.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr(), (
            f"{layout} {shape}: not a view of the stored tensor"
        )
        assert not view.is_contiguous(), f"{layout} {shape}: the view is contiguous"


def _column_reduces_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """impl's column layer backward all-reduces a contiguous copy of the input gradient and returns the original."""
    from impl.comm.collectives import all_reduce
    from impl.parallel import mappings

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        all_reduce(grad.contiguous(), ctx.group)
        return grad, None

    monkeypatch.setattr(mappings._CopyToRegion, "backward", staticmethod(backward))


def test_pair_spec_catches_a_dropped_backward_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    _column_reduces_a_copy(monkeypatch)
    dstest.run(a.test_a6_tensor_parallel_linear_pair, 2, kwargs={"kind": "multi"})  # contiguous: not seen
    with pytest.raises(RankFailure, match="gradient of the input"):
        dstest.run(nc.test_a7_tensor_parallel_pair_views, 2, kwargs={"kind": "multi", "layout": "transposed"})


def test_zero_spec_catches_a_dropped_backward_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    _column_reduces_a_copy(monkeypatch)
    dstest.run(a.test_a6_zero_model_parallel_reductions, 2, kwargs={"kind": "multi", "stage": 1})
    with pytest.raises(RankFailure, match="gradient of w0"):
        dstest.run(nc.test_a7_zero_model_parallel_views, 2, kwargs={"kind": "multi", "stage": 1})


@pytest.mark.parametrize("layout", nc.LAYOUTS)
def test_guarded_spec_catches_a_dropped_write_back(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    from impl.comm import collectives

    def reduce_a_copy(tensor: torch.Tensor, fn: Any) -> torch.Tensor:
        fn(tensor.contiguous())
        return tensor

    monkeypatch.setattr(collectives, "_with_contiguous", reduce_a_copy)
    with pytest.raises(RankFailure, match=f"multi/{layout}: the view"):
        dstest.run(nc.test_a7_guarded_all_reduce_views, 2, kwargs={"kind": "multi", "layout": layout})


def test_deepspeed_layers_get_the_weight_in_its_own_layout() -> None:
    """The DeepSpeed adapter hands AutoTP a ``torch.nn.Linear`` whose weight keeps the strides it was given
    (no DeepSpeed needed: the layer is plain torch)."""
    from dstest.targets.deepspeed import DeepSpeedTarget

    stored = torch.randn(5, 7)
    layer = DeepSpeedTarget._linear(stored.t(), torch.randn(7))
    assert layer.weight.stride() == stored.t().stride() and torch.equal(layer.weight, stored.t())
    assert layer.weight.data_ptr() != stored.data_ptr(), "a copy: the caller's tensor is not the layer's"
