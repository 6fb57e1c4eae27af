"""Writing tensors as a backend's C++ writes them: below autograd, with version counters set by hand.

gloo and NCCL write a collective's results through raw pointers, so autograd never sees those writes. The
threaded world copies with torch's own ops instead, and needs three private pieces of torch to make those
copies look the same (:mod:`dstest.worlds.collectives.base` uses them for every collective).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["below_autograd", "foreach_copy", "set_version_counters"]


def below_autograd() -> Any:
    """A context in which ops dispatch below autograd and its view and version bookkeeping.

    ``torch._C._AutoDispatchBelowADInplaceOrView`` (torch 2.11-2.15): inside it, a copy into a split view of
    a parameter is not refused whatever the grad mode, and a tensor saved for backward is not marked as
    changed, as with a write gloo makes in C++.
    """
    return torch._C._AutoDispatchBelowADInplaceOrView()


def set_version_counters(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Set each tensor's version counter to its version (tensors that share a counter: the last one wins).

    ``torch._C._autograd._unsafe_set_version_counter`` (torch 2.11-2.15 take tuples of tensors and of
    versions): the version change a write in C++ would make, applied after a copy below autograd.
    """
    torch._C._autograd._unsafe_set_version_counter(tensors, versions)


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair in one call: ``torch._foreach_copy_`` (torch 2.11-2.15).

    Raises RuntimeError or TypeError on what it does not take (mixed devices or dtypes); callers then copy
    one pair at a time.
    """
    torch._foreach_copy_(dsts, srcs)
