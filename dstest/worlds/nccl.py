"""The NCCL world: one process per GPU, NCCL backend; the process world's pools with another backend.

``world_size`` ranks need ``world_size`` CUDA devices. With fewer (but at least one), the ranks run as
threads of this process with CUDA tensors (:class:`dstest.worlds.threaded.ThreadedWorld` on ``cuda``),
the documented stand-in on a single-GPU machine: the spec's data lives on the GPU and the collectives
are dstest's own, checked for mismatches, instead of NCCL's. ``ctx.world`` tells which ran
(``"nccl"`` or ``"threaded"``). With no CUDA device, :meth:`NcclWorld.unavailable_reason` gives the skip
reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest

if TYPE_CHECKING:
    from dstest.worlds.process import ProcessWorld

__all__ = ["NcclWorld"]


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class NcclWorld:
    """Runs a function on every rank over NCCL, rank r on ``cuda:r`` (same contract as ProcessWorld)."""

    name = "nccl"
    #: Hazards and strict shapes are checked where the threaded stand-in runs (fewer GPUs than ranks; it refuses
    #: watch_modules), module state is watched where real NCCL runs (its worker pools check neither); no faults.
    capabilities = Capabilities(hazards=True, module_watch=True, strict_shapes=True)
    _started = False  # whether a run went to the NCCL worker pools (close() stops them)

    def _processes(self) -> ProcessWorld:
        # Imported only when GPUs are there: a GPU-less run never loads the process pools.
        from dstest.worlds.process import ProcessWorld

        return ProcessWorld(backend="nccl", device="cuda", name=self.name)

    @property
    def marker(self) -> str:
        return "gpu"

    def unavailable_reason(self, world_size: int) -> str | None:
        found = _cuda_devices()
        if found == 0:
            return f"needs {world_size} CUDA devices, found 0"
        if found >= world_size:
            return self._processes().unavailable_reason(world_size)
        return None  # the threaded stand-in runs it

    def close(self) -> None:
        """Stop the NCCL worker pools of this process (the threaded stand-in keeps nothing: it runs cold)."""
        if self._started:
            self._processes().close()

    def run(self, request: RunRequest) -> list[Any]:
        self.capabilities.refuse(request, self.name)
        world_size = request.world_size
        found = _cuda_devices()
        if found == 0:
            from dstest.errors import InvalidWorldSize

            raise InvalidWorldSize(
                f"world_size={world_size!r}: the nccl world needs {world_size} CUDA devices, found 0"
            )
        if found < world_size:
            from dstest.worlds.threaded import ThreadedWorld

            return ThreadedWorld(device="cuda").run(request)
        self._started = True
        return self._processes().run(request.replace(async_hazards=False, strict_shapes=False))
