"""What the DeepSpeed adapter hands ``deepspeed.initialize`` (:mod:`dstest.targets.deepspeed`): its
communication backend over the formed world, a client torch optimizer, the specs' configuration and model
translated for DeepSpeed 0.19.8 (``DSTEST_DEEPSPEED_STRICT=1`` turns the translations off), and a
model-parallel unit over explicit groups; and the build of DeepSpeed's shm_comm op before the first spec
(:func:`prebuild`), which its communication backend otherwise JIT-builds inside the first spec's timeout.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dstest.targets._deepspeed_errors import DeepSpeedAdapterError
from dstest.worlds.build_locks import LOCK_FILE, LockState, clear_if_stale, torch_build_dir

__all__ = [
    "SHM_OP",
    "STRICT_ENV",
    "Mpu",
    "clear_stale_op_lock",
    "client_optimizer",
    "ensure_comm",
    "make_parameters_contiguous",
    "prebuild",
    "release_cached_groups",
    "run_build",
    "translate",
]

#: The op DeepSpeed's communication backend (``deepspeed.comm.torch.build_shm_op``) JIT-builds on CPU.
SHM_OP = "deepspeed_shm_comm"


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
    if not ds_comm.is_initialized():
        clear_stale_op_lock()  # a killed build's lock would make this rank wait for ever
    ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)


def clear_stale_op_lock() -> LockState | None:
    """Remove the build lock of DeepSpeed's shm_comm op if no live process holds it (a build killed at a
    timeout left it; see :mod:`dstest.worlds.build_locks`), saying so on stderr; None when there is no lock."""
    lock = torch_build_dir(SHM_OP) / LOCK_FILE
    if not lock.exists():
        return None
    state = clear_if_stale(lock)
    if state.removed:
        print(
            f"dstest: removed {lock}, left by a build that was killed (no live process holds it; torch would wait "
            "on it for ever)",
            file=sys.stderr,
            flush=True,
        )
    return state


def _build_due() -> bool:
    """Whether the op's library is missing or older than a source its build file names (DeepSpeed was
    upgraded): then the first rank's load would compile it. Otherwise a load only runs ninja, which finds
    nothing to do."""
    build_dir = torch_build_dir(SHM_OP)
    try:
        built = (build_dir / f"{SHM_OP}.so").stat().st_mtime
        ninja = (build_dir / "build.ninja").read_text()
    except OSError:
        return True
    for line in ninja.splitlines():  # "build shm.o: compile /.../csrc/cpu/comm/shm.cpp"
        if line.startswith("build ") and ": compile " in line:
            try:
                if os.stat(line.split(": compile ", 1)[1].strip()).st_mtime > built:
                    return True
            except OSError:
                return True
    return False


def run_build(argv: Sequence[str], env: Mapping[str, str], what: str, every: float = 30.0) -> int:
    """Run a build command in a child process, saying on stderr every ``every`` seconds that it is still
    building and, at the end, how long it took (or its output's last lines when it failed); its exit code.
    Ctrl-C kills the child and what it started (its build lock is then stale: :func:`clear_stale_op_lock`)
    and is raised again."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        # Its own session: on Ctrl-C the whole build (ninja, the compilers) is killed here, not left running.
        child = subprocess.Popen(
            list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        said = start
        try:
            while child.poll() is None:
                time.sleep(min(0.2, every))
                now = time.monotonic()
                if now - said >= every:
                    print(f"dstest: still building {what} ({now - start:.0f} s)", file=sys.stderr, flush=True)
                    said = now
        except BaseException:
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        code = int(child.returncode)
        seconds = time.monotonic() - start
        if code == 0:
            print(f"dstest: built {what} in {seconds:.0f} s", file=sys.stderr, flush=True)
        else:
            out.seek(0)
            tail = "\n".join(out.read().decode(errors="replace").splitlines()[-15:])
            print(f"dstest: building {what} failed (exit code {code}, {seconds:.0f} s):\n{tail}", file=sys.stderr)
    return code


# What the child runs: what DeepSpeed's TorchBackend calls first (deepspeed/comm/torch.py), so the op is built
# as a rank would build it: the same builder, flags and build directory.
_BUILD_SHM_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def prebuild(device: str, environment: Mapping[str, str]) -> None:
    """Build DeepSpeed's shm_comm op before the first spec (the target's ``prepare``), if a build is due.

    On CPU, DeepSpeed's communication backend JIT-builds the op the first time a process initialises it:
    about a minute on two busy cores, far into the first spec's timeout; killed there, the build left its
    lock, and every later spec waited on it (issue 40, finding 7). Built here in a child process with the
    ranks' ``environment`` (``DS_ACCELERATOR=cpu``) and this session's ``sys.path`` (the same DeepSpeed),
    with progress on stderr; a stale lock is removed first. A failed build is said and left to the specs,
    whose ranks fail with DeepSpeed's own error. Nothing to do on GPUs (the op is the CPU accelerator's),
    off Linux (DeepSpeed builds it there only), or without DeepSpeed."""
    if device != "cpu" or sys.platform != "linux" or importlib.util.find_spec("deepspeed") is None:
        return
    clear_stale_op_lock()
    if not _build_due():
        return
    env = {**os.environ, **environment, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    print(
        f"dstest: building DeepSpeed's {SHM_OP} op (first run on this machine: 1-5 min on 2 cores) in "
        f"{torch_build_dir(SHM_OP)} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        run_build([sys.executable, "-c", _BUILD_SHM_OP], env, f"DeepSpeed's {SHM_OP} op")
    finally:
        clear_stale_op_lock()  # the child killed (Ctrl-C) mid-build: its lock must not stay


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
