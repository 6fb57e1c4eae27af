"""Imported by the process world's fork server after its other preloads: where the session that started the
server feeds it more modules to import (:func:`dstest.worlds.process.launch.start_fork_server_fed`), the
server imports them here, as they come, until the session ends the feed.

The environment variable ``DSTEST_FORK_SERVER_FEED`` (removed again) names the feed: a file the session
appends JSON lines to, ``{"path": [...], "modules": [...]}`` (its ``sys.path`` then, and module names in the
order it imported them) and a last ``{"done": true}``. A pytest session feeds it what its collection imports,
test module by test module, so that the server imports a library the tests use (torchtitan's models: 2.1 s)
while pytest collects, and every worker starts with it imported.

- A module that fails to import here (any error: the server must not die of a module that expects a rank's
  environment) is passed over; the test that needs it imports it on its rank, and reports what fails, as
  before.
- A module whose import initialized CUDA in the server (a helper that asks for a device's capability at
  import) would leave every worker forked from it unable to use CUDA: the server stops there, and says so.
- The server stops following the feed at its last line, at a line it cannot read, at such a module, or when
  the session that started it has gone (it is then no longer the server's parent). It then writes
  ``{"cuda": name}`` to the file named like the feed with ``.end`` added (``name`` the module that
  initialized CUDA, else null). A session ends the feed, and reads that file, before it forks its first
  worker from the server (:func:`dstest.worlds.process.launch.settle_fork_server`).
"""

import importlib
import json
import os
import sys
import time

from dstest.worlds.process.launch import cuda_initialized

FEED_VAR = "DSTEST_FORK_SERVER_FEED"
#: How often the server looks at the feed for more lines while the session collects.
POLL_S = 0.01


def _import_all(names: list[str]) -> str | None:
    """Import ``names`` (passing over errors); the first that initialized CUDA, where one did (the rest are
    then not imported)."""
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):
            pass
        if cuda_initialized():
            return name
    return None


def follow(feed: str) -> str | None:
    """Import what the lines of ``feed`` name, as they are appended, until its last line; the module whose
    import initialized CUDA, where one did (the server then stops following)."""
    parent = os.getppid()
    pending = ""
    with open(feed, encoding="utf-8") as f:
        while True:
            chunk = f.read()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                try:
                    entry = json.loads(line)
                    if entry.get("done"):
                        return None
                    path, names = list(entry["path"]), list(entry["modules"])
                except (ValueError, TypeError, KeyError, AttributeError):
                    return None
                sys.path[:] = [str(p) for p in path]
                cuda = _import_all([str(n) for n in names])
                if cuda is not None:
                    return cuda
            if not chunk:
                if os.getppid() != parent:
                    return None
                time.sleep(POLL_S)


def _end(feed: str, cuda: str | None) -> None:
    try:
        with open(feed + ".end.tmp", "w", encoding="utf-8") as f:
            json.dump({"cuda": cuda}, f)
        os.replace(feed + ".end.tmp", feed + ".end")
    except OSError:
        pass


_feed = os.environ.pop(FEED_VAR, None)
if _feed:
    _cuda = None
    try:
        _cuda = follow(_feed)
    except OSError:
        pass
    _end(_feed, _cuda)
