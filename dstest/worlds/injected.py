"""The exceptions of injected faults (contract G5), shared by the threaded and the process world.

:class:`InjectedFault` is what a rank's collective raises when a fault broke it: a peer was killed, or a
``Fail`` fault failed the collective. It subclasses ``torch.distributed.DistBackendError`` (a
``RuntimeError``) where torch has it, so recovery code written for gloo or NCCL
(``except dist.DistBackendError``, ``except RuntimeError``) catches it unchanged. Errors of this class are
expected: a rank that catches one and finishes is not failed for swallowing a dstest error.

:class:`RankKilled` unwinds a killed rank's thread in the threaded world: a ``BaseException``, so that the
code under test cannot swallow it with ``except Exception`` (as it cannot stop a SIGKILL).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["InjectedFault", "RankKilled"]

_Base: type[RuntimeError] = getattr(dist, "DistBackendError", RuntimeError)


class InjectedFault(_Base):  # type: ignore[valid-type, misc]
    """A collective broken by an injected fault (a peer killed, or a ``Fail``); its message says which."""


class RankKilled(BaseException):
    """Unwinds the thread of a rank a ``Kill`` fault ended (threaded world); never reaches user code's
    ``except Exception``. ``args[0]``: the fault."""
