"""What the compat plugin for torch's own suites reads of torch's distributed test bases, and what they leave.

torch's ``MultiProcessTestCase`` family lives in the private ``torch.testing._internal.common_distributed``
(torch 2.11-2.15): the timeout of each test, the exit codes of its skips. A test on those bases also leaves
dynamo's caches and DeviceMesh's stack of entered meshes in the worker (:func:`reset_bases_leftovers`).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["bases_default_timeout", "bases_skip_message", "bases_timeout", "reset_bases_leftovers"]


def _bases() -> Any:
    from torch.testing._internal import common_distributed

    return common_distributed


def bases_timeout(test_id: str) -> float:
    """The seconds torch's bases give test ``test_id`` (``common_distributed.get_timeout``)."""
    return float(_bases().get_timeout(test_id))


def bases_default_timeout() -> float:
    """The seconds torch's bases give a test by default (``common_distributed.TIMEOUT_DEFAULT``; 300 where a
    version has none)."""
    return float(getattr(_bases(), "TIMEOUT_DEFAULT", 300))


def bases_skip_message(exit_code: Any) -> str | None:
    """The message of the skip that a rank of torch's bases exits with ``exit_code`` for
    (``common_distributed.TEST_SKIPS``), or None when no skip has that code."""
    return next((s.message for s in _bases().TEST_SKIPS.values() if s.exit_code == exit_code), None)


def reset_bases_leftovers() -> None:
    """Drop what a test on torch's bases leaves in the process, for what is imported: dynamo's caches
    (``torch._dynamo.reset()``, what ``FSDPTest`` calls before each test) and DeviceMesh's stack of entered
    meshes (``device_mesh._mesh_resources.mesh_stack``: a mesh a test entered as a context manager and never
    left; torch 2.11-2.15)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    mesh = sys.modules.get("torch.distributed.device_mesh")
    stack = getattr(getattr(mesh, "_mesh_resources", None), "mesh_stack", None)
    if isinstance(stack, list):
        stack.clear()
