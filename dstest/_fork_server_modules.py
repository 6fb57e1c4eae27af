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
- The server stops following the feed at its last line, at a line it cannot read, or when the session that
  started it has gone (it is then no longer the server's parent). A session ends the feed before it forks
  its first worker from the server, which waits for the server's preloads to end.
"""

import importlib
import json
import os
import sys
import time

FEED_VAR = "DSTEST_FORK_SERVER_FEED"
#: How often the server looks at the feed for more lines while the session collects.
POLL_S = 0.01


def _import_all(names: list[str]) -> None:
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):
            continue


def follow(feed: str) -> None:
    """Import what the lines of ``feed`` name, as they are appended, until its last line."""
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
                        return
                    path, names = list(entry["path"]), list(entry["modules"])
                except (ValueError, TypeError, KeyError, AttributeError):
                    return
                sys.path[:] = [str(p) for p in path]
                _import_all([str(n) for n in names])
            if not chunk:
                if os.getppid() != parent:
                    return
                time.sleep(POLL_S)


_feed = os.environ.pop(FEED_VAR, None)
if _feed:
    try:
        follow(_feed)
    except OSError:
        pass
