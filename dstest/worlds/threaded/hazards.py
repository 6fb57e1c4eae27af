"""Async hazards (opt-in): a collective's or irecv's outputs hold a poison value until the rank waits.

With ``async_hazards=True`` (``@dstest.spec(async_hazards=True)``, ``dstest.run(..., async_hazards=True)``
or ``--dstest-async-hazards``), the threaded world makes every output tensor of a collective and of a
recv unreadable from the moment the call is posted until ``wait()`` returns or the work's future
completes: the result is delivered into private buffers and copied in at the wait. A blocking call (``async_op=False``) waits at once, so
it sees no difference; code that reads the result of an ``async_op=True`` call or an ``irecv`` before
waiting reads the poison and fails the same way on every run:

- floating and complex tensors: NaN;
- integer tensors: every byte 0xA5 (int32: -1515870811, uint8: 165, int64: -6510615555426900571);
- bool tensors: True.

Inputs are copied when the call is posted, so an output that is also an input (in-place all_reduce, an
all-gather whose input is a slice of its output) is poisoned without changing what the rank sends.
A handle that is never waited fails the run with :class:`dstest.errors.UnfinishedWork`, as without the
option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dstest.worlds.collectives.base import raw_writes

__all__ = ["POISON_BYTE", "guard_call", "guard_recv", "poison", "poison_value"]

POISON_BYTE = 0xA5


def poison_value(dtype: torch.dtype) -> float | int | bool | complex:
    """The value every element of an unwaited output of ``dtype`` holds."""
    if dtype.is_complex:
        return complex(float("nan"), float("nan"))
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    size = torch.empty((), dtype=dtype).element_size()
    return int.from_bytes(bytes([POISON_BYTE]) * size, "little", signed=dtype.is_signed)


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with :func:`poison_value` of its dtype (below autograd: no version change, which would
    fail a backward through a saved tensor that a backend leaves alone until it writes the result)."""
    if t.is_quantized:
        return  # no value to fill a quantized tensor with; it is left as it is
    with raw_writes():
        t.fill_(poison_value(t.dtype))


def _private(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """What the wait runs: each private result into the caller's tensor, once, below autograd whatever the
    waiting thread's grad mode (the versions changed as gloo's changed them when the result was formed)."""
    done: list[bool] = []

    def after() -> None:
        if done:
            return
        done.append(True)
        with raw_writes():
            for user, mine in pairs:
                user.copy_(mine)

    return after


def guard_call(call: Any) -> Callable[[], None] | None:
    """Give ``call`` (a ``collectives.Call`` as it is posted) private copies of its inputs and private
    outputs, and poison the caller's outputs; returns what the wait runs to copy the result in (None
    when the call has no output on this rank)."""
    op = call.op
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if op in ("all_reduce", "reduce", "broadcast"):
        user = call.tensor
        is_output = (
            op == "all_reduce"
            or (op == "reduce" and call.group_rank == call.root)
            or (op == "broadcast" and call.group_rank != call.root)
        )
        if not is_output:
            return None
        call.tensor = _private(user)  # the input as posted; the result lands here
        call.outputs = lambda: [user]
        pairs.append((user, call.tensor))
    else:
        if hasattr(call, "inp"):
            call.inp = _private(call.inp)
        if hasattr(call, "inps"):
            call.inps = [_private(t) for t in call.inps]
        if hasattr(call, "out"):
            user_out = call.out
            call.out = torch.empty_like(user_out)
            pairs.append((user_out, call.out))
            call.outputs = lambda: [user_out]
        if getattr(call, "outs", None):
            users = list(call.outs)
            call.outs = [torch.empty_like(t) for t in users]
            pairs.extend(zip(users, call.outs))
            call.outputs = lambda: users
    if not pairs:
        return None
    for user, _ in pairs:
        poison(user)
    return _copy_back(pairs)


def guard_recv(wait: Any) -> None:
    """Make a recv (a ``waits.P2PWait`` not yet posted) land in a private buffer, copied into the
    caller's tensor when the rank waits; poison the caller's tensor until then."""
    user = wait.tensor
    buffer = torch.empty_like(user)
    wait.tensor = buffer
    wait.after = _copy_back([(user, buffer)])
    wait.outputs = lambda: [user]
    poison(user)
