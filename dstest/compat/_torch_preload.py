"""Imported by the fork server of a ``-p dstest.compat.torch`` run (see
:func:`dstest.worlds.process.launch.preload_in_fork_server`), so that every warm worker starts with torch's
distributed test bases and the stacks their tests use imported once, not once per worker.

Any error is turned into ImportError, the only one the fork server passes over: a module that cannot be
imported is then imported, and reported, by the test that needs it. A module this torch lacks is left out.
"""

import importlib

_MODULES = (
    "torch.testing._internal.common_utils",
    "torch.testing._internal.common_distributed",
    "torch.distributed.tensor",
    "torch.testing._internal.distributed._tensor.common_dtensor",
    "torch.distributed.fsdp",
    "torch.testing._internal.common_fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor.parallel",
)

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # a test that needs it imports it, and reports what fails
        continue
