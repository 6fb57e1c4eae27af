"""torch's default CPU generator, one per rank: rank threads draw from their own, as processes do (contract E5).

A process has one default CPU generator; rank threads of one process share it, so ``torch.manual_seed(s)``
on each rank followed by draws interleaves the ranks' numbers, and each rank gets other values than its
process would. Here each rank thread (and each thread it starts) has a ``torch.Generator`` of its own, and
every draw on such a thread that names no generator uses it:

- Every aten operator that takes ``Generator? generator`` gets a Python kernel at a dispatch key of its own
  (:func:`_drawing_kernel`) which puts the rank's generator in that argument and calls the operator again
  without the key, through the whole stack below (autograd, DTensor, fake tensors, the CPU kernel); every
  other operator falls through the key (a backend fallthrough, free). The key is torch's
  ``TESTING_ONLY_GenericMode``, a functionality key torch reserves for code outside its tree and never sets
  itself: its kernels run only where dstest includes it. (``CustomRNGKeyId`` would name the purpose, but
  torch counts it among the backends of its composite kernels: with it included, every operator with a
  composite kernel ran that kernel at it: scalar arithmetic cost 1.5 times as much and fake-tensor
  decompositions recursed without end.) Seen on torch 2.11, 2.13 and 2.15.
- The key is in the dispatch set only of threads that include it in their thread-local set: a rank thread
  enters :func:`rank_generator` around its body. Other threads, and every operator on them, never see the
  key; draws there use torch's own generator as always.
- What draws dispatches through such an operator: ``torch.randn``/``rand``/``randint``/``randperm``/
  ``normal``, ``Tensor.normal_``/``uniform_``/``bernoulli_``/``random_``/``exponential_``, dropout,
  ``nn.init.*``, ``multinomial``, and C++ kernels that call them (dropout calls ``bernoulli_``).
- ``torch.manual_seed``, ``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state`` and
  ``torch.set_rng_state`` (and ``torch.random``'s, which ``torch.random.fork_rng`` and activation
  checkpointing use) act on the calling rank's generator (:mod:`.wrappers`).

An operator that does not draw costs the same with the key included (a fallthrough is resolved when the
dispatch table is built); a draw costs a Python call more (a few microseconds; ``benchmarks/bench_rank_rng.py``
measures whole steps with and without the key). Not isolated: tensors on CUDA draw from the device's generator, which rank threads still
share (the threaded world's CPU ranks never have one); and ``torch.default_generator`` itself, used by name
(its methods, ``generator=torch.default_generator``), which the threaded world reports as a note on failure.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["current_generator", "draws_dispatch_per_rank", "rank_generator"]

#: The dispatch key of the drawing kernels (not in torch's Python enum; parsed by name; see the module doc).
_KEY_NAME = "TESTING_ONLY_GenericMode"


class _Local(threading.local):
    generator: torch.Generator | None = None


_LOCAL = _Local()
_REGISTER_LOCK = threading.Lock()
_LIBRARIES: list[Any] = []  # the registrations live as long as these do: the whole process


def current_generator() -> torch.Generator | None:
    """The calling rank thread's own generator (None on other threads)."""
    return _LOCAL.generator


@functools.cache
def _key() -> Any:
    return torch._C._parse_dispatch_key(_KEY_NAME)


def _drawing_operators() -> list[tuple[str, str, int, bool]]:
    """Every aten operator with an optional generator: (qualified overload, argument name, index, keyword-only)."""
    found = []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        for index, arg in enumerate(schema.arguments):
            if str(arg.type) == "Optional[Generator]":
                name = schema.name[len("aten::") :] + (f".{schema.overload_name}" if schema.overload_name else "")
                found.append((name, arg.name, index, bool(arg.kwarg_only)))
                break
    return found


