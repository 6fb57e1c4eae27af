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
settings.load_profile("dstest")
