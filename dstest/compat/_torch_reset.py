"""The per-run reset for tests on torch's test bases (registered by ``-p dstest.compat.torch``; see
:mod:`dstest.resets`): what those tests change in a worker's process beyond dstest's own reset (which puts
back the environment, the working directory, the default dtype, the deterministic switch and grad mode).

- torch's default device (``torch.set_default_device``, which ``DTensorTestBase`` tests and
  ``instantiate_device_type_tests`` use);
- dynamo's caches (``torch._dynamo.reset()``, what ``FSDPTest`` calls before each test), when dynamo is loaded;
- DeviceMesh's stack of entered meshes (a mesh a test entered as a context manager and never left).
"""

from __future__ import annotations

import sys

__all__ = ["reset_torch_testing"]


def reset_torch_testing() -> None:
    """Put back what a fresh process has; costs next to nothing for what was never imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    get_default_device = getattr(torch, "get_default_device", None)
    if get_default_device is not None and get_default_device() != torch.device("cpu"):
        torch.set_default_device(None)
    if "torch._dynamo" in sys.modules or "torch.distributed.device_mesh" in sys.modules:  # their leftovers
        from dstest.worlds.torch_internals import reset_bases_leftovers

        reset_bases_leftovers()