def _generator_twins() -> list[tuple[str, Any, str, int, bool]]:
    """Drawing operators without a generator argument and their twin with one (``randn`` and
    ``randn.generator``, ``randint.low`` and ``randint.low_generator``...): (qualified overload, the twin,
    the twin's argument name, index, keyword-only). Their kernels call the generator overload themselves,
    below every key; under a dispatch mode (``CommDebugMode``) that inner call runs inside the mode's handler,
    where torch excludes dstest's key, so the draw must get the rank's generator at the outer call."""
    by_packet: dict[str, list[Any]] = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            by_packet.setdefault(schema.name[len("aten::") :], []).append(schema)
    found = []
    for packet, schemas in by_packet.items():
        drawing = [s for s in schemas if any(str(a.type) == "Optional[Generator]" for a in s.arguments)]
        for schema in schemas:
            if schema in drawing:
                continue
            shape = [(a.name, str(a.type)) for a in schema.arguments]
            for twin in drawing:
                if [(a.name, str(a.type)) for a in twin.arguments if a.name != "generator"] == shape:
                    index = [a.name for a in twin.arguments].index("generator")
                    op = getattr(getattr(torch.ops.aten, packet), twin.overload_name or "default")
                    qualified = packet + (f".{schema.overload_name}" if schema.overload_name else "")
                    found.append((qualified, op, "generator", index, bool(twin.arguments[index].kwarg_only)))
                    break
    return found


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _drawing_kernel(op: Any, arg: str, index: int, kwarg_only: bool, twin: Any = None) -> Callable[..., Any]:
    """The kernel at dstest's key for one drawing operator: the rank's generator where the caller gave
    none, for draws on the CPU; then the operator again, below the key. (A generator reaches a kernel as a
    new Python object, so ``generator=torch.default_generator`` cannot be told from a generator of the
    caller's: it is left as given.) With ``twin`` (an overload without a generator argument, ``op`` being
    its twin with one): the twin is called where the rank's generator goes in."""
    below = torch._C.DispatchKeySet(_key())

    def draw(*args: Any, **kwargs: Any) -> Any:
        gen = _LOCAL.generator
        if twin is not None:
            tensor = _first_tensor(args, kwargs)
            device = tensor.device.type if tensor is not None else kwargs.get("device")
            with torch._C._ExcludeDispatchKeyGuard(below):
                if gen is None or not (device is None or torch.device(device).type == "cpu"):
                    return twin(*args, **kwargs)
                if kwarg_only:
                    return op(*args, **kwargs, **{arg: gen})
                return op(*args[:index], gen, *args[index:], **kwargs)
        if gen is not None:
            positional = not kwarg_only and len(args) > index
            given = args[index] if positional else kwargs.get(arg)
            if given is None:
                tensor = _first_tensor(args, kwargs)
                device = tensor.device.type if tensor is not None else kwargs.get("device")
                if device is None or torch.device(device).type == "cpu":
                    if positional:
                        args = (*args[:index], gen, *args[index + 1 :])
                    else:
                        kwargs[arg] = gen
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return draw


def draws_dispatch_per_rank() -> None:
    """Register the drawing kernels and the fallthrough, once per process (about 0.2 s, at a first rank thread)."""
    with _REGISTER_LOCK:
        if _LIBRARIES:
            return
        library: Any = torch.library  # untyped in torch
        fallthrough = library.Library("_", "IMPL")  # a backend fallthrough for the key, for every operator
        try:
            fallthrough.fallback(library.fallthrough_kernel, dispatch_key=_KEY_NAME)
        except RuntimeError as exc:  # code outside torch took the key first
            raise RuntimeError(
                f"dstest gives each rank thread its own generator through torch's dispatch key {_KEY_NAME}, "
                f"and something in this process registered kernels at it first ({exc}). Run such code on "
                'world="process", where ranks are processes with generators of their own.'
            ) from exc
        kernels = library.Library("aten", "IMPL")
        for name, arg, index, kwarg_only in _drawing_operators():
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            kernels.impl(name, _drawing_kernel(op, arg, index, kwarg_only), _KEY_NAME)
        for name, twin_op, arg, index, kwarg_only in _generator_twins():
            packet, _, overload = name.partition(".")
            plain = getattr(getattr(torch.ops.aten, packet), overload or "default")
            kernels.impl(name, _drawing_kernel(twin_op, arg, index, kwarg_only, twin=plain), _KEY_NAME)
        _LIBRARIES.extend([fallthrough, kernels])


@contextlib.contextmanager
def rank_generator(generator: torch.Generator) -> Iterator[None]:
    """On a rank thread, or a thread a rank started: draws that name no generator use ``generator``."""
    draws_dispatch_per_rank()
    previous = _LOCAL.generator
    _LOCAL.generator = generator
    try:
        with torch._C._IncludeDispatchKeyGuard(_key()):
            yield
    finally:
        _LOCAL.generator = previous
