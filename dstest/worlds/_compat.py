"""Everything that depends on torch internals, in one place (the tox matrix exercises it per version).

Each function names the torch behaviour it papers over. Nothing here runs at import time.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "FreshRunState",
    "WorkBase",
    "adopt_rank_state",
    "backend_registered",
    "c10d_state",
    "current_rank_state",
    "declare_self_recording",
    "drop_subgroups",
    "hash_store",
    "hold_late_imports",
    "init_rank_process_group",
    "linked_future",
    "new_rank_state",
    "reduce_op_name",
    "thread_local_c10d_world",
    "thread_local_c10d_world_ensure",
]


class _GroupTable(dict):  # type: ignore[type-arg]
    """One of c10d's per-group tables, keyed by process group, that also answers for a *foreign* group.

    A group object that crossed to another rank's thread (a module-level cache, a default argument
    evaluated once) is looked up as the calling rank's own group with the same name and ranks, as each
    process would find its own group in a world of processes (``_HOOKS.translate``).
    """

    def _local(self, key: Any) -> Any:
        translate = _HOOKS.translate
        if translate is None:
            return None
        local = translate(key)
        return local if local is not None and local is not key and dict.__contains__(self, local) else None

    def __missing__(self, key: Any) -> Any:
        local = self._local(key)
        if local is None:
            raise KeyError(key)
        return dict.__getitem__(self, local)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._local(key) is not None

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


#: The types of module globals of ``distributed_c10d`` that hold c10d state (tables, lists, counters).
_STATE_TYPES = (dict, list, set, int)


def _reads_module_state(getter: Callable[..., Any]) -> list[str]:
    """The module globals of ``distributed_c10d`` holding state that a property getter of ``_World`` reads."""
    code = getattr(getter, "__code__", None)
    if code is None:
        return []
    module = vars(c10d)
    return [
        name
        for name in code.co_names
        if name in module and type(module[name]) in _STATE_TYPES and not name.isupper()
    ]


@functools.cache
def global_backed_fields() -> dict[str, list[str]]:
    """``{field: [module global, ...]}``: the properties of torch's ``_World`` backed by module globals.

    torch 2.11-2.15 keep most of c10d's state (``_pg_map``, ``_pg_names``, ``_group_count``, ...) in module
    globals behind properties of the single ``_world`` object, and the rest (``_default_pg``,
    ``_pg_coalesce_state``, 2.15's ``_pg_flight_recorder_hooks``, ...) on the object itself. Found by reading
    the getters' code, so that a field torch adds later in the same way is found too.
    """
    found: dict[str, list[str]] = {}
    for klass in reversed(c10d._World.__mro__):
        for name, attr in vars(klass).items():
            if isinstance(attr, property) and attr.fget is not None and name != "pg_config_info":
                names = _reads_module_state(attr.fget)
                if names:
                    found[name] = names
    return found


def _stored(field: str) -> property:
    """A property of the per-thread world that keeps ``field`` on the instance instead of in a module global."""
    slot = f"_dstest_{field}"

    def get(self: Any) -> Any:
        return self.__dict__[slot]

    def put(self: Any, value: Any) -> None:
        self.__dict__[slot] = value

    return property(get, put, doc=f"``_World.{field}``, kept per rank thread by dstest.")


def _empty_like_global(field: str, names: list[str]) -> Any:
    """A fresh, empty value of the type of the module global behind ``field`` (tables keyed by group
    answer for a foreign rank's group, see :class:`_GroupTable`)."""
    value = vars(c10d)[names[0]]
    if isinstance(value, dict):
        return _GroupTable() if field.startswith("pg_") else {}
    return type(value)()


@functools.cache
def _per_thread_world_class() -> type:
    """A subclass of the running torch's own ``distributed_c10d._World`` whose every field is per instance.

    ``_World.__init__`` gives each instance its own copy of what torch keeps on the object (a field torch
    adds there later comes for free, as 2.15's ``pg_flight_recorder_hooks`` did); the properties backed by
    module globals (:func:`global_backed_fields`) are overridden to keep their value on the instance.
    """
    fields = global_backed_fields()
    namespace: dict[str, Any] = {name: _stored(name) for name in fields}

    def __init__(self: Any) -> None:
        c10d._World.__init__(self)
        for name, names in fields.items():
            self.__dict__[f"_dstest_{name}"] = _empty_like_global(name, names)

    namespace["__init__"] = __init__
    namespace["__doc__"] = "The c10d state of one rank thread: torch's ``_World`` with no field shared."
    namespace["__module__"] = __name__
    return type("PerThreadWorld", (c10d._World,), namespace)


#: One rank thread's c10d state: an instance of :func:`_per_thread_world_class` (a subclass of torch's
#: ``_World``, made at run time).
RankState = Any


def new_rank_state() -> RankState:
    """The c10d state (``distributed_c10d._World``) of one rank thread, sharing nothing with another's."""
    return _per_thread_world_class()()


def unisolated_world_fields() -> list[str]:
    """What two rank threads' c10d states would still share under the running torch, one line per field.

    Every public field of torch's ``_World`` is read on two fresh per-thread states: a container that is the
    same object on both, or a value set on one that the other then reads, is shared. Empty when nothing is.
    """
    a, b = new_rank_state(), new_rank_state()
    problems: list[str] = []
    for name in dir(c10d._World):
        attr = getattr(c10d._World, name, None)
        if name.startswith("_") or not isinstance(attr, property) or name == "pg_config_info":
            continue
        first, second = getattr(a, name), getattr(b, name)
        if first is second and isinstance(first, (dict, list, set)):
            problems.append(f"_World.{name} is one {type(first).__name__} shared by every rank thread")
        elif attr.fset is not None and isinstance(first, int) and not isinstance(first, bool):
            setattr(a, name, first + 12345)
            if getattr(b, name) == first + 12345:
                problems.append(f"_World.{name}: a value set on one rank thread is read on another")
            setattr(a, name, first)
    return [
        f"{p} (torch {torch.__version__}: the per-thread world in dstest/worlds/_compat.py must keep it per rank)"
        for p in problems
    ]


class _ThreadLocalWorld:
    """Stands in for ``distributed_c10d._world``: rank threads see their own state, others the original."""

    def __init__(self, original: Any) -> None:
        self._original = original
        self._local = threading.local()

    def bind(self) -> RankState:
        """Give the calling (rank) thread its own c10d state and keep its backward on this thread.

        Autograd runs backward of CUDA tensors on its own device threads, where the rank's thread-local
        state is invisible, so gradient hooks that issue collectives would find no process group. The
        switch is per thread (autograd state is thread-local), hence set here, on the rank thread.
        """
        torch.autograd.set_multithreading_enabled(False)
        state = new_rank_state()
        self._local.state = state
        return state

    def adopt(self, state: RankState | None) -> None:
        """Make the calling (helper) thread share a rank's state, or drop it (None)."""
        if state is None:
            self._local.__dict__.pop("state", None)
        else:
            torch.autograd.set_multithreading_enabled(False)
            self._local.state = state

    def current(self) -> RankState | None:
        return getattr(self._local, "state", None)

    def unbind(self) -> None:
        self._local.__dict__.pop("state", None)

    def _target(self) -> Any:
        return getattr(self._local, "state", None) or self._original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_original", "_local"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    # ``pg_config_info`` is a computed property on torch's _World; keep the original's behaviour.
    @property
    def pg_config_info(self) -> list[dict[str, Any]]:
        return [
            {"pg_name": self.pg_names[pg], "ranks": list(self.pg_group_ranks[pg])}
            for pg in self.pg_map
        ]


class _Hooks:
    """What the hosting world adds while rank threads are installed (set by the first installer)."""

    def __init__(self) -> None:
        self.capture: Callable[[], Callable[[], Any] | None] | None = None
        self.seed: Callable[[Any], None] | None = None
        self.translate: Callable[[Any], Any] | None = None
        self.own_backend: str | None = None


_HOOKS = _Hooks()


class _Installation:
    """Process-wide switches that rank threads need, reference-counted and undone when the last world ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.world: _ThreadLocalWorld | None = None
        self.saved: dict[str, Any] = {}


_INSTALL = _Installation()


def _set_isolation(on: bool) -> None:
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolation is not None:
        isolation(on)


def gloo_has_list_all_to_all() -> bool:
    """Whether gloo runs the list ``all_to_all``: torch 2.11's has none ("Backend gloo does not support
    alltoall"; ``all_to_all_single`` works), 2.12 added it."""
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0]) >= Version("2.12")


