"""The adapter for DeepSpeed (a third-party target; written against DeepSpeed 0.19.8).

Everything goes through DeepSpeed's public surface: ``deepspeed.initialize(model=, optimizer=, config=,
mpu=)`` with a client torch optimizer (so none of DeepSpeed's native optimizer ops is JIT-built), the
engine's own methods, ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_grad`` for full
values, ``deepspeed.comm.pg_utils.is_parallel`` for the optional-group guard, the AutoTP layers
(``deepspeed.module_inject.layers.LinearLayer`` / ``LinearAllreduce``), ``deepspeed.sequence.cross_entropy
.vocab_parallel_cross_entropy`` and ``deepspeed.runtime.utils.get_global_norm_of_tensors`` for the call
sites of SPEC A6, and ``DeepSpeedConfig`` for configuration checks. Beyond that the adapter observes: it
counts the collectives DeepSpeed issues through ``deepspeed.comm`` and sums the bytes of the partitioned
tensors the ZeRO optimizer owns.

Three translations keep one DeepSpeed finding each from masking every other spec (each is a finding in the
README; ``DSTEST_DEEPSPEED_STRICT=1`` turns all three off): a missing ``gradient_clipping`` means 0 (the
specs' "off"; DeepSpeed's default is 1.0), the removed ``sparse_gradients`` key is dropped, and
non-contiguous parameters are made contiguous before ``deepspeed.initialize`` (which cannot broadcast them).
Crashes inside DeepSpeed's optional-group helpers are reported as :class:`DeepSpeedDeviation`.

DeepSpeed keeps process groups and its communication backend in module globals, so it runs in the process
world (one process per rank), not in threads. The process world destroys the groups a run created after
the run, so each new adapter (one per run and rank) first releases DeepSpeed's references to them.

DeepSpeed is imported lazily: dstest works without it, and asking for this target without it installed
raises :class:`DeepSpeedUnavailable` naming ``pip install dstest[deepspeed]``.

The module is one adapter (about 600 lines): every method maps one ``Target`` operation onto DeepSpeed's
surface, and the translations above are shared by all of them; splitting it would spread one mapping
over several files.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from dstest.errors import Deviation, DstestError
from dstest.targets.base import FEATURES, TrainingEngine

__all__ = ["DeepSpeedAdapterError", "DeepSpeedDeviation", "DeepSpeedTarget", "DeepSpeedUnavailable"]

#: What this adapter can observe or drive. Not listed: "comm_buffer_bytes" (DeepSpeed's staging buffers
#: are spread over private attributes that change between releases; no public accessor) and
#: "grad_multiplier" (DeepSpeed applies 1/scale inside its optimizer step without recording it); specs
#: needing them skip. "fp16" depends on the accelerator (see :meth:`DeepSpeedTarget.supports`).
_FEATURES = frozenset(FEATURES - {"comm_buffer_bytes", "grad_multiplier", "fp16", "impl_components"})

#: Methods of DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``) that issue a collective or a
#: point-to-point transfer; every collective of DeepSpeed's runtime goes through one of them.
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


class DeepSpeedUnavailable(DstestError, ImportError):
    """DeepSpeed is not installed (or cannot be imported) in this environment."""


class DeepSpeedAdapterError(DstestError, RuntimeError):
    """The adapter cannot serve the request (wrong world, no process group, an optimizer it does not build).

    Not a ValueError or AssertionError on purpose: the conformance run must report these as failures of the
    run, never as deviations of DeepSpeed."""


def _deepspeed() -> Any:
    """Import DeepSpeed for CPU where no GPU is present (``DS_ACCELERATOR=cpu`` unless set)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
    except ImportError as exc:
        raise DeepSpeedUnavailable(
            f"target 'deepspeed' needs DeepSpeed, which cannot be imported here ({type(exc).__name__}: {exc}); "
            "install it with `pip install dstest[deepspeed]` (on CPU also set DS_ACCELERATOR=cpu)"
        ) from exc
    return deepspeed


class DeepSpeedDeviation(Deviation):
    """A :class:`~dstest.errors.Deviation` found by the DeepSpeed adapter (pickles across processes)."""


