"""dstest's Python process groups, seen by torch's dispatcher as a C++ backend's are (contract E16).

A Python subclass of ``dist.ProcessGroup`` that defines ``allreduce`` is called directly by
``dist.all_reduce``: the dispatcher's ``c10d::allreduce_`` op never runs, so nothing that watches the
dispatcher sees the call (``CommDebugMode`` counts nothing, profilers record nothing, a tensor subclass's
``__torch_dispatch__`` is skipped). torch's own groups go the other way: the C++ ``ProcessGroup`` method
calls the op, and the op's CPU kernel calls the group's backend. dstest's groups take the same road:
:func:`dispatched` hands the call to the C++ base method (the same one torch's groups run), which issues
the op; every mode and profiler sees it as on gloo; then a kernel of dstest's at the op's ``BackendSelect``
key (the last stop before the CPU kernel, after every mode) finds the call it was handed, and runs the
group's own implementation with the caller's own arguments. Groups that are not dstest's pass through to
torch's kernel untouched.

Seen on torch 2.11-2.15: the C++ base methods issue the ops named in :data:`_ROUTES` (2.11 lacks the
``*_single`` spellings, which dstest does not route by); the op's process group arrives as a
``ScriptObject`` that ``ProcessGroup.unbox`` turns back into the Python group; a Python work handle
returned ``boxed()`` keeps its Python class only while the Python object lives, so the handle is held
until the base method returns it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from dstest.errors import InvalidArgument
from dstest.worlds.torch_internals.process_groups import WorkBase

__all__ = ["DISPATCHED_OPS", "DispatchedGroup", "DispatchedWork", "dispatched", "observed"]


def _newest(name: str, before: str) -> str:
    """``name`` where this torch's ``ProcessGroup`` has it, else the older releases' ``before``: torch 2.15's
    C++ ``_allgather_base`` looks for a Python override by its new name ``all_gather_single`` too, so only a
    frame of the new name reaches the base (2.11 has only the old one)."""
    return name if hasattr(dist.ProcessGroup, name) else before


#: Each routed c10d method of dstest's table: the C++ base method that issues the op ("" where the op is
#: issued itself, see :func:`_issue_op`), and the op.
_ROUTES: dict[str, tuple[str, str]] = {
    "allreduce": ("allreduce", "allreduce_"),
    "allreduce_coalesced": ("allreduce_coalesced", "allreduce_coalesced_"),
    "broadcast": ("broadcast", "broadcast_"),
    "reduce": ("reduce", "reduce_"),
    "allgather": ("allgather", "allgather_"),
    "_allgather_base": (_newest("all_gather_single", "_allgather_base"), "_allgather_base_"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_"),
    "_reduce_scatter_base": (_newest("reduce_scatter_single", "_reduce_scatter_base"), "_reduce_scatter_base_"),
    "alltoall": ("alltoall", "alltoall_"),
    "alltoall_base": ("", "alltoall_base_"),
    "gather": ("gather", "gather_"),
    "scatter": ("scatter", "scatter_"),
    "barrier": ("barrier", "barrier"),
    "all_gather_single_coalesced": ("", "allgather_into_tensor_coalesced_"),
    "reduce_scatter_single_coalesced": ("", "reduce_scatter_tensor_coalesced_"),
    "send": ("send", "send"),
    "recv": ("recv", "recv_"),
}

#: The dispatcher ops dstest's groups issue (``c10d::<name>``).
DISPATCHED_OPS: tuple[str, ...] = tuple(sorted({op for _, op in _ROUTES.values()}))


class DispatchedGroup(dist.ProcessGroup):
    """The base of dstest's process groups in both worlds: what torch asks of any group, said once.

    A subclass gives ``backend_name`` (what ``dist.get_backend`` reports), ``always_dispatched`` (False:
    through the dispatcher only while something watches it, see :func:`observed`) and
    ``_issue_c10d(method, args)``, its implementation of one c10d method of ``dstest.worlds.core.c10d``'s
    table; ``core.c10d.install`` gives it the methods themselves, which call :meth:`_c10d`.
    """

    backend_name = "dstest"
    always_dispatched = True

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload has no stub
        self._group_name = ""
        self._group_desc = ""
        self._split_store: Any = None

    def _issue_c10d(self, method: Any, args: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _c10d(self, method: Any, args: dict[str, Any]) -> Any:
        if _HANDED.group is self:  # torch's base method called the Python method back: a new torch's rule
            raise RuntimeError(
                f"dstest: torch {torch.__version__}'s ProcessGroup.{method.name} called dstest's method back "
                "instead of issuing its dispatcher op (see dstest.worlds.torch_internals.dispatched)"
            )
        if self.always_dispatched or observed(args):
            return dispatched(self, method, args)
        return self._issue_c10d(method, args)

    # -- names: torch 2.11-2.15 set them through either spelling, and read them as properties --------------
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupName(self) -> str:
        return self._group_name

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def getBackendName(self) -> str:
        return self.backend_name

    def name(self) -> str:
        return self.backend_name

    def get_group_store(self) -> Any:
        """The store a split group was made over (torch records it for the group)."""
        return self._split_store

    @property
    def supports_splitting(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class DispatchedWork(WorkBase):  # type: ignore[misc]
    """The base of the work handles of both worlds' groups: what every handle answers the same way.

    A subclass gives ``wait``, ``is_completed``, ``result``, ``get_future`` and, where a call can fail,
    ``exception``; success is completion without an exception, as on gloo; a handle that is no transfer has
    no source rank.
    """

    def is_success(self) -> bool:
        return bool(self.is_completed()) and self.exception() is None

    def exception(self) -> BaseException | None:
        return None

    def source_rank(self) -> int:
        return -1


class _Handed(threading.local):
    """The call :func:`dispatched` handed to the base method, until the kernel takes it (per thread)."""

    group: DispatchedGroup | None = None
    method: Any = None
    args: dict[str, Any] | None = None
    work: Any = None


_HANDED = _Handed()
_install_lock = threading.Lock()
_library: Any = None  # torch.library.Library("c10d", "IMPL"), kept alive while the process lives


def observed(args: dict[str, Any]) -> bool:
    """Whether anything watches the dispatcher on this thread: a dispatch mode (``CommDebugMode``, fake
    tensors, ``DebugMode``), the profiler, or a tensor subclass among the call's tensors. On every collective
    of the threaded world: plain type tests, no isinstance of a union."""
    if _dispatch_modes() or _profiler._is_profiler_enabled:
        return True
    for value in args.values():
        kind = type(value)
        if kind is list or kind is tuple:
            # the kinds of a list's items in C (a list all_gather's W outputs), each kind tested once
            for inner in set(map(type, value)):
                if inner is list or inner is tuple:
                    for item in value:
                        if type(item) is inner and any(_subclass(k) for k in set(map(type, item))):
                            return True
                elif _subclass(inner):
                    return True
        elif _subclass(kind):
            return True
    return False


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, int, float, str, type(None)))
_dispatch_modes = torch._C._len_torch_dispatch_stack
_profiler = torch.autograd.profiler


def _subclass(kind: type) -> bool:
    """A tensor class other than torch's own (a subclass with its own ``__torch_dispatch__``)."""
    return kind not in _PLAIN and issubclass(kind, torch.Tensor)


