"""What the DeepSpeed adapter hands ``deepspeed.initialize`` (:mod:`dstest.targets.deepspeed`): its
communication backend over the formed world, a client torch optimizer, the specs' configuration and model
translated for DeepSpeed 0.19.8 (``DSTEST_DEEPSPEED_STRICT=1`` turns the translations off), and a
model-parallel unit over explicit groups.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dstest.targets._deepspeed_errors import DeepSpeedAdapterError

__all__ = [
    "STRICT_ENV",
    "Mpu",
    "client_optimizer",
    "ensure_comm",
    "make_parameters_contiguous",
    "release_cached_groups",
    "translate",
]


def release_cached_groups() -> None:
    """Forget the process groups DeepSpeed cached in module globals during an earlier run of this process
    (the world destroyed them). DeepSpeed's own hook for this runs when DeepSpeed destroys the world
    group; the process world destroys only the subgroups, so it is called here."""
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    groups._release_process_group_references(group=None)
    partition_parameters.shutdown_init_context()
    partition_parameters.empty_buffers.clear()
    partition_parameters.temp_contiguous_tensor = None


def ensure_comm() -> None:
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


def client_optimizer(section: Mapping[str, Any] | None, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
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


#: Set to 1 to hand DeepSpeed the specs' models and configurations untranslated (see :func:`translate`).
STRICT_ENV = "DSTEST_DEEPSPEED_STRICT"
_notes_printed: set[str] = set()


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _note(key: str, text: str) -> None:
    """Say once per process (in the rank's output) what the adapter translated."""
    if key not in _notes_printed:
        _notes_printed.add(key)
        print(f"dstest: {text} ({STRICT_ENV}=1 turns this off)", file=sys.stderr)


def translate(config: Mapping[str, Any]) -> dict[str, Any]:
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


def make_parameters_contiguous(model: torch.nn.Module) -> None:
    """Give every non-contiguous parameter a contiguous copy of its data, in place.

    DeepSpeed 0.19.8 cannot take a model with a non-contiguous parameter: ``DeepSpeedEngine.
    _broadcast_model`` broadcasts ``p.data.view(torch.uint8)``, which raises "self.stride(-1) must be 1 to
    view Float as Byte" (at every world size, W = 1 included). The bundled specs' model stores one weight
    transposed on purpose (contract A7), so without this every engine spec would report that one finding and
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


class Mpu:
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
