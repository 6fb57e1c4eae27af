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
    # What every rank of a process-based test imports on its first run, measured on a warm worker: the
    # bases' device helpers and this plugin's rank side. Imported here, the first test waits only for its own
    # module (0.3-1.3 s less on 2 busy cores, four workers importing at once).
    "torch.testing._internal.common_cuda",
    "torch.testing._internal.common_device_type",
    "dstest.compat._torch_rank",
    "dstest.compat._torch_reset",
    "dstest.compat._warm_run",
)

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # a test that needs it imports it, and reports what fails
        continue
