# torch cannot be imported twice in one process, and pytester's in-process runs drop the modules they
# imported: import torch and the worlds here, before any inline run, so every run shares them.
import torch  # noqa: F401

import dstest.specification  # noqa: F401
import dstest.worlds.fake  # noqa: F401
import dstest.worlds.threaded  # noqa: F401

pytest_plugins = ["pytester"]
