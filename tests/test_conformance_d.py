"""Collects the bundled specs of SPEC.md part D and stage-3 B2/B8 (run against ``--dstest-target``, impl by default)."""

from dstest.specs.zero3 import *  # noqa: F403