def _pin_fake_cuda_guard() -> None:
    """On a CUDA build without a GPU, let the main thread install torch's fake CUDA device guard.

    ``FakeTensorMode.__enter__`` (DTensor's sharding propagation, FSDP2's init) calls
    ``torch._C._ensureCUDADeviceGuardSet()``. In torch 2.11 that stores a guard owned by a ``thread_local``
    of the calling thread in the process-wide registry; once that thread exits the registry points at freed
    memory and the next ``FakeTensorMode`` on any thread crashes the process (a segfault in an FSDP2 or
    DTensor spec, depending on which rank thread entered first and when it ended). Installed from the main
    thread, which outlives every rank thread, the guard stays valid, and rank threads see it and keep theirs
    out of the registry.
    """
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if (
        ensure is not None
        and torch.version.cuda is not None
        and threading.current_thread() is threading.main_thread()
        and not torch.cuda.is_available()
    ):
        ensure()


#: Where torch keeps, in a thread's state dict, the capsule that frees DTensor's per-thread C++ sharding cache.
_DTENSOR_CACHE_KEY = "__DTensor_fastpath_thread_cache_cleanup"
_THREAD_END_LOCK = threading.Lock()


@functools.cache
def _thread_state_dict_api() -> tuple[Any, Any]:
    """Private ctypes prototypes of ``PyThreadState_GetDict`` and ``Py_IncRef`` (the shared ones in
    ``ctypes.pythonapi`` keep their defaults for other code)."""
    get = ctypes.PYFUNCTYPE(ctypes.py_object)(("PyThreadState_GetDict", ctypes.pythonapi))
    incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
    return get, incref


