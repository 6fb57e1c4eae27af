"""Collects the bundled specs of docs/contracts.md parts A, B (stage 3 included) and C (run against
``--dstest-target``, impl by default)."""

from dstest.conformance.grad_norm import *  # noqa: F403
from dstest.conformance.grad_reduction import *  # noqa: F403
from dstest.conformance.non_contiguous import *  # noqa: F403
from dstest.conformance.optional_groups import *  # noqa: F403
