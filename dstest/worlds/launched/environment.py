"""Who this process is in a launch: the launcher's environment variables read (without importing torch),
and the backend the launched world uses on this node."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dstest.errors import InvalidArgument

__all__ = ["BACKEND_ENV", "LaunchEnvironment", "backend_name", "launch_environment"]

#: Chooses the launched world's backend: ``gloo`` or ``nccl`` (default: nccl when every local rank has a GPU).
BACKEND_ENV = "DSTEST_LAUNCHED_BACKEND"
#: The variables that say "this process was launched as one rank of a world".
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class LaunchEnvironment:
    """Who this process is in the launch, read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    #: Distinguishes launches (and torch elastic restarts) that share one store.
    tag: str


def _int_variable(env: dict[str, str], name: str, default: int | None, low: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise InvalidArgument(f"{name} is not set; a launcher (torchrun) sets it for every rank")
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"{name}={text!r}: must be an int >= {low} (the launcher sets it)") from None
    if value < low:
        raise InvalidArgument(f"{name}={text!r}: must be an int >= {low} (the launcher sets it)")
    return value


def launch_environment(env: dict[str, str] | None = None) -> LaunchEnvironment | None:
    """This process's place in a launch, or None when no launcher started it (no ``RANK``/``WORLD_SIZE``).

    Imports no torch. A launch that sets some of the variables, or values that are not ranks, raises
    :class:`~dstest.errors.InvalidArgument` naming the variable, the value and what is allowed.
    """
    env = dict(os.environ if env is None else env)
    present = [name for name in _LAUNCH_VARIABLES if env.get(name)]
    if not present and not env.get("TORCHELASTIC_RUN_ID"):
        return None
    missing = [name for name in _LAUNCH_VARIABLES if not env.get(name)]
    if missing:
        raise InvalidArgument(
            f"launched world: {', '.join(present) or 'TORCHELASTIC_RUN_ID'} set but {', '.join(missing)} not; "
            "start pytest with a launcher that sets all of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
            "(torchrun does), or unset them to run without one"
        )
    world_size = _int_variable(env, "WORLD_SIZE", None, 1)
    rank = _int_variable(env, "RANK", None, 0)
    if rank >= world_size:
        raise InvalidArgument(f"RANK={rank}: must be < WORLD_SIZE={world_size}")
    local_world_size = _int_variable(env, "LOCAL_WORLD_SIZE", 1, 1)
    local_rank = _int_variable(env, "LOCAL_RANK", 0, 0)
    if local_rank >= local_world_size:
        raise InvalidArgument(f"LOCAL_RANK={local_rank}: must be < LOCAL_WORLD_SIZE={local_world_size}")
    port = _int_variable(env, "MASTER_PORT", None, 1)
    if port > 65535:
        raise InvalidArgument(f"MASTER_PORT={port}: must be a TCP port, 1-65535")
    tag = f"{env.get('TORCHELASTIC_RUN_ID', 'static')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return LaunchEnvironment(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=env["MASTER_ADDR"],
        master_port=port,
        tag=tag,
    )


def backend_name(local_world_size: int = 1) -> str:
    """``gloo`` or ``nccl``: :data:`BACKEND_ENV` if set, else nccl when this node has a GPU per local rank."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise InvalidArgument(f"{BACKEND_ENV}={chosen!r}: allowed values are 'gloo' and 'nccl'")
        return chosen
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"
