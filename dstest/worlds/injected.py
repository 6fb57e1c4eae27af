"""The exception of a collective that an injected fault broke (contract G5), shared by the threaded and the
process world.

:class:`InjectedFault` is what a rank's collective raises when a fault broke it: a peer was killed, or a
``Fail`` fault failed the collective. It subclasses ``torch.distributed.DistBackendError`` (a
``RuntimeError``) where torch has it, so recovery code written for gloo or NCCL
(``except dist.DistBackendError``, ``except RuntimeError``) catches it unchanged. Errors of this class are
expected: a rank that catches one and finishes is not failed for swallowing a dstest error.

It lives beside the worlds, not in either: both raise it, and the torch-free checking core
(:mod:`dstest.worlds.core.faults`) cannot define a subclass of a torch class. How a killed rank's thread
unwinds is the threaded world's own (:class:`dstest.worlds.threaded.failures.RankKilled`).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["InjectedFault"]

_Base: type[RuntimeError] = getattr(dist, "DistBackendError", RuntimeError)


class InjectedFault(_Base):  # type: ignore[valid-type, misc]
    """A collective broken by an injected fault (a peer killed, or a ``Fail``); its message says which."""