def _thread_state_dict() -> dict[str, Any]:
    """The calling thread's state dict (where C extensions keep per-thread objects)."""
    get, incref = _thread_state_dict_api()
    state = get()
    incref(state)  # a borrowed reference, which ctypes takes as owned
    return state  # type: ignore[no-any-return]


def create_thread_caches() -> None:
    """At the start of a rank thread (or a thread it started): create torch's per-thread DTensor cache now,
    under the lock that :func:`release_thread_caches` frees such caches under.

    torch frees that cache when Python clears an ending thread's state, under a process-wide C++ mutex,
    and drops cached Python objects inside it, which lets go of the GIL; a thread's first DTensor op
    creates its cache under the same mutex while holding the GIL. So a rank thread ending while another
    ends, or while another makes its first DTensor op (ranks leave their bodies at different times),
    deadlocks: one holds the mutex and waits for the GIL, the other holds the GIL and waits for the mutex
    (seen hanging torch 2.11's suite, and reproduced there with DTensor bodies on cold threaded worlds).
    Both done here, under a Python lock that threads wait for without the GIL, they never overlap.
    """
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is not None:
        with _THREAD_END_LOCK:
            stats()  # creates this thread's cache (it has none yet)


def release_thread_caches() -> None:
    """At the end of a rank thread (or a thread it started): free torch's per-thread DTensor cache now,
    one thread at a time (see :func:`create_thread_caches`)."""
    state = _thread_state_dict()
    if _DTENSOR_CACHE_KEY in state:
        with _THREAD_END_LOCK:
            state.pop(_DTENSOR_CACHE_KEY, None)


def _inheriting_start(self: threading.Thread) -> None:
    """``threading.Thread.start`` while rank threads are installed: a thread started by a rank acts as it."""
    capture = _HOOKS.capture
    as_rank = capture() if capture is not None else None
    if as_rank is not None:
        run = self.run

        def run_as_rank() -> None:
            create_thread_caches()
            try:
                with as_rank():
                    run()
            finally:
                release_thread_caches()

        self.run = run_as_rank  # type: ignore[method-assign]
    _INSTALL.saved["start"](self)


def _serialised_manual_seed(seed: Any) -> Any:
    """``torch.manual_seed`` while rank threads are installed: a rank thread first takes the RNG."""
    hook = _HOOKS.seed
    if hook is not None:
        hook(seed)
    return _INSTALL.saved["manual_seed"](seed)