def dispatched(group: DispatchedGroup, method: Any, args: dict[str, Any]) -> Any:
    """Run ``group``'s c10d ``method`` through torch's dispatcher (see the module's docstring)."""
    route = _ROUTES.get(method.name)
    if route is None:
        return group._issue_c10d(method, args)
    _install_kernels()
    if method.options and args.get("opts") is None:
        from dstest.worlds.torch_internals.c10d_classes import c10d_options

        args["opts"] = c10d_options(method.options)
    handed = _HANDED
    handed.group, handed.method, handed.args = group, method, args
    try:
        if route[0]:
            _base_method(route[0])(group, *[args[p] for p in method.params])
        else:
            _issue_op(group, route[1], args)
    finally:
        missed = handed.group is not None
        work, handed.work = handed.work, None
        handed.group = handed.method = handed.args = None
    if missed:
        raise RuntimeError(
            f"dstest: {method.name} on {group!r} did not reach the dispatcher op c10d::{route[1]} "
            f"(torch {torch.__version__} issues another op from ProcessGroup.{route[0]})"
        )
    return work


def _issue_op(group: DispatchedGroup, op: str, args: dict[str, Any]) -> None:
    """Issue the op itself, for the methods whose C++ base no Python frame reaches: torch 2.13-2.15 look for
    an override of ``alltoall_base`` and of the two tensor-coalesced methods by both of their names, and a
    frame has one name. Their reduce op (the tensor-coalesced reduce-scatter's) can only be made as SUM from
    Python: a dispatch mode sees SUM there whatever the caller asked; dstest runs the caller's own."""
    opts = args["opts"]
    timeout = getattr(opts, "timeout", None)
    millis = -1 if timeout is None else int(timeout.total_seconds() * 1000)
    ops, pg = torch.ops.c10d, group.boxed()
    if op == "alltoall_base_":
        out, inp, splits = args["output"], args["inp"], (args["output_split_sizes"], args["input_split_sizes"])
        ops.alltoall_base_(out, inp, pg, list(splits[0]), list(splits[1]), True, millis)
    elif op == "allgather_into_tensor_coalesced_":
        ops.allgather_into_tensor_coalesced_(list(args["outputs"]), list(args["inputs"]), pg, True)
    else:
        assert op == "reduce_scatter_tensor_coalesced_", op
        summed = torch.classes.c10d.ReduceOp()
        ops.reduce_scatter_tensor_coalesced_(list(args["outputs"]), list(args["inputs"]), pg, summed, True, millis)