@contextlib.contextmanager
def _crash_is_deviation(contract: str, expected: str) -> Iterator[None]:
    """Report an exception that DeepSpeed's own code raises (a crash such as a negative tensor size, not
    an assertion or a documented ValueError) while serving a call the contract says must work, as a
    :class:`~dstest.errors.Deviation` of ``contract``; the original stays chained as its cause."""
    try:
        yield
    except (AssertionError, ValueError, TypeError, NotImplementedError, DstestError):
        raise
    except Exception as exc:
        config_module = sys.modules.get("deepspeed.runtime.config")
        if config_module is not None and isinstance(exc, config_module.DeepSpeedConfigError):
            raise  # a rejected configuration (one of the target's config_errors), not a crash
        inside = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}deepspeed{os.sep}" in f.filename]
        if not inside:
            raise
        inner = inside[-1]  # DeepSpeed's innermost frame (the crash may surface in torch below it)
        where = f"{inner.filename.rsplit(os.sep + 'site-packages' + os.sep, 1)[-1]}:{inner.lineno} in {inner.name}"
        raise DeepSpeedDeviation(
            contract, expected, f"{type(exc).__name__}: {exc}", f"raised inside DeepSpeed at {where}"
        ) from exc


def _release_cached_groups() -> None:
    """Forget the process groups DeepSpeed cached in module globals during an earlier run of this process
    (the world destroyed them). DeepSpeed's own hook for this runs when DeepSpeed destroys the world
    group; the process world destroys only the subgroups, so it is called here."""
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    groups._release_process_group_references(group=None)
    partition_parameters.shutdown_init_context()
    partition_parameters.empty_buffers.clear()
    partition_parameters.temp_contiguous_tensor = None


def _ensure_comm() -> None:
    """DeepSpeed's communication backend (``deepspeed.comm``) over the already formed world, and the
    environment its engine reads. The first call in a process JIT-builds DeepSpeed's small CPU shm_comm op
    (seconds; cached on disk afterwards). Not collective here: the op's shared-memory handshake only runs
    when ``LOCAL_SIZE`` is set, which the process world does not set."""
    import torch.distributed as dist
    from deepspeed import comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized():
        raise DeepSpeedAdapterError(
            "target 'deepspeed' needs an initialised torch.distributed world; run it in the process world "
            "(`dstest --target deepspeed --world process`, or `--dstest-worlds=process` under pytest)"
        )
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)


def _client_optimizer(section: Mapping[str, Any] | None, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A torch optimizer built from the config's ``optimizer`` section (SGD when there is none)."""
    section = dict(section or {"type": "SGD", "params": {"lr": 0.1}})
    kind = str(section.get("type", "SGD"))
    kwargs = dict(section.get("params") or {})
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    try:
        cls = classes[kind.lower()]
    except KeyError:
        raise DeepSpeedAdapterError(
            f"optimizer.type={kind!r}: the DeepSpeed adapter drives client torch optimizers only; "
            f"allowed: {sorted(c.__name__ for c in classes.values())}"
        ) from None
    opt: torch.optim.Optimizer = cls([p for p in params if p.requires_grad], **kwargs)
    return opt


#: Set to 1 to hand DeepSpeed the specs' models and configurations untranslated (see :func:`_translate`).
STRICT_ENV = "DSTEST_DEEPSPEED_STRICT"
_notes_printed: set[str] = set()


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _note(key: str, text: str) -> None:
    """Say once per process (in the rank's output) what the adapter translated."""
    if key not in _notes_printed:
        _notes_printed.add(key)
        print(f"dstest: {text} ({STRICT_ENV}=1 turns this off)", file=sys.stderr)


def _translate(config: Mapping[str, Any]) -> dict[str, Any]:
    """The specs' configuration (impl's defaults, DeepSpeed's key names) in DeepSpeed 0.19.8's terms.

    - ``gradient_clipping`` absent: the specs mean "off" (impl's default, 0); DeepSpeed's default is 1.0
      (``GRADIENT_CLIPPING_DEFAULT`` in runtime/constants.py), which would clip every spec's step and make
      DeepSpeed reject every ``compute_grad_norm: false`` ("requires gradient_clipping=0"). Set to 0.
    - ``sparse_gradients``: removed in DeepSpeed 0.19.8 and rejected even when false
      (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``); an embedding built with ``sparse=True`` is reduced sparsely with
      no flag, so the model selects the path the key selects for impl. Dropped.

    Both are findings in the README; with ``DSTEST_DEEPSPEED_STRICT=1`` the configuration goes through as is.
    """
    cfg = copy.deepcopy(dict(config))
    if _strict():
        return cfg
    if "gradient_clipping" not in cfg:
        cfg["gradient_clipping"] = 0.0
    cfg.pop("sparse_gradients", None)
    return cfg


def _make_parameters_contiguous(model: torch.nn.Module) -> None:
    """Give every non-contiguous parameter a contiguous copy of its data, in place.

    DeepSpeed 0.19.8 cannot take a model with a non-contiguous parameter: ``DeepSpeedEngine.
    _broadcast_model`` broadcasts ``p.data.view(torch.uint8)``, which raises "self.stride(-1) must be 1 to
    view Float as Byte" (at every world size, W = 1 included). The bundled specs' model stores one weight
    transposed on purpose (SPEC A7), so without this every engine spec would report that one finding and
    nothing else. The finding is in the README; with ``DSTEST_DEEPSPEED_STRICT=1`` the layout is left alone."""
    if _strict():
        return
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.data.is_contiguous():
                p.data = p.data.contiguous()
                changed.append(name)
    if changed:
        _note(
            "layout",
            f"DeepSpeed 0.19.8 cannot initialise non-contiguous parameters (engine._broadcast_model views them as "
            f"uint8); made {changed} contiguous before deepspeed.initialize",
        )


class _Mpu:
    """DeepSpeed's model-parallel-unit interface over explicit groups (``None``: the dimension is absent).

    It reports exactly what torch reports for the groups it is given: a non-member's size is -1, an absent
    group's is 1 and its group is ``None``, which is how DeepSpeed's guarded call sites see an absent
    dimension."""

    def __init__(self, dp_group: Any, mp_group: Any) -> None:
        import torch.distributed as dist

        self.dp_group = dist.group.WORLD if dp_group is None else dp_group
        self.mp_group = mp_group

    @staticmethod
    def _size(group: Any) -> int:
        import torch.distributed as dist

        return 1 if group is None else int(dist.get_world_size(group))

    @staticmethod
    def _rank(group: Any) -> int:
        import torch.distributed as dist

        return 0 if group is None else int(dist.get_rank(group))

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self._size(self.dp_group)

    def get_data_parallel_rank(self) -> int:
        return self._rank(self.dp_group)

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_model_parallel_world_size(self) -> int:
        return self._size(self.mp_group)

    def get_model_parallel_rank(self) -> int:
        return self._rank(self.mp_group)

    # tensor parallelism is the only model parallelism here
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        import torch.distributed as dist

        if self.mp_group is None:
            return int(dist.get_rank())
        return int(dist.get_global_rank(self.mp_group, 0))

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self) -> Any:
        return None


