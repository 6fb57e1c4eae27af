"""Fault injection (contract G5): make a rank die, a collective fail, or a rank slow, at a named call.

::

    from dstest.faults import Kill, Fail, Delay, Killed, InjectedFault, FaultNotFired

    dstest.run(train, 3, world="process", faults=[Kill(rank=2, op="all_reduce", nth=2)])

- ``Kill(rank, op="all_reduce", nth=1, group=None)``: the rank dies at its ``nth`` call of ``op`` on
  ``group``. In the process world its worker process kills itself (SIGKILL) and the pool is replaced after
  the run; in the threaded world its thread unwinds with a ``BaseException`` the code under test cannot
  catch with ``except Exception``. Its result in the run's return value is a :class:`Killed` marker.
- ``Fail(rank, op, nth, group=None)``: that call raises :class:`InjectedFault` on the rank, and on every
  peer that joins the same collective.
- ``Delay(rank, op, nth, group=None, seconds=1.0)``: the rank sleeps before that call, then makes it.

A fault that did not fire by the end of a run that otherwise passed fails it with :class:`FaultNotFired`,
naming the fault and the calls its rank made of that op: a recovery test whose fault names a call the code
never makes tests nothing. A fault meant to fire only in some runs says so: ``Kill(1, op="broadcast",
optional=True)``.

The peers of a killed rank see what gloo or NCCL with async error handling gives them: the collectives
(or their waits) that need the dead rank raise :class:`InjectedFault` at once, a
``torch.distributed.DistBackendError`` (so a ``RuntimeError``) whose message names the rank and says it was
injected. A run with faults passes when the survivors do: a killed rank is not a failure by itself.

``group``: None counts the rank's calls of ``op`` on every group together; ``"world"`` only those on the
default group; a list of global ranks only those on the group of exactly those ranks. ``op`` is a collective
name as dstest records it (:data:`FAULT_OPS`: ``all_reduce``, ``broadcast``, ``all_gather_into_tensor``...).
See docs/faults.md for a worked recovery example.
"""

from __future__ import annotations

from dstest.errors import FaultNotFired
from dstest.worlds.core.faults import FAULT_OPS, Delay, Fail, Fault, Kill, Killed
from dstest.worlds.injected import InjectedFault

__all__ = ["FAULT_OPS", "Delay", "Fail", "Fault", "FaultNotFired", "InjectedFault", "Kill", "Killed"]
