"""The bundled conformance specs: the contracts of docs/contracts.md that any target can meet (impl, DeepSpeed, ...).

Modules: ``optional_groups`` (A1-A8), ``non_contiguous`` (A5-A7 at the call sites of A6 with the views
real models pass), ``grad_reduction`` (B1-B9, stage 3 included), ``grad_norm``
(C1-C7), ``zero3`` (D1, D7, D8 through the engine). Each spec is a ``@dstest.spec`` named
``test_<contract>_<what>`` that drives the system under test only through ``ctx.target`` and skips what
the target lacks (:func:`dstest.targets.require`). Checks of impl's own pieces (its partitioner, gatherer,
registration check and native ops) are impl's tests, in ``tests/test_impl_*.py``.

The helpers the specs share live in :mod:`dstest.conformance._helpers`; the names below are re-exported for
tests and for spec authors outside the package.
"""

from __future__ import annotations

from dstest.conformance import _helpers
from dstest.conformance._helpers import *  # noqa: F403  (listed once: _helpers.__all__)

__all__ = list(_helpers.__all__)