class _CollectiveCounter:
    """Counts the collectives DeepSpeed issues through its communication backend, by op name.

    While counting, the backend object's collective methods are shadowed by counting wrappers (instance
    attributes); a collective that calls another one counts once. Restored when counting stops."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._depth = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from deepspeed.comm import comm as ds_comm

        cdb = ds_comm.cdb
        if cdb is None or "_dstest_counting" in vars(cdb):
            yield
            return
        missing = object()
        saved: dict[str, Any] = {}
        for name in _COLLECTIVES:
            method = getattr(cdb, name, None)
            if callable(method):
                saved[name] = vars(cdb).get(name, missing)
                setattr(cdb, name, self._wrap(name, method))
        cdb._dstest_counting = True
        try:
            yield
        finally:
            for name, before in saved.items():
                if before is missing:
                    delattr(cdb, name)
                else:
                    setattr(cdb, name, before)
            del cdb._dstest_counting

    def _wrap(self, name: str, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and non-tensors ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if n:
                seen[ptr] = max(seen.get(ptr, 0), n)
    return sum(seen.values())


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _flatten(v)
    else:
        yield obj


class DeepSpeedEngineAdapter:
    """A DeepSpeed engine behind the :class:`~dstest.targets.base.TrainingEngine` surface."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module: torch.nn.Module = engine.module
        self._counter = _CollectiveCounter()
        self._window_open = False

    # -- training ------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _crash_is_deviation("engine", "the forward of a configuration DeepSpeed accepted"):
            return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if not self._window_open:  # the first backward of a step opens the counting window
            self._counter.counts = {}
            self._window_open = True
        with self._counter.counting(), _crash_is_deviation("engine", "a backward DeepSpeed accepted"):
            self.engine.backward(loss)

    def step(self) -> None:
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        with self._counter.counting(), _crash_is_deviation("engine", "a step DeepSpeed accepted"):
            self.engine.step()
        if boundary:
            self._window_open = False

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # -- observation -----------------------------------------------------------------------------------------
    def get_global_grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def gradient_clipping(self) -> float:
        """The threshold in effect: the ZeRO optimizer's own ``clip_grad`` where it has one (stages 1-3 and the
        mixed-precision optimizers clip with it, and loading a checkpoint can change it), else the engine's."""
        clip = getattr(self.engine.optimizer, "clip_grad", None)
        if isinstance(clip, int | float):
            return float(clip)
        return float(self.engine.gradient_clipping())

    def loss_scale(self) -> float:
        if not self.engine.fp16_enabled():
            return 1.0
        opt = self.engine.optimizer
        for attr in ("loss_scale", "cur_scale"):
            value = getattr(opt, attr, None)
            if isinstance(value, int | float | torch.Tensor):
                return float(value)
        scaler = getattr(opt, "loss_scaler", None)
        return float(scaler.cur_scale) if scaler is not None else 1.0

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self._named():
            with _crash_is_deviation("engine", f"the full fp32 value of parameter {name!r}"):
                full = safe_get_full_fp32_param(p)  # collective at stage 3
            out[name] = (p.detach() if full is None else full).float().clone().cpu()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        scale = self.loss_scale()
        out = {}
        for name, p in self._named():
            with _crash_is_deviation("engine", f"the full gradient of parameter {name!r}"):
                g = safe_get_full_grad(p)  # collective at stages 1-3
            if g is None:
                raise AssertionError(f"DeepSpeed holds no gradient for {name!r} (safe_get_full_grad returned None)")
            g = g.float().clone().cpu()
            if g.is_sparse:
                g = g.coalesce().to_dense()
            out[name] = g / scale if scale != 1.0 else g
        return out

    def collective_counts(self) -> dict[str, int]:
        return dict(self._counter.counts)

    def comm_buffer_bytes(self) -> int:
        raise NotImplementedError("the DeepSpeed adapter does not observe communication buffers")

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the fp32 master partitions, the optimizer's state and the gradients this rank's ZeRO
        optimizer holds (stage 0: the model's own parameters and gradients)."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        state = _bytes(_flatten([dict(s) for s in getattr(inner, "state", {}).values()]))
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # stage 3
            master = _bytes(opt.fp32_partitioned_groups_flat)
            grads = _bytes(
                [getattr(opt, "grad_partitions_flat_buffer", None), *[t.grad for t in opt.fp32_partitioned_groups_flat],
                 *_flatten(getattr(opt, "averaged_gradients", {}))]
            )  # fmt: skip
        elif hasattr(opt, "single_partition_of_fp32_groups"):  # stages 1 and 2
            master = _bytes(opt.single_partition_of_fp32_groups)
            grads = _bytes(
                [getattr(opt, "grads_in_partition", None), *[t.grad for t in opt.single_partition_of_fp32_groups],
                 *_flatten(getattr(opt, "averaged_gradients", {})), *[p.grad for p in self.module.parameters()]]
            )  # fmt: skip
        else:
            master = _bytes(p for p in self.module.parameters())
            grads = _bytes(p.grad for p in self.module.parameters())
        return {"master_params": master, "optimizer_state": state, "gradients": grads}

    def last_grad_multiplier(self) -> float | None:
        raise NotImplementedError("the DeepSpeed adapter does not observe the gradient multiplier")

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        with _crash_is_deviation("engine", "a saved checkpoint"):
            return self.engine.save_checkpoint(str(save_dir), tag=tag)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
        with _crash_is_deviation("engine", "a loaded checkpoint"):
            return self.engine.load_checkpoint(str(load_dir), tag=tag)


class DeepSpeedTarget:
    """DeepSpeed as a system under test (see the module docstring)."""

    name = "deepspeed"
    third_party = True
    default_world = "process"  # module-global process groups: one rank per process

    @staticmethod
    def environment(device: str) -> dict[str, str]:
        """Set on each rank's process before a spec body runs (worlds know nothing of targets): DeepSpeed
        picks its accelerator from ``DS_ACCELERATOR`` when first imported, so ranks on CPU get ``cpu``."""
        return {"DS_ACCELERATOR": "cpu"} if device == "cpu" else {}

    def __init__(self) -> None:
        ds = _deepspeed()
        if threading.current_thread() is not threading.main_thread():
            raise DeepSpeedAdapterError(
                "target 'deepspeed' cannot run in the threaded world: DeepSpeed keeps process groups in module "
                "globals shared by all threads; run it in the process world (`--world process`, or "
                "`--dstest-worlds=process` under pytest)"
            )
        from deepspeed.runtime.config import DeepSpeedConfigError

        self.version = str(ds.__version__)
        self.config_errors: tuple[type[BaseException], ...] = (ValueError, AssertionError, DeepSpeedConfigError)
        _release_cached_groups()
        import torch.distributed as dist

        if dist.is_initialized():
            _ensure_comm()

    def supports(self, feature: str) -> bool:
        if feature == "fp16":
            from deepspeed.accelerator import get_accelerator

            return bool(get_accelerator().is_fp16_supported())
        if feature == "bf16":
            from deepspeed.accelerator import get_accelerator

            return bool(get_accelerator().is_bf16_supported())
        return feature in _FEATURES

    def check_config(self, config: Mapping[str, Any]) -> None:
        """DeepSpeed's own validation of a configuration (``DeepSpeedConfig``; translated as for
        :meth:`initialize`): no engine, no collective."""
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(_translate(config))

    def initialize(
        self, model: torch.nn.Module, config: Mapping[str, Any], dp_group: Any = None, mp_group: Any = None
    ) -> TrainingEngine:
        ds = _deepspeed()
        _ensure_comm()
        cfg = _translate(config)
        optimizer = _client_optimizer(cfg.pop("optimizer", None), model.parameters())
        cfg["zero_allow_untested_optimizer"] = True
        cfg.setdefault("steps_per_print", 1 << 30)
        _make_parameters_contiguous(model)
        mpu = None if dp_group is None and mp_group is None else _Mpu(dp_group, mp_group)
        with _crash_is_deviation("engine", "an engine for a configuration DeepSpeedConfig accepts"):
            engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu, dist_init_required=False)
        return DeepSpeedEngineAdapter(engine)

    # -- optional-group call sites (SPEC A) ------------------------------------------------------------------
    def is_parallel(self, group: Any) -> bool:
        from deepspeed.comm import pg_utils

        if group is not None:
            _ensure_comm()
        with _crash_is_deviation("A1-A4", "False for absent, single-rank and non-member groups, True otherwise"):
            return bool(pg_utils.is_parallel(group))

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        """The guard DeepSpeed's call sites use: ``if pg_utils.is_parallel(group): dist.all_reduce(...)``."""
        from deepspeed import comm as ds_comm
        from deepspeed.comm import pg_utils

        ops = {"sum": ds_comm.ReduceOp.SUM, "max": ds_comm.ReduceOp.MAX, "min": ds_comm.ReduceOp.MIN}
        if op not in ops:
            raise DeepSpeedAdapterError(f"op={op!r}; allowed: {sorted(ops)}")
        if group is not None:
            _ensure_comm()
        with _crash_is_deviation("A5", "a guarded all-reduce that works on any optional group"):
            if pg_utils.is_parallel(group):
                ds_comm.all_reduce(tensor, op=ops[op], group=group)
        return tensor

    @staticmethod
    def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
        """A ``torch.nn.Linear`` holding copies of ``weight`` and ``bias`` in their own layout (a weight
        passed as ``stored.t()`` stays transposed, as in the model it came from)."""
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight = torch.nn.Parameter(weight.detach().clone())  # clone keeps the strides of a dense tensor
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone())
        return layer

    def column_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """AutoTP's column-parallel layer (``LinearLayer``) in training mode."""
        from deepspeed.module_inject.layers import LinearLayer, set_autotp_mode

        _ensure_comm()
        set_autotp_mode(training=True)
        with _crash_is_deviation("A6", "a column-parallel layer for any optional group"):
            layer: torch.nn.Module = LinearLayer(self._linear(weight, bias), mp_group=group)
        return layer

    def row_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        """AutoTP's row-parallel layer (``LinearAllreduce``) in training mode."""
        from deepspeed.module_inject.layers import LinearAllreduce, set_autotp_mode

        _ensure_comm()
        set_autotp_mode(training=True)
        with _crash_is_deviation("A6", "a row-parallel layer for any optional group"):
            layer: torch.nn.Module = LinearAllreduce(self._linear(weight, bias), mp_group=group)
        return layer

    def vocab_parallel_cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int
    ) -> torch.Tensor:
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

        if group is not None:
            _ensure_comm()
        with _crash_is_deviation("A6", "the cross-entropy of the full logits for any optional group"):
            loss: torch.Tensor = vocab_parallel_cross_entropy(
                logits, target, tp_group=group, vocab_start_index=vocab_start,
                vocab_end_index=vocab_start + logits.shape[-1], reduction="mean",
            )  # fmt: skip
        return loss

    def global_norm(self, tensors: Iterable[torch.Tensor], mp_group: Any) -> torch.Tensor:
        """``get_global_norm_of_tensors``; DeepSpeed takes the model-parallel group through an mpu, and an
        absent dimension is ``mpu=None``."""
        from deepspeed.runtime.utils import get_global_norm_of_tensors

        _ensure_comm()
        mpu = None if mp_group is None else _Mpu(None, mp_group)
        with _crash_is_deviation("A6", "the global norm for any optional model-parallel group"):
            norm: torch.Tensor = get_global_norm_of_tensors(list(tensors), norm_type=2, mpu=mpu)
        return norm
