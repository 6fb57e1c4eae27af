# torch cannot be imported twice in one process, and pytester's in-process runs drop the modules they
# imported: import torch and the worlds here, before any inline run, so every run shares them.
import torch  # noqa: F401
from hypothesis import settings

import dstest.specification
import dstest.worlds.fake
import dstest.worlds.threaded  # noqa: F401

pytest_plugins = ["pytester"]

# CI and this project's machines have 2 shared cores: a wall-clock deadline per example only measures the
# neighbours. Tests that need other settings still set them with @settings.
settings.register_profile("dstest", deadline=None)
# The checkers' own properties (tests/test_checker_properties*.py) leave max_examples to the profile: the
# default profile runs hypothesis' usual 100 examples each in `pytest -m cpu`; `--hypothesis-profile=soak` runs
# 5,000 each (docs/checking-the-checkers.md).
settings.register_profile("soak", deadline=None, max_examples=5000)
settings.load_profile("dstest")
