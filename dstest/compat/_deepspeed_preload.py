"""Imported by the fork server of a ``-p dstest.compat.deepspeed`` run (see
:func:`dstest.worlds.process.launch.preload_in_fork_server`), so that every warm worker starts with DeepSpeed
imported, and with what DeepSpeed imports on first use and every test of its suite then needs: torch._dynamo
(its optimizers' ``_disable_dynamo``) and the ZeRO Muon optimizer module, which every ``deepspeed.initialize``
imports to check the optimizer and whose ``torch.compile`` at import loads much of torch._inductor. Measured
here: about 5 s of imports per worker, paid once by the server instead.

Any error is turned into ImportError, the only one the fork server passes over: a DeepSpeed that cannot be
imported is then imported, and reported, by the test that needs it, as without the preload. A module that
this DeepSpeed version lacks is left out.
"""

import importlib

#: In import order; the first two are needed, the rest are optional (a DeepSpeed version may lack them).
_NEEDED = ("torch._dynamo", "deepspeed")
_OPTIONAL = ("deepspeed.runtime.zero.muon.muon_optimizer",)

try:
    for _name in _NEEDED:
        importlib.import_module(_name)
except Exception as exc:  # reported by the test that imports it
    raise ImportError(f"DeepSpeed is not preloaded: {type(exc).__name__}: {exc}") from exc
for _name in _OPTIONAL:
    try:
        importlib.import_module(_name)
    except Exception:  # a test that needs it imports it, and reports what fails
        continue
