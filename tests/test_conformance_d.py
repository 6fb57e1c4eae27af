"""Collects the bundled specs of docs/contracts.md part D that go through the engine (run against ``--dstest-target``,
impl by default); impl's component checks are in ``test_impl_zero3_components.py``."""

from dstest.conformance.zero3 import *  # noqa: F403
