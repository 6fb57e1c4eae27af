"""What a compat plugin's collection imports, fed to the fork server while pytest collects.

The plugin starts the fork server when it is configured, before collection, so that the server imports torch
(and the suite's bases) while pytest collects. What the test modules import besides (torchtitan's models:
2.1 s) each worker would import again at its first test of the module; a session with pools of 1, 2, 4 and 8
ranks has 15 workers. Fed here, the server imports it too, test module by test module, in the order the
session did and with the session's ``sys.path`` (:func:`dstest.worlds.process.launch.start_fork_server_fed`),
and the feed ends when the collection does, before the first worker is forked.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import pytest

#: Modules of these packages are the session's own (pytest's, its plugins', dstest's), not the tests' imports.
_OWN = frozenset({"dstest", "_pytest", "pytest", "pluggy", "py", "_hypothesis_pytestplugin", "xdist", "execnet"})


@dataclass
class ServerFeed:
    """The modules the session had imported when the server started, or that were fed to it since."""

    seen: set[str]
    count: int


_FEED_KEY = pytest.StashKey[ServerFeed]()


def start(config: pytest.Config, preload: tuple[str, ...] = ()) -> bool:
    """Start the fork server, which imports ``preload`` after torch, fed from then on where this session's
    own server is one (:func:`~dstest.worlds.process.launch.start_fork_server_fed`). Call it before this
    process imports torch (the plugin's ``pytest_configure``, tried first): the server then imports torch on
    the other core at the same time. Returns whether it is fed."""
    # launch, not byref: it imports the standard library only, and byref imports torch
    from dstest.worlds.process.launch import end_fork_server_feed, preload_in_fork_server, start_fork_server_fed

    preload_in_fork_server(*preload)
    if xdist_controller(config):  # its workers run the tests, each with a server of its own
        return False
    folder = tempfile.mkdtemp(prefix="dstest-fork-server-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    config.add_cleanup(end_fork_server_feed)  # a session that never finished collecting, at the latest
    if not start_fork_server_fed(os.path.join(folder, "feed")):
        return False
    config.stash[_FEED_KEY] = ServerFeed(seen=set(sys.modules), count=len(sys.modules))
    return True


def xdist_controller(config: pytest.Config) -> bool:
    """Whether this session hands its tests to pytest-xdist's workers (``-n N``, N > 0) and runs none itself."""
    if hasattr(config, "workerinput"):
        return False
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and getattr(config.option, "dist", "load") != "no"


def new_imports(seen: set[str]) -> list[str]:
    """The modules imported since ``seen`` that a worker would import again at its first test, in import
    order: not the test modules and conftests (pytest rewrites them, and each worker imports them itself, as
    rewritten), not pytest's, its plugins' or dstest's own. Adds every module it looked at to ``seen``."""
    names = []
    for name, module in list(sys.modules.items()):
        if name in seen:
            continue
        seen.add(name)
        if module is None or name == "__main__" or name.partition(".")[0] in _OWN:
            continue
        if type(getattr(module, "__loader__", None)).__name__ == "AssertionRewritingHook":
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path.endswith("conftest.py"):
            continue
        names.append(name)
    return names


def feed(config: pytest.Config) -> None:
    """Feed the server what the session imported since the last call (nothing where it is not fed)."""
    state = config.stash.get(_FEED_KEY, None)
    if state is None or len(sys.modules) == state.count:
        return
    from dstest.worlds.process.launch import feed_fork_server

    names = new_imports(state.seen)
    state.count = len(sys.modules)
    if not feed_fork_server(names):
        del config.stash[_FEED_KEY]


def end(config: pytest.Config) -> None:
    """Feed what is left and end the feed: the collection is done."""
    feed(config)
    if config.stash.get(_FEED_KEY, None) is None:
        return
    from dstest.worlds.process.launch import end_fork_server_feed

    end_fork_server_feed()
    del config.stash[_FEED_KEY]