def _monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    """``dist.monitored_barrier`` while rank threads are installed.

    torch implements monitored_barrier for gloo only and checks that in Python, raising a bare
    ``ValueError`` before the group sees the call. On a rank thread whose group is a Python process group
    from outside torch (dstest's), the group is asked instead, so its error can say why and what to do.
    """
    world = _INSTALL.world
    if world is not None and world.current() is not None and c10d.is_initialized():
        pg = c10d._get_default_group() if group is None or group is c10d.GroupMember.WORLD else group
        refuse = getattr(pg, "monitoredBarrier", None)
        if refuse is not None and not type(pg).__module__.startswith("torch"):
            refuse(timeout, wait_all_ranks)
    return _INSTALL.saved["monitored_barrier"](group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _mesh_init_per_rank(self: Any, *args: Any, **kwargs: Any) -> None:
    """``DeviceMesh.__init__`` while rank threads are installed: a mesh made on a rank thread is that rank's.

    torch ties a mesh's identity (``__eq__``, ``__hash__``) to ``_thread_id``, set only when the default
    group's backend is named "threaded" (torch's own threaded group): otherwise every rank's mesh of the same
    shape compares and hashes equal, and DTensor's process-wide caches keyed through ``DTensorSpec`` ->
    ``DeviceMesh`` (the sharding propagator's, the redistribute plans) hand one rank's local shapes and plans
    to another: wrong values from uneven shards. Here the mesh takes the calling rank's global rank as its
    thread id (helper threads a rank starts act as it), so meshes of different ranks differ, as they do in
    different processes, and the same rank's meshes stay equal.
    """
    world = _INSTALL.world
    device_type = args[0] if args else kwargs.get("device_type")
    if (
        world is not None
        and world.current() is not None
        and isinstance(device_type, str)
        and device_type.startswith("cuda")
        and not torch.cuda.is_available()
    ):
        # torch takes "cuda" without GPUs in a process without LOCAL_RANK (its cross-compilation mode) and
        # fails later (fully_shard); on a world of launched processes set_device fails here. So here.
        from dstest.errors import InvalidArgument

        raise InvalidArgument(
            f"DeviceMesh(device_type={device_type!r}) on a rank of a world without CUDA "
            f"(torch {torch.__version__}, cuda available: False): use the rank's device, "
            "init_device_mesh(ctx.device.type, ...), or run the spec on a GPU world"
        )
    _INSTALL.saved["mesh_init"](self, *args, **kwargs)
    hold_late_imports()  # DTensor code a body imports comes before its meshes
    if world is None or world.current() is None or getattr(self, "_thread_id", 0) is not None:
        return
    if c10d.is_initialized():
        self._thread_id = c10d.get_rank()
        self._hash = None


#: torch's process-wide module hooks (``register_module_forward_pre_hook`` and friends), by module global.
_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


class _RankModuleHooks(collections.OrderedDict):  # type: ignore[type-arg]
    """One of torch's process-wide module-hook tables while rank threads are installed.

    A hook registered on a rank thread runs for that rank's modules only, as in its own process; hooks
    registered elsewhere (before the world, on the main thread) stay in torch's own table and run for every
    thread, as before. ``CommDebugMode`` and torch's module trackers register such hooks: shared, each
    rank's mode saw every rank's modules ("The Module hierarchy tracking is wrong", KeyErrors).
    """

    def __init__(self, shared: Any) -> None:
        super().__init__()
        self.shared = shared
        self.by_rank: dict[Any, collections.OrderedDict[Any, Any]] = {}

    @staticmethod
    def _owner() -> Any:
        world = _INSTALL.world
        return world.current() if world is not None else None

    def _mine(self) -> collections.OrderedDict[Any, Any] | None:
        owner = self._owner()
        return None if owner is None else self.by_rank.get(owner)

    def _holder(self, key: Any) -> Any:
        if key in self.shared:
            return self.shared
        mine = self._mine()
        if mine is not None and key in mine:
            return mine
        return next((d for d in self.by_rank.values() if key in d), None)

    def __setitem__(self, key: Any, value: Any) -> None:
        owner = self._owner()
        if owner is None:
            self.shared[key] = value
        else:
            self.by_rank.setdefault(owner, collections.OrderedDict())[key] = value

    def __getitem__(self, key: Any) -> Any:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        return holder[key]

    def __delitem__(self, key: Any) -> None:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        del holder[key]
        self._drop_empty()

    def _drop_empty(self) -> None:
        for owner in [o for o, hooks in self.by_rank.items() if not hooks]:
            del self.by_rank[owner]

    def __contains__(self, key: object) -> bool:
        return self._holder(key) is not None

    def pop(self, key: Any, *default: Any) -> Any:
        holder = self._holder(key)
        if holder is None:
            if default:
                return default[0]
            raise KeyError(key)
        value = holder.pop(key)
        self._drop_empty()
        return value

    def _visible(self) -> list[tuple[Any, Any]]:
        mine = self._mine() if self.by_rank else None
        return [*self.shared.items(), *(mine.items() if mine else ())]

    def items(self) -> Any:
        return self._visible()

    def values(self) -> Any:
        return [v for _, v in self._visible()]

    def keys(self) -> Any:
        return [k for k, _ in self._visible()]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def __len__(self) -> int:  # asked on every module call: no rank hooks, no thread lookup
        if not self.by_rank:
            return len(self.shared)
        mine = self._mine()
        return len(self.shared) + (len(mine) if mine else 0)

    def __bool__(self) -> bool:
        return len(self) > 0


#: torch's process-wide optimizer hooks (``register_optimizer_step_pre_hook`` / ``_post_hook``; MemTracker).
_GLOBAL_OPTIMIZER_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


class _CountedHandlers(dict):  # type: ignore[type-arg]
    """DTensor's custom op handlers (``DTensor._op_dispatcher._custom_op_handlers``) while rank threads are
    installed: an entry added by several ranks stays until the last of them removes it.

    ``loss_parallel()`` adds its handlers on entry and pops them on exit; with ranks as threads the first
    rank to leave took them from the others still inside (a KeyError at their exit, or a backward without
    them: an all_gather the first rank never joined). The handlers are the same functions on every rank, so
    counting who holds them gives each rank what its own process would have. A real dict: torch's C++
    dispatch reads it directly.
    """

    def __init__(self, entries: Any) -> None:
        super().__init__(entries)
        self.holders: dict[Any, int] = {}

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self.holders[key] = self.holders.get(key, 0) + 1
            dict.__setitem__(self, key, value)

    def pop(self, key: Any, *default: Any) -> Any:
        count = self.holders.get(key, 0)
        if count > 1:
            self.holders[key] = count - 1
            return dict.__getitem__(self, key)
        self.holders.pop(key, None)
        return dict.pop(self, key, *default)


def _hold_op_handlers() -> None:
    """Under the install lock: make DTensor's custom op handlers a :class:`_CountedHandlers`, once DTensor is
    imported (never importing it here: 0.6 s, and a module a test runner removes from ``sys.modules`` after an
    inline run must not be imported twice, which torch's operator registration refuses). Called when rank
    threads are installed and at every world start."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    dispatcher: Any = getattr(dtensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    if isinstance(handlers, dict) and not isinstance(handlers, _CountedHandlers) and "op_handlers" not in _INSTALL.saved:
        _INSTALL.saved["op_dispatcher"], _INSTALL.saved["op_handlers"] = dispatcher, handlers
        dispatcher._custom_op_handlers = _CountedHandlers(handlers)


def hold_late_imports() -> None:
    """On a rank thread making a group: hold what a body's own imports brought in since the world started
    (DTensor's handler table, see :func:`_hold_op_handlers`), before the body can use it."""
    if "torch.distributed.tensor" not in sys.modules or "op_handlers" in _INSTALL.saved:
        return
    with _INSTALL.lock:
        if _INSTALL.users > 0:
            _hold_op_handlers()


def _release_op_handlers() -> None:
    """Put torch's own handler dict back, with what ranks left in it."""
    dispatcher, original = _INSTALL.saved.get("op_dispatcher"), _INSTALL.saved.get("op_handlers")
    if dispatcher is None or original is None:
        return
    current = getattr(dispatcher, "_custom_op_handlers", None)
    if isinstance(current, _CountedHandlers):
        original.clear()
        original.update(dict(current))
    dispatcher._custom_op_handlers = original


#: Backends a group may ask for that rank threads of one process cannot give it: real gloo among threads of
#: one process runs unchecked and unrecorded (an op mismatch passes), NCCL needs a process per GPU.
_REDIRECTED_BACKENDS = frozenset({"gloo", "nccl", "cpu:gloo", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"})


def _group_helper_on_rank_threads(
    group_size: int, group_rank: Any, global_ranks: list[int], backend: Any, *args: Any, **kwargs: Any
) -> Any:
    """``distributed_c10d._new_process_group_helper`` while rank threads are installed.

    ``dist.new_group(ranks, backend="gloo")`` (Megatron makes such groups by default) would build a real
    gloo group among the rank threads: its calls unchecked, unrecorded and able to hang threads in gloo. On a
    rank thread such a group is one of the hosting world's own groups instead, and keeps the backend name it
    asked for (``dist.get_backend(group)`` says "gloo", as on a world of processes).
    """
    original = _INSTALL.saved["group_helper"]
    own = _HOOKS.own_backend
    world = _INSTALL.world
    asked = str(backend).lower() if backend is not None else ""
    if own is None or world is None or world.current() is None or asked not in _REDIRECTED_BACKENDS:
        return original(group_size, group_rank, global_ranks, backend, *args, **kwargs)
    pg, store = original(group_size, group_rank, global_ranks, own, *args, **kwargs)
    state = c10d._world
    if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER and pg in state.pg_map:
        state.pg_map[pg] = (str(backend), state.pg_map[pg][1])
    return pg, store


def _device_mesh_class() -> Any:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed
        return None
    return DeviceMesh


@contextlib.contextmanager
def thread_local_c10d_world(
    capture: Callable[[], Callable[[], Any] | None] | None = None,
    seed: Callable[[Any], None] | None = None,
    translate: Callable[[Any], Any] | None = None,
    own_backend: str | None = None,
) -> Iterator[_ThreadLocalWorld]:
    """Install a thread-local c10d world for the duration of the block (re-entrant across worlds).

    - ``distributed_c10d._world`` is process-global; replaced by a proxy that gives each rank thread
      its own state (torch 2.13).
    - torch 2.13 registers process groups by name in a process-global C++ registry; a second thread
      registering "0" fails with "A process group is already registered under the name0" unless
      ``_set_thread_isolation_mode(True)``.
    - Each rank thread calls ``bind()``, which also keeps that thread's backward on the thread.
    - ``threading.Thread.start`` is wrapped so that a thread started by a rank thread acts as that rank
      (``capture``), and ``torch.manual_seed`` so that the hosting world can hand torch's one global RNG
      to one rank at a time (``seed``); ``translate`` maps a foreign rank's group to the caller's own.
    - ``dist.monitored_barrier`` is wrapped so that a non-gloo Python group explains torch's gloo-only limit.
    - ``DeviceMesh.__init__`` is wrapped so that a rank's meshes are its own (``_mesh_init_per_rank``).
    - torch's process-wide module-hook and optimizer-hook tables are per rank for hooks a rank registers
      (``_RankModuleHooks``); DTensor's custom op handlers are held per rank (``_CountedHandlers``).
    - ``_new_process_group_helper`` is wrapped so that a group a rank thread asks of gloo or NCCL is one of
      the world's own (backend ``own_backend``; ``_group_helper_on_rank_threads``).
    - On a CUDA build without a GPU, the main thread installs torch's fake CUDA guard (``_pin_fake_cuda_guard``).
    """
    with _INSTALL.lock:
        if _INSTALL.users == 0:
            _INSTALL.saved["world"] = c10d._world
            _INSTALL.world = _ThreadLocalWorld(c10d._world)
            c10d._world = _INSTALL.world  # type: ignore[assignment]
            _set_isolation(True)
            _pin_fake_cuda_guard()
            _INSTALL.saved["start"] = threading.Thread.start
            threading.Thread.start = _inheriting_start  # type: ignore[method-assign]
            _INSTALL.saved["manual_seed"] = torch.manual_seed
            torch.manual_seed = _serialised_manual_seed
            torch.random.manual_seed = _serialised_manual_seed
            _INSTALL.saved["monitored_barrier"] = c10d.monitored_barrier
            c10d.monitored_barrier = dist.monitored_barrier = _monitored_barrier
            import torch.nn.modules.module as module_module
            import torch.optim.optimizer as optimizer_module

            for module, names in ((module_module, _GLOBAL_MODULE_HOOKS), (optimizer_module, _GLOBAL_OPTIMIZER_HOOKS)):
                for name in names:
                    if hasattr(module, name):
                        _INSTALL.saved[name] = getattr(module, name)
                        setattr(module, name, _RankModuleHooks(_INSTALL.saved[name]))
            _hold_op_handlers()
            _INSTALL.saved["group_helper"] = c10d._new_process_group_helper
            c10d._new_process_group_helper = _group_helper_on_rank_threads  # type: ignore[assignment]
            mesh = _device_mesh_class()
            if mesh is not None:
                _INSTALL.saved["mesh_class"], _INSTALL.saved["mesh_init"] = mesh, mesh.__init__
                mesh.__init__ = _mesh_init_per_rank
        if capture is not None:
            _HOOKS.capture = capture
        if seed is not None:
            _HOOKS.seed = seed
        if translate is not None:
            _HOOKS.translate = translate
        if own_backend is not None:
            _HOOKS.own_backend = own_backend
        _INSTALL.users += 1
        world = _INSTALL.world
    assert world is not None
    try:
        yield world
    finally:
        with _INSTALL.lock:
            _INSTALL.users -= 1
            if _INSTALL.users == 0:
                _set_isolation(False)
                c10d._world = _INSTALL.saved["world"]
                threading.Thread.start = _INSTALL.saved["start"]  # type: ignore[method-assign]
                torch.manual_seed = _INSTALL.saved["manual_seed"]
                torch.random.manual_seed = _INSTALL.saved["manual_seed"]
                c10d.monitored_barrier = dist.monitored_barrier = _INSTALL.saved["monitored_barrier"]
                c10d._new_process_group_helper = _INSTALL.saved["group_helper"]
                import torch.nn.modules.module as module_module
                import torch.optim.optimizer as optimizer_module

                for module, names in ((module_module, _GLOBAL_MODULE_HOOKS), (optimizer_module, _GLOBAL_OPTIMIZER_HOOKS)):
                    for name in names:
                        if name in _INSTALL.saved:
                            setattr(module, name, _INSTALL.saved[name])
                _release_op_handlers()
                if "mesh_init" in _INSTALL.saved:
                    _INSTALL.saved["mesh_class"].__init__ = _INSTALL.saved["mesh_init"]
                _HOOKS.__init__()  # type: ignore[misc]
                _INSTALL.world = None
                _INSTALL.saved.clear()


def thread_local_c10d_world_ensure() -> None:
    """At each world start: put back what code run since the install switched off.

    torch's own threaded helpers (``MultiThreadedTestCase``, ``spawn_threads_and_init_comms``) switch
    thread isolation off when they finish and swap ``distributed_c10d._world``; warm rank threads would
    then fail with "A process group is already registered under the name0".
    """
    with _INSTALL.lock:
        if _INSTALL.users == 0 or _INSTALL.world is None:
            return
        _set_isolation(True)
        _hold_op_handlers()  # DTensor imported since the install (a body's own import)
        if c10d._world is not _INSTALL.world:  # type: ignore[comparison-overlap]
            c10d._world = _INSTALL.world  # type: ignore[assignment]


def current_rank_state() -> RankState | None:
    """The calling rank thread's c10d state (to hand to a thread it starts)."""
    world = _INSTALL.world
    return world.current() if world is not None else None


def adopt_rank_state(state: RankState | None) -> None:
    """Make the calling thread use a rank's c10d state (None: drop it)."""
    world = _INSTALL.world
    if world is not None:
        world.adopt(state)


def drop_subgroups() -> None:
    """On a rank thread between runs: forget every group but the default one, in c10d and its registry.

    dstest's groups are Python ProcessGroups; the state is this thread's own, so it is dropped directly
    rather than through ``destroy_process_group`` (which would also tear down what a run never built).
    """
    state = c10d._world
    tables = _group_tables(state._target() if isinstance(state, _ThreadLocalWorld) else state)
    for pg in [pg for pg in list(state.pg_map) if pg is not state.default_pg]:
        name = dict.get(state.pg_names, pg)
        for table in tables:
            dict.pop(table, pg, None)
        for pgs in state.tags_to_pg.values():
            while pg in pgs:
                pgs.remove(pg)
        if name is not None:
            with contextlib.suppress(RuntimeError, KeyError):
                torch._C._distributed_c10d._unregister_process_group(name)


def _group_tables(state: Any) -> list[dict[Any, Any]]:
    """Every table of a c10d state keyed by process group (torch names them ``pg_*``)."""
    tables = []
    for name in dir(type(state)):
        if name.startswith("pg_") and name != "pg_config_info":
            value = getattr(state, name, None)
            if isinstance(value, dict):
                tables.append(value)
    return tables


class FreshRunState:
    """On a rank of a warm world: give each run the group names and store keys a fresh world would have.

    torch names groups "1", "2", ... from ``_world.group_count`` and keeps their rendezvous keys in the
    default store under that name, so a second run on the same ranks would otherwise name its first
    group after the groups of earlier runs (what a user sees in ``pg_names`` and traces), and a run
    reusing a name would read the keys of a dead group. Made right after the default group is formed;
    ``begin`` gives a run the default store under its own prefix (every rank gets the same run id) and
    restarts the count where a fresh world starts it, ``end`` puts both back.
    """

    def __init__(self) -> None:
        state = c10d._world
        self.group_count = state.group_count
        default_pg = state.default_pg
        assert default_pg is not None, "made once the rank's default group is formed"
        self.default_pg = default_pg
        self.backend, self.store = state.pg_map[default_pg]

    def begin(self, run_id: int) -> None:
        state = c10d._world
        prefixed = torch._C._distributed_c10d.PrefixStore(f"dstest-run{run_id}/", self.store)
        state.pg_map[self.default_pg] = (self.backend, prefixed)
        state.group_count = self.group_count

    def end(self) -> None:
        state = c10d._world
        state.pg_map[self.default_pg] = (self.backend, self.store)
        state.group_count = self.group_count


def hash_store() -> Any:
    """An in-memory c10d store for one world's rendezvous (threads of this process)."""
    return torch._C._distributed_c10d.HashStore()


def declare_self_recording(name: str) -> None:
    """Tell torch (2.15+) that backend ``name`` records its own collectives, so that group creation does not
    attach torch's flight-recorder hook to its groups.

    torch 2.15 attaches a ``FlightRecorderHook`` to every new group whose backend is not in
    ``distributed_c10d._FR_SELF_RECORDING_BACKENDS``, and only skips groups that report no device; the hook
    reads the group's name from a registered C++ backend, which a Python process group has none of
    ("ProcessGroup name not set"). dstest's groups record every call themselves (traces, ``ctx.comm``).
    """
    backends = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(backends, set):
        backends.add(name)


def backend_registered(name: str) -> bool:
    """Whether a c10d backend plugin of this name is registered (torch keeps them in ``Backend._plugins``)."""
    return name.upper() in dist.Backend._plugins


def _value_or_raise(source: torch.futures.Future[Any]) -> Any:
    return source.value()  # raises the error set on ``source``, which fails the chained future in C++


def linked_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """``(source, handed_out)``: a future to give to torch for a work handle, and the one that resolves it.

    ``torch.futures.Future.set_exception`` does not fail a future in C++: it completes it *successfully*
    with the exception object as its value, and only Python's ``wait``/``value`` raise it (an unwrap
    function). A C++ consumer reads that value as the work's result: DDP's reducer, in
    ``finalize_backward``, takes the tensors out of it, finds none and reads past the end of an empty
    vector, a segfault in the rank's ``backward`` whenever a bucket's all_reduce failed (a desync: a peer
    finished early; torch 2.11-2.15). A future chained with ``then`` whose callback raises is failed in C++
    itself, so what a Work hands out is the chained future: its ``wait``/``value`` raise on both sides
    (in Python as ``RuntimeError`` carrying the original error's type and text). Resolve ``source`` with
    ``set_result`` or ``set_exception``.
    """
    source: torch.futures.Future[Any] = torch.futures.Future()
    return source, source.then(_value_or_raise)


#: The base of the work handles a Python process group returns (``torch.distributed._Work``).
WorkBase: Any = dist._Work  # type: ignore[attr-defined]


def c10d_state() -> Any:
    """The calling rank thread's c10d state (``distributed_c10d._world``, thread-local in a world)."""
    return c10d._world


_INIT_LOCK = threading.Lock()


def init_rank_process_group(**kwargs: Any) -> None:
    """``dist.init_process_group`` for one rank thread, leaving ``sys.excepthook`` as it was.

    torch 2.13's init_process_group wraps the process-wide sys.excepthook to prefix "[rankN]", once per
    call: N rank threads would stack N prefixes, run after run. Inits are serialised (they exchange
    nothing, so no rank waits for another) so that each one's wrap is undone exactly.
    """
    with _INIT_LOCK:
        hook = sys.excepthook
        try:
            dist.init_process_group(**kwargs)
        finally:
            sys.excepthook = hook


_REDUCE_OP_NAMES = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
}


def reduce_op_name(op: Any) -> str:
    """'sum', 'avg', ... for a ReduceOp or RedOpType (options carry one or the other across versions);
    ``premul_sum`` comes with its factor (:class:`dstest.worlds._collectives.PremulSum`), read from the
    op's pickled state ``(RedOpType.PREMUL_SUM, factor)`` (torch keeps it in a C++ supplement)."""
    premul = getattr(dist.ReduceOp, "PREMUL_SUM", None)
    if premul is not None and getattr(op, "op", None) == premul:
        from dstest.worlds._collectives import PremulSum

        state = op.__getstate__()
        return PremulSum(state[1] if isinstance(state, tuple) and len(state) > 1 else 1.0)
    for name, short in _REDUCE_OP_NAMES.items():
        member = getattr(dist.ReduceOp, name, None)
        if member is not None and op == member:
            return short
    inner = getattr(op, "op", None)
    if inner is not None and inner is not op:
        return reduce_op_name(inner)
    raise ValueError(f"unsupported reduce op {op!r}")