_BASE_METHODS: dict[str, Any] = {}


def _base_method(name: str) -> Any:
    """torch's C++ ``ProcessGroup.<name>``, callable on a group whose class overrides ``name``.

    pybind11 (torch 2.11-2.15) sends a C++ virtual call of a Python subclass back to the Python override,
    except when the calling Python frame is a function of the method's own name whose first argument is the
    same object (how an override calls its base): the caller made here is that frame.
    """
    caller = _BASE_METHODS.get(name)
    if caller is None:
        base = getattr(dist.ProcessGroup, name)

        def call(self: Any, *args: Any) -> Any:
            return base(self, *args)

        call.__code__ = call.__code__.replace(co_name=name)
        caller = _BASE_METHODS[name] = call
    return caller


def _install_kernels() -> None:
    """Register the kernels once per process (never at import)."""
    global _library
    if _library is not None:
        return
    with _install_lock:
        if _library is not None:
            return
        library_module: Any = torch.library  # untyped in torch
        library = library_module.Library("c10d", "IMPL")
        for op in DISPATCHED_OPS:
            overload = getattr(torch.ops.c10d, op).default
            library.impl(op, _kernel(overload), "BackendSelect", with_keyset=True)
        _library = library


_NOT_TENSORS = frozenset(("opts", "dst", "src", "tag", "output_split_sizes", "input_split_sizes"))


def _tensor_params(method: Any) -> list[str]:
    """The method's tensor parameters, in the order the op takes them before its process group (torch
    2.11-2.15: ``allreduce_(tensors, ...)``, ``_allgather_base_(output, input, ...)``, ``barrier(tensor, ...)``
    whose tensor the method does not have)."""
    return [p for p in method.params if p not in _NOT_TENSORS]


def _kernel(overload: Any) -> Any:
    schema = overload._schema
    group_at = [a.name for a in schema.arguments].index("process_group")
    pair = len(schema.returns) == 2  # (outputs, work): the outputs are the op's first argument
    below = torch._C.DispatchKey.BackendSelect

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        handed = _HANDED
        group = handed.group
        if group is not None and dist.ProcessGroup.unbox(args[group_at]) is group:
            method, bound = handed.method, handed.args
            handed.group = handed.method = handed.args = None
            assert bound is not None
            for param, value in zip(_tensor_params(method), args[:group_at]):
                bound[param] = value  # what reached the op: a tensor subclass or a mode may have unwrapped it
            work = group._issue_c10d(method, bound)
            handed.work = work  # alive until dispatched() returns it (boxed, it keeps its class only so)
            boxed = work.boxed()
            return (args[0], boxed) if pair else boxed
        if group is None and isinstance(dist.ProcessGroup.unbox(args[group_at]), DispatchedGroup):
            raise InvalidArgument(
                f"c10d::{schema.name.split('::')[-1]} was called directly on a dstest group; call the group's "
                "method or torch.distributed's function instead (dstest reads the call's options from there)"
            )
        return overload.redispatch(keyset.remove(below), *args, **kwargs)

    return kernel
